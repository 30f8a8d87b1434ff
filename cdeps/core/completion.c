/* Completions: what a rail's completion queue says, and the ops it names.
 *
 * Theory of operation. Each rail has one completion queue for everything its endpoint does:
 * our writes, reads and sends, the receives of its message slots, and the remote CQ data
 * (immediates) of peers' writes into our memory. It is read under the rail's lock (the domain
 * is FI_THREAD_DOMAIN: we serialize every call) by whichever thread drives the rail: its
 * poller thread (poller.c), a posting thread waiting for room (post.c), or the loop thread in
 * aio_poll_ring (ring.c). What is read becomes records in the ring or credits of counters;
 * nothing here blocks.
 *
 * A completion's context is an aio_op (fi_context2 first, as FI_CONTEXT2 asks): one of the
 * rail's receive ops (one per message slot: the record names the slot, which stays the
 * loop's until aio_recv_repost), or an op of the rail's pool (max_ops, a free list) for our
 * own requests. The pool has its own small lock, pool_mu, innermost: a posting thread takes an
 * op without the rail's lock when it hands the request to the poller (handoff.c). Completing
 * an op (aio__complete_op) lets go of everything the request held: the region's in-flight
 * count (aio_mr_close waits on it), the send slot, the op, the engine's and the poller's
 * in-flight counts (the poller's spin reads its own), and one request of its group; it
 * reports room to post (AIO_REC_SPACE) once in-flight work falls to what aio_want_space
 * asked for. A failed request also stops hand-overs to its peer (handoff.h) until the
 * provider takes a request to it again. */
#include "internal.h"

#include "completion.h"
#include "groups.h"
#include "handoff.h"
#include "ring.h"

#define CQ_BATCH 64

aio_op *aio__op_get(aio_rail *r) {
    pthread_mutex_lock(&r->pool_mu);
    aio_op *op = NULL;
    if (r->free_head >= 0) {
        op = &r->ops[r->free_head];
        r->free_head = op->next_free;
    }
    pthread_mutex_unlock(&r->pool_mu);
    return op;
}

void aio__op_put(aio_rail *r, aio_op *op) {
    int32_t idx = (int32_t)(op - r->ops);
    pthread_mutex_lock(&r->pool_mu);
    op->next_free = r->free_head;
    r->free_head = idx;
    pthread_mutex_unlock(&r->pool_mu);
}

static int is_recv_op(aio_rail *r, void *ctx) {
    if (!ctx || !r->recv_ops) return 0;
    aio_op *op = ctx;
    return op >= r->recv_ops && op < r->recv_ops + r->nslots;
}

/* caller holds r->mu */
int aio__post_recv_locked(aio_rail *r, uint32_t slot) {
    aio_op *op = &r->recv_ops[slot];
    int ret = -FI_EAGAIN;
    for (int attempt = 0; attempt < 1000 && ret == -FI_EAGAIN; attempt++)
        ret = (int)fi_recv(r->ep, r->recv_buf + (uint64_t)slot * r->slot_size, r->slot_size,
                           r->recv_desc, FI_ADDR_UNSPEC, &op->ctx);
    return ret;
}

/* Completes our own op (write/read/send). Caller holds r->mu. */
void aio__complete_op(aio_engine *e, aio_rail *r, aio_op *op, int status, int prov_errno) {
    if (op->mr) atomic_fetch_sub(&op->mr->inflight, 1);
    if (op->bytes) atomic_fetch_sub_explicit(&r->bytes_inflight, op->bytes, memory_order_relaxed);
    if (op->kind == OPK_SEND) r->send_free[r->send_nfree++] = op->slot;
    else if (status) defer_set(r, op->peer, 0);
    int64_t g = op->group;
    aio__op_put(r, op);
    inflight_add(e, r, -1);
    aio__group_op_done(e, g, status, prov_errno);
    int64_t w = atomic_load_explicit(&e->want_below, memory_order_relaxed);
    if (w >= 0 && atomic_load(&e->ops_in_flight) <= w &&
        atomic_compare_exchange_strong(&e->want_below, &w, -1)) {
        aio_record rec = {.kind = AIO_REC_SPACE};
        aio__ring_push(e, &rec);
    }
}

