/* The completion ring and its eventfd (ring.c). */
#ifndef AIOTE_CORE_RING_H
#define AIOTE_CORE_RING_H

#include "internal.h"

/* The overflow's reserve nodes (engine-wide) and a poller's stash (per poller): see ring.c. */
#define RING_RESERVE 1024
#define RING_STASH 1024
#ifdef AIO_TEST_HOOKS
extern _Atomic int aio_test_ovf_malloc_fail; /* tests: the overflow list's malloc fails */
#endif

/* The poller this thread is (poller.c sets it; NULL on other threads): whose stash a record
 * goes to when the ring is full, and who may read completions while it is. */
extern __thread struct aio_poller *aio__tl_poller AIO_INTERNAL;

/* Pushes a record (any thread); quiet: no eventfd signal unless a task waits for quiet
 * records or the ring fills up. */
AIO_INTERNAL void aio__ring_put(aio_engine *e, const aio_record *r, int quiet);
static inline void aio__ring_push(aio_engine *e, const aio_record *r) { aio__ring_put(e, r, 0); }
/* A poller moves its stash into the ring: 1 while some is left (it must produce nothing). */
AIO_INTERNAL int aio__stash_flush(aio_poller *q);
/* A poller thread's records signal the loop once the poller lets go of the rail it read them
 * under (see ring.c): the signal they await, if any, now. */
AIO_INTERNAL void aio__ring_signal_due(aio_poller *q);

#endif
