/* The poller's queue: requests that posting threads hand over, and direct copies.
 *
 * Theory of operation. A poller holds a rail's lock while the provider moves data: on tcp,
 * while it copies a write's bytes into a socket. A posting thread (an event loop) that then
 * waited for the lock would sleep on a futex, be woken per request, and on a machine with few
 * cores take the CPU the poller needs. So a write or read that aio_post finds its rail busy
 * for (or, on tcp, any write of HAND_MIN_BYTES or more: post.c) is handed over instead:
 * counted in flight (it holds an op of the pool, its group and region count it), queued on the
 * poller of its rail (qmu, taken briefly, under the rail's lock or not), and posted by that
 * poller as soon as it runs its queue, at the top of its next pass. The posting thread
 * neither sleeps on the lock nor copies into sockets. Poller 0's queue also holds every
 * direct same-host copy (direct_copy.c), in the order they were posted.
 *
 * Order is kept per connection (rail and peer): a handed request the provider refuses for
 * room stays queued, and the queue's later requests to that connection wait behind it, while
 * requests to other peers, other rails, and copies go on past it (one slow or stopped peer
 * does not hold up the rest). A posting thread's later requests to a rail with requests
 * waiting (ndeferred) queue behind them too (post.c, HOLD_TRY). A handed request still refused
 * after DEFER_STALL_NS, or whose peer's connection failed meanwhile, completes with
 * -FI_ETIMEDOUT: the caller's retry policy posts it anew, in its own thread.
 *
 * Only requests to peers whose connection has carried a request since its last failure are
 * handed over: a flag per peer address (defer_get / defer_set in handoff.h), set when the provider
 * takes a request to it (aio__posted_to), cleared when one fails (aio__complete_op) and when
 * the address is removed or reused. The flags live in chunks of DEFER_CHUNK addresses,
 * allocated at a peer's first post (under the rail's lock) and kept until the rail closes: a
 * lock-free read, made before the rail's lock is taken. Addresses past DEFER_PEERS, which libfabric's reuse of
 * removed addresses keeps out of reach for bounded peer sets, are posted in place. */
#include "internal.h"

#include "completion.h"
#include "direct_copy.h"
#include "handoff.h"
#include "post.h"
#include "shm_wake.h"

/* a handed-over request that the provider still refuses (queue full, reconnecting) after this
 * long fails as "timed out" */
#define DEFER_STALL_NS 1000000000LL

/* Queues a direct copy (`post` 0) for poller 0, which makes every direct copy (see
 * aio__direct_copy), or a request for the poller of the op's rail to post to the rail's provider
 * (`post` 1, see post_item_g in post.c). The caller kicks that poller. */
void aio__direct_enqueue(aio_engine *e, aio_op *op, const aio_op_desc *it, int post) {
    aio_poller *q = &e->pollers[post ? e->rails[it->rail]->poller : 0];
    op->d = *it;
    op->dcopied = post;
    op->dstatus = 0;
    op->dpost = post;
    op->dmerged = 0;
    op->dsince = 0;
    op->dnext = NULL;
    if (post) {
        atomic_fetch_add(&e->rails[op->rail]->ndeferred, 1);
        atomic_fetch_add_explicit(&e->st_handed, 1, memory_order_relaxed);
    }
    pthread_mutex_lock(&q->qmu);
    if (q->dq_tail) q->dq_tail->dnext = op;
    else q->dq_head = op;
    q->dq_tail = op;
    atomic_store(&q->dq_pending, 1);
    pthread_mutex_unlock(&q->qmu);
}

/* Puts ops back at the head of poller q's queue, in order (their rail's queue was full). */
static void direct_requeue(aio_poller *q, aio_op *list) {
    pthread_mutex_lock(&q->qmu);
    aio_op *tail = list;
    while (tail->dnext) tail = tail->dnext;
    tail->dnext = q->dq_head;
    if (!q->dq_head) q->dq_tail = tail;
    q->dq_head = list;
    atomic_store(&q->dq_pending, 1);
    pthread_mutex_unlock(&q->qmu);
}

/* A connection (rail, peer) whose provider refused a queued request for room during one
 * aio__direct_run: the queue's later requests to it wait behind that one. */
typedef struct {
    int32_t rail;
    uint64_t peer;
} dq_key;
#define DQ_BLOCKED_MAX 16

/* Moves the head of *list to the end of the list whose last link is **tail. */
static void dq_keep(aio_op **list, aio_op ***tail) {
    aio_op *op = *list;
    *list = op->dnext;
    op->dnext = NULL;
    **tail = op;
    *tail = &op->dnext;
}

static int dq_blocked(const dq_key *k, int n, int32_t rail, uint64_t peer) {
    for (int i = 0; i < n; i++)
        if (k[i].rail == rail && k[i].peer == peer) return 1;
    return 0;
}

/* Posts a queued op to its rail's provider (caller holds r->mu): a handed-over request, or the
 * immediate of a copied write as a zero-byte write, whose completion completes the op. Returns
 * what the provider said: -FI_EAGAIN, no room yet (the op waits in the queue), or -FI_ETIMEDOUT
 * for a handed-over request refused too long, or whose connection failed meanwhile. */
