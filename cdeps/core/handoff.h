/* The poller's queue: requests handed over by posting threads, and direct copies (handoff.c). */
#ifndef AIOTE_CORE_HANDOFF_H
#define AIOTE_CORE_HANDOFF_H

#include "internal.h"

/* Queues op for a poller: a direct copy (`post` 0) for poller 0, or a request (`post` 1) for
 * the poller of its rail to post. The caller kicks that poller. */
AIO_INTERNAL void aio__direct_enqueue(aio_engine *e, aio_op *op, const aio_op_desc *it, int post);
/* The poller's part: runs its queue (poller.c, at every pass). Returns how much it did. */
AIO_INTERNAL int aio__direct_run(aio_poller *q);

/* Whether a request to `peer` may be handed to the poller (see DEFER_PEERS): lock-free. */
static inline int defer_get(aio_rail *r, uint64_t peer) {
    if (peer >= DEFER_PEERS) return 0;
    _Atomic uint8_t *c = atomic_load(&r->defer_ok[peer / DEFER_CHUNK]);
    return c ? atomic_load(&c[peer % DEFER_CHUNK]) : 0;
}

/* Sets the flag; a chunk is allocated when set to 1 the first time (caller holds r->mu). */
static inline void defer_set(aio_rail *r, uint64_t peer, uint8_t on) {
    if (peer >= DEFER_PEERS) return;
    _Atomic uint8_t *c = atomic_load(&r->defer_ok[peer / DEFER_CHUNK]);
    if (!c) {
        if (!on || !(c = calloc(DEFER_CHUNK, 1))) return;
        atomic_store(&r->defer_ok[peer / DEFER_CHUNK], c);
    }
    atomic_store(&c[peer % DEFER_CHUNK], on);
}

#endif