void aio_want_space(aio_engine *e, int64_t below) {
    atomic_store(&e->want_below, below < 0 ? 0 : below);
    /* everything may have completed meanwhile: nobody would report it */
    int64_t w = atomic_load(&e->want_below);
    if (w >= 0 && atomic_load(&e->ops_in_flight) <= w && atomic_compare_exchange_strong(&e->want_below, &w, -1)) {
        aio_record rec = {.kind = AIO_REC_SPACE};
        aio__ring_push(e, &rec);
    }
}

static void handle_remote_data(aio_engine *e, aio_rail *r, uint64_t data) {
    uint32_t imm = (uint32_t)data;
    uint64_t units = AIO_CREDIT_UNIT;
    if (r->cq_data_size >= 8) {
        uint64_t w = data >> 32;
        if (w) units = w;
    }
    atomic_fetch_add_explicit(&e->st_remote, 1, memory_order_relaxed);
    aio_counter_add(e, imm, units);
}

/* Reads and processes up to one batch of completions. Caller holds r->mu. */
int aio__progress_locked(aio_engine *e, aio_rail *r) {
    /* the ring is full: only pollers read completions (their records wait in their stash, see
     * RING_STASH); another thread leaves them in the provider rather than use up the reserve */
    if (!(aio__tl_poller && aio__tl_poller->e == e) &&
        (atomic_load(&e->ovf_count) > 0 ||
         atomic_load(&e->ring_tail) - atomic_load(&e->ring_head) > e->ring_mask))
        return 0;
    struct fi_cq_data_entry ent[CQ_BATCH];
    ssize_t n = fi_cq_read(r->cq, ent, CQ_BATCH);
    if (n > 0) {
        atomic_fetch_add_explicit(&e->st_completions, (uint64_t)n, memory_order_relaxed);
        for (ssize_t i = 0; i < n; i++) {
            uint64_t fl = ent[i].flags;
            void *ctx = ent[i].op_context;
            if ((fl & FI_REMOTE_CQ_DATA) && !(fl & FI_MSG)) {
                handle_remote_data(e, r, ent[i].data);
                if (is_recv_op(r, ctx)) aio__post_recv_locked(r, ((aio_op *)ctx)->slot);
                continue;
            }
            if (fl & FI_REMOTE_WRITE || fl & FI_REMOTE_READ) continue;
            if (is_recv_op(r, ctx)) {
                if (atomic_load_explicit(&e->msg_rail, memory_order_relaxed) != r->index)
                    atomic_store_explicit(&e->msg_rail, r->index, memory_order_relaxed);
                aio_record rec = {0};
                rec.kind = AIO_REC_RECV;
                rec.rail = r->index;
                rec.a = ((aio_op *)ctx)->slot;
                rec.b = ent[i].len;
                aio__ring_push(e, &rec);
                continue;
            }
            if (ctx) aio__complete_op(e, r, (aio_op *)ctx, 0, 0);
        }
        return (int)n;
    }
    if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry err;
        memset(&err, 0, sizeof(err));
        ssize_t m = fi_cq_readerr(r->cq, &err, 0);
        if (m > 0) {
            atomic_fetch_add_explicit(&e->st_errors, 1, memory_order_relaxed);
            int status = -(int)(err.err ? err.err : FI_EOTHER);
            if (is_recv_op(r, err.op_context)) {
                if (err.err != FI_ECANCELED) {
                    aio_record rec = {0};
                    rec.kind = AIO_REC_RECV;
                    rec.rail = r->index;
                    rec.a = ((aio_op *)err.op_context)->slot;
                    rec.b = 0;
                    rec.status = status;
                    rec.prov_errno = err.prov_errno;
                    aio__ring_push(e, &rec);
                }
            } else if (err.op_context) {
                aio__complete_op(e, r, (aio_op *)err.op_context, status, err.prov_errno);
            }
            return 1;
        }
    }
    return 0;
}
