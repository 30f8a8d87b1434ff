/* Large same-host copies in parts (copier.c). */
#ifndef AIOTE_CORE_COPIER_H
#define AIOTE_CORE_COPIER_H

#include "internal.h"

typedef struct aio_copier aio_copier;

/* Copies bytes [off, off + len) of one copy: 0 or a negative error. */
typedef int (*aio_part_fn)(void *ctx, uint64_t off, uint64_t len);
/* Makes a copy of n bytes with fn: in one call when n is small, else in parts at once, poller
 * 0's and the engine's helper threads' (poller 0 only: one job at a time). Returns once all
 * are done: 0, or the first part's error, else the lowest failed helper part's. */
AIO_INTERNAL int aio__split(aio_engine *e, uint64_t n, aio_part_fn fn, void *ctx);
/* Stops and joins the helper, if one was started (after the pollers are joined). */
AIO_INTERNAL void aio__copier_free(aio_engine *e);

#endif
