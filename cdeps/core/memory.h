/* Memory registration (memory.c). */
#ifndef AIOTE_CORE_MEMORY_H
#define AIOTE_CORE_MEMORY_H

#include "internal.h"

/* Registers [buf, buf + len) on one rail (bound to its endpoint where the provider wants it).
 * Caller holds r->mu, or the rail is not in use yet. */
AIO_INTERNAL int aio__reg_local(aio_rail *r, void *buf, size_t len, uint64_t access, struct fid_mr **mr,
                                void **desc, uint64_t key, int iface, int device);
/* A random key that fits the rail's mr_key_size (providers that take the application's keys). */
AIO_INTERNAL uint64_t aio__random_key(aio_rail *r);

#endif