static ssize_t dq_post(aio_engine *e, aio_rail *r, aio_op *op) {
    const aio_op_desc *d = &op->d;
    aio_mr *m = d->mr;
    /* never to an shm peer whose process is gone (its provider would spin on a lock in the dead
     * peer's region: shm_wake.c): the request fails as its peer's, nothing posted. The immediate
     * after a direct copy too: its peer may have died since the copy, or while the immediate
     * waited here for room in the peer's full queue */
    if (r->is_shm && aio__shm_peer_gone(r, d->peer)) return aio__peer_gone_refusal(e);
    ssize_t ret = op->dpost ? aio__post_one(r, d, op)
                            : fi_writedata(r->ep, (char *)m->buf + d->offset, 0, m->desc[op->rail],
                                           d->data, d->peer, d->raddr, d->rkey, &op->ctx);
    if (!op->dpost && r->is_shm) aio__shm_wake(r, d->peer);
    if (ret == -FI_EAGAIN && op->dpost) {
        /* a handed-over request the provider refuses: room comes as the rail's requests
         * complete, unless its connection failed meanwhile (no deferral to that peer
         * any more) or it waited DEFER_STALL_NS; then it fails, and the caller's retry
         * policy posts it anew in its own thread */
        int64_t t = now_ns();
        if (!op->dsince) {
            op->dsince = t;
            atomic_fetch_add_explicit(&e->st_handed_waited, 1, memory_order_relaxed);
        }
        if (!defer_get(r, d->peer) ||
            t - op->dsince > DEFER_STALL_NS)
            ret = -FI_ETIMEDOUT;
    }
    return ret;
}

/* The poller's part: makes the queued copies in order; a write carrying an immediate then
 * posts it as a zero-byte write on the op's rail, whose completion completes the op. Posts the
 * queued requests (dpost) to their rails' providers. A request the provider refuses for room
 * stays queued, and so do the later ones to the same connection (rail and peer), in order;
 * requests to other peers and other rails, and copies, go on past it (one slow or stopped
 * peer does not hold up the rest). Returns how many ops it handled, plus one while ops wait
 * for room (the poller polls on at once: room comes as the rails' requests complete). */
int aio__direct_run(aio_poller *q) {
    aio_engine *e = q->e;
    if (!atomic_load_explicit(&q->dq_pending, memory_order_acquire)) return 0;
    pthread_mutex_lock(&q->qmu);
    aio_op *list = q->dq_head;
    q->dq_head = q->dq_tail = NULL;
    atomic_store(&q->dq_pending, 0);
    pthread_mutex_unlock(&q->qmu);
    uint64_t run = ++q->drun;
    if (q->index == 0) aio__direct_batch(e, list, run);
    int n = 0;
    dq_key blocked[DQ_BLOCKED_MAX];
    int nblocked = 0;
    aio_op *left = NULL, **left_tail = &left; /* ops kept for later, in order */
    while (list) {
        aio_op *op = list;
        const aio_op_desc *d = &op->d;
        /* a merged op posts nothing (its carrier, later in the list, does): it completes even
         * while its connection waits for room */
        int posts = !op->dmerged && (op->dpost || (d->flags & AIO_F_DATA));
        if (posts && dq_blocked(blocked, nblocked, d->rail, d->peer)) {
            dq_keep(&list, &left_tail);
            continue;
        }
        if (!op->dcopied) {
            op->dstatus = aio__direct_copy(e, op, run);
            op->dcopied = 1;
            if (!op->dstatus) atomic_fetch_add_explicit(&e->st_direct, 1, memory_order_relaxed);
        }
        aio_rail *r = e->rails[op->rail];
        pthread_mutex_lock(&r->mu);
        if (op->dmerged) { /* copied; a later op of its run carries its immediate */
            list = op->dnext;
            aio__complete_op(e, r, op, 0, 0);
        } else if (op->dpost || (!op->dstatus && (d->flags & AIO_F_DATA))) {
            ssize_t ret = dq_post(e, r, op);
            if (ret == -FI_EAGAIN) { /* this and its connection's later ops wait, in order, for room */
                aio__progress_locked(e, r);
                pthread_mutex_unlock(&r->mu);
                dq_keep(&list, &left_tail);
                if (nblocked < DQ_BLOCKED_MAX) {
                    blocked[nblocked].rail = d->rail;
                    blocked[nblocked].peer = d->peer;
                    nblocked++;
                } else { /* too many connections full at once: the rest waits, in order */
                    *left_tail = list;
                    list = NULL;
                }
                continue;
            }
            list = op->dnext;
            if (op->dpost) {
                atomic_fetch_sub(&r->ndeferred, 1);
                if (!ret) aio__posted_to(e, r, d->peer);
            }
            if (ret) aio__complete_op(e, r, op, (int)ret, 0);
        } else {
            list = op->dnext;
            aio__complete_op(e, r, op, op->dstatus, op->dstatus ? -op->dstatus : 0);
        }
        pthread_mutex_unlock(&r->mu);
        n++;
    }
    if (left) {
        direct_requeue(q, left);
        n++;
    }
    return n;
}
