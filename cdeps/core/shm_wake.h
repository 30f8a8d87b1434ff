/* shm endpoints: owned names and wake-ups (shm_wake.c). */
#ifndef AIOTE_CORE_SHM_WAKE_H
#define AIOTE_CORE_SHM_WAKE_H

#include "internal.h"

/* Removes the files of aiote processes that are gone. Once per process, before its first
 * shm endpoint. */
AIO_INTERNAL void aio__shm_sweep_stale(void);
/* Names a new shm endpoint (before fi_enable) and creates its wake word and fifo. 0, or a
 * negative error (nothing left behind). */
AIO_INTERNAL int aio__shm_own_endpoint(aio_rail *r);
/* Forgets how to wake one peer (its address was removed or reused). Caller holds r->mu. */
AIO_INTERNAL void aio__shm_wpeer_forget(shm_wpeer *w);
/* Our own endpoint's and our peers' wake-up objects, at aio__rail_free. */
AIO_INTERNAL void aio__shm_own_release(aio_rail *r);
/* After a request to `fa` went to (or was refused by) an shm rail's provider: wakes the
 * target's poller if it sleeps. Caller holds r->mu. */
AIO_INTERNAL void aio__shm_wake(aio_rail *r, uint64_t fa);
/* Whether the aiote process behind shm address `fa` is gone (sticky; one flock call while it
 * lives). A request to it must not be posted: libfabric's shm provider would spin for ever on a
 * lock in its region that it may have held as it died. Caller holds r->mu. */
AIO_INTERNAL int aio__shm_peer_gone(aio_rail *r, uint64_t fa);
/* A request refused because its same-host peer is gone: counted (posts_peer_gone), and the
 * error it fails with. Nothing was posted. */
static inline int aio__peer_gone_refusal(aio_engine *e) {
    atomic_fetch_add_explicit(&e->st_gone, 1, memory_order_relaxed);
    return -AIO_EPEERGONE;
}

#endif
