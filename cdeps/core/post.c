/* Posting: requests into groups, on the posting thread.
 *
 * Theory of operation. The posting thread (an event loop's, from Python with the GIL
 * released, or any thread of the application) posts the requests of a transfer into a group
 * (groups.c) in as few calls as it can: aio_post takes a batch of descriptors, aio_submit
 * opens, posts and seals in one call, aio_post_paged forms the requests of a paged write
 * itself. Each request is checked against its region, then goes one of three ways:
 *   - a same-host direct copy (a direct code and one byte or more) is queued for poller 0,
 *     which copies it (direct_copy.c, handoff.c), without the rail's lock (unless no op is
 *     free: the posting thread then drives the rail for one, as below);
 *   - a write or read the poller should post is handed over (handoff.c), when its peer's
 *     connection carried a request since its last failure: by default on tcp, every write of
 *     HAND_MIN_BYTES or more, so that its bytes go into the socket from the poller's thread
 *     and never from the loop's, and any request whose rail the poller holds at that moment
 *     (it is moving data: waiting for its lock would cost the loop a futex sleep);
 *   - else it is posted in place, under the rail's lock. A call keeps the lock across its
 *     consecutive requests to one rail (rail_hold: a handover of the lock between the poller and
 *     the poster per batch, not per request), and gives it back every HOLD_MAX_POSTS.
 * When the provider's queue or the rail's op pool is full, the posting thread drives the rail
 * itself (reads completions, which frees both) until budget_ns passes or no completion came
 * for POST_IDLE_NS, then returns how many it posted: the caller waits for room with
 * aio_want_space (an AIO_REC_SPACE record) rather than spin. A call kicks the pollers of the
 * rails it posted to (their spin restarts: completions are coming).
 *
 * Messages (aio_post_sendv; aio_submit_sendparts frames several, each behind its length) are
 * copied into one of the rail's registered send slots, without the rail's lock (the slot and
 * the op are the caller's alone by then, and a large message is a long copy), and sent;
 * with aio_post_sendv_ref the body is not copied: the slot holds the head, and the body goes
 * from the caller's memory as the send's second piece (where the provider needs no
 * descriptor for local memory), the caller keeping it until the completion. Receives are the
 * rail's slots, reposted by the loop once read. Every request to an shm rail
 * is followed by a wake-up of the target's poller if it sleeps (shm_wake.c), and the first
 * requests to a tcp peer by the tuning of its connection (tcp_tune.c). */
#include "internal.h"

#include <sys/uio.h>

#include "completion.h"
#include "direct_copy.h"
#include "groups.h"
#include "handoff.h"
#include "poller.h"
#include "post.h"
#include "shm_wake.h"
#include "tcp_tune.h"

/* a post waiting for room stops driving the rail itself after this long without a completion */
#define POST_IDLE_NS 20000LL

/* By default (hand mode 0) a tcp write of at least this many bytes is always handed to the
 * poller: its bytes go into the socket from the poller's thread, never from the posting one
 * (an event loop's). Smaller ones are posted in place when the rail is free, for latency. */
#define HAND_MIN_BYTES (16 * 1024)
/* shm sends up to its inject size (SMR_INJECT_SIZE, 4 KiB; smaller ones inline) are copied
 * into the target's queue by fi_send and completed at once, unless FI_DELIVERY_COMPLETE; a
 * larger one completes later (the target copies it), not worth a look at the queue. Over tcp
 * a send up to HAND_MIN_BYTES (16 KiB, under rxm's eager size) is usually in the socket when
 * fi_send returns, and completed: looked for too (a 4 KiB payload plus its header is past
 * 4 KiB, and its completion otherwise cost a poller wake-up and an event-loop round trip) */
#define INLINE_SEND_MAX 4096

/* A write gathering `n` local pieces of it->length bytes each (at it->offset + gather[i])
 * into one contiguous remote range: one request, remote CQ data once. */
static ssize_t post_gather(aio_rail *r, const aio_op_desc *it, const uint64_t *gather, int n,
                           aio_op *op) {
    aio_mr *m = it->mr;
    struct iovec iov[AIO_MAX_GATHER];
    void *desc[AIO_MAX_GATHER];
    for (int i = 0; i < n; i++) {
        iov[i].iov_base = (char *)m->buf + gather[i];
        iov[i].iov_len = it->length;
        desc[i] = m->desc[it->rail];
    }
    struct fi_rma_iov rma = {.addr = it->raddr, .len = it->length * (uint64_t)n, .key = it->rkey};
    struct fi_msg_rma msg = {.msg_iov = iov, .desc = desc, .iov_count = (size_t)n, .addr = it->peer,
                             .rma_iov = &rma, .rma_iov_count = 1, .context = &op->ctx,
                             .data = it->data};
    uint64_t flags = r->tx_op_flags | ((it->flags & AIO_F_DATA) ? FI_REMOTE_CQ_DATA : 0);
    ssize_t ret = fi_writemsg(r->ep, &msg, flags);
    if (r->is_shm) aio__shm_wake(r, it->peer);
    return ret;
}

ssize_t aio__post_one(aio_rail *r, const aio_op_desc *it, aio_op *op) {
    aio_mr *m = it->mr;
    void *buf = (char *)m->buf + it->offset;
    void *desc = m->desc[it->rail];
    ssize_t ret;
    if (it->op == AIO_OP_READ)
        ret = fi_read(r->ep, buf, it->length, desc, it->peer, it->raddr, it->rkey, &op->ctx);
    else if (it->flags & AIO_F_DATA)
        ret = fi_writedata(r->ep, buf, it->length, desc, it->data, it->peer, it->raddr, it->rkey,
                           &op->ctx);
    else
        ret = fi_write(r->ep, buf, it->length, desc, it->peer, it->raddr, it->rkey, &op->ctx);
    if (r->is_shm) aio__shm_wake(r, it->peer);
    return ret;
}

/* While a post waits for room (queue full): drives the rail once. 0 when the caller should
 * give up for now: the deadline passed, or no completion came back for POST_IDLE_NS (the
 * queue frees only as completions return; spinning longer burns the CPU the peer and the
 * kernel need, and the loop waits for room cheaply with aio_want_space). Caller holds r->mu. */
static int post_progress(aio_engine *e, aio_rail *r, int64_t deadline, int64_t *idle) {
    int got = aio__progress_locked(e, r);
    int64_t t = now_ns();
    if (t >= deadline) return 0;
    if (got > 0 || *idle == 0) *idle = t + POST_IDLE_NS;
    else if (t >= *idle) return 0;
    return 1;
}

/* A posting call's hold of one rail's lock across consecutive requests to that rail: a batch
 * takes the lock once rather than once per request, so that the poller (which holds it while the
 * provider moves data) and the posting thread hand it over once per batch, not once per request
 * (each handover a futex sleep and wake-up of the posting thread). Given back every
 * HOLD_MAX_POSTS requests, so that a long paged call does not keep the poller out. */
#define HOLD_MAX_POSTS 32

typedef struct {
    aio_rail *r;      /* the rail whose lock is held, or NULL */
    int posts;        /* requests posted under this hold */
    uint64_t live_fa; /* an shm peer found alive under this hold, plus one (0: none) */
} rail_hold;

static void release_rail(rail_hold *h) {
    if (h->r) pthread_mutex_unlock(&h->r->mu);
    h->r = NULL;
}

/* How post_item_g takes a rail's lock: waits for it; tries (hands the request to the poller if
 * the rail is busy); does not take it (hands every eligible request over); or hands the request
 * over even when this call holds the rail (a large tcp write by default). */
enum { HOLD_WAIT, HOLD_TRY, HOLD_NONE, HOLD_HAND };

/* Takes rail r's lock into h (kept if h holds it already, under HOLD_MAX_POSTS): 1 held. HOLD_TRY:
 * only if it is free and no request of this rail waits in the poller's queue, else 0: the caller
 * hands its request to the poller rather than wait for a poller busy moving data (a wait that
 * costs the posting thread a futex sleep and wake-up, and on few cores the CPU the poller needs).
 * HOLD_NONE: 0 unless already held. HOLD_HAND: 0, letting go of a rail held: the poller posts
 * the request as soon as it takes the lock, and this call's later requests to the rail queue
 * behind it (HOLD_TRY sees it waiting), in order. */
static int hold_rail(rail_hold *h, aio_rail *r, int how) {
    if (how == HOLD_HAND) {
        release_rail(h);
        return 0;
    }
    if (h->r == r && h->posts < HOLD_MAX_POSTS) return 1;
    release_rail(h);
    if (how == HOLD_NONE) return 0;
    if (how == HOLD_TRY) {
        if (atomic_load(&r->ndeferred) > 0 || pthread_mutex_trylock(&r->mu) != 0) return 0;
    } else {
        pthread_mutex_lock(&r->mu);
    }
    h->r = r;
    h->posts = 0;
    h->live_fa = 0;
    return 1;
}

/* Whether a request to `peer` on the rail held by h may go to the provider: not to an shm peer
 * whose process is gone (aio__shm_peer_gone: its provider would spin on a lock in the dead
 * peer's region), looked at once per peer and hold (a batch to one peer pays one flock call). */
static int hold_peer_lives(rail_hold *h, uint64_t peer) {
    if (!h->r->is_shm || h->live_fa == peer + 1) return 1;
    if (aio__shm_peer_gone(h->r, peer)) return 0;
    h->live_fa = peer + 1;
    return 1;
}

/* A request to `peer` went to the rail's provider (caller holds the rail's lock): its tcp
 * connection's send buffer is set (at the first posts), and requests to it may be handed to
 * the poller again. */
void aio__posted_to(aio_engine *e, aio_rail *r, uint64_t peer) {
    if (r->is_tcp && e->sndbuf > 0) aio__tcp_tune_peer(e, r, peer);
    defer_set(r, peer, 1);
}

/* Takes an op for `it` (`bytes` in all: its gathered pieces) and counts it in flight (group,
 * region, engine, the rail's bytes). */
static aio_op *op_start(aio_engine *e, aio_rail *r, int64_t g, aio_mr *m, const aio_op_desc *it,
                        uint64_t bytes) {
    aio_op *op = aio__op_get(r);
    if (!op) return NULL;
    op->kind = it->op == AIO_OP_READ ? OPK_READ : OPK_WRITE;
    op->rail = it->rail;
    op->group = g;
    op->mr = m;
    op->peer = it->peer;
    op->bytes = bytes;
    op->dpieces = 0;
    op->dstride = 0;
    aio_group *gr = &e->groups[g];
    atomic_fetch_add(&m->inflight, 1);
    atomic_fetch_add(&gr->posted, 1);
    atomic_fetch_add(&gr->outstanding, 1);
    atomic_fetch_add_explicit(&r->bytes_inflight, bytes, memory_order_relaxed);
    inflight_add(e, r, 1);
    return op;
}

/* a*b+c <= limit without overflow */
static int fits(uint64_t a, uint64_t b, uint64_t c, uint64_t limit) {
    if (b && a > (UINT64_MAX - c) / b) return 0;
    return a * b + c <= limit;
}

/* Queues a direct copy for poller 0: `it`, or with ngather > 1 the strided write of ngather
 * pieces of it->length bytes, `stride` apart from it->offset, into one remote range. */
static void direct_copy_enqueue(aio_engine *e, aio_op *op, const aio_op_desc *it, int ngather,
                                uint64_t stride) {
    if (ngather <= 1) {
        aio__direct_enqueue(e, op, it, 0);
        return;
    }
    aio_op_desc whole = *it;
    whole.length = it->length * (uint64_t)ngather;
    op->dpieces = (uint32_t)ngather;
    op->dstride = stride;
    aio__direct_enqueue(e, op, &whole, 0);
}

/* Posts one request into group g: 1 posted, 0 no room before the deadline (nothing
 * posted), negative: an error for this request (nothing posted). `gather`: the local offsets
 * of ngather > 1 pieces of it->length bytes gathered into one remote range; NULL with
 * ngather > 1: a strided direct copy (pieces `stride` apart from it->offset). Takes the
 * rail's lock into `h` (kept for the caller's next request; the caller releases it). */
static int post_item_g(aio_engine *e, int64_t g, const aio_op_desc *it, const uint64_t *gather,
                       int ngather, uint64_t stride, int64_t deadline, rail_hold *h) {
    if (it->rail < 0 || it->rail >= e->nrails || !it->mr ||
        (it->op != AIO_OP_WRITE && it->op != AIO_OP_READ))
        return -FI_EINVAL;
    aio_mr *m = it->mr;
    if (it->offset > m->len || it->length > m->len - it->offset) return -FI_EINVAL;
    int strided = ngather > 1 && !gather;
    if (strided && (it->direct == 0 || it->length == 0 || it->op != AIO_OP_WRITE ||
                    !fits((uint64_t)(ngather - 1), stride, it->offset + it->length, m->len)))
        return -FI_EINVAL;
    /* a direct copy: one local piece, or strided pieces, of at least one byte (a bare immediate
     * goes the provider's way) */
    int direct = it->direct != 0 && (ngather <= 1 || strided) && it->length > 0;
    if (it->direct != 0 && ((it->direct >> 16) < 1 || (it->direct >> 16) > atomic_load(&e->ndpeers) ||
                            (it->direct & 0xffff) >= AIO_DIRECT_SLOTS ||
                            !e->dpeers[(it->direct >> 16) - 1].t))
        return -FI_EINVAL;
    if (it->direct != 0 && !direct) {
        /* a request to a same-host peer that is no copy: several gathered pieces (never formed
         * for a direct route, see aio_post_paged) or a bare immediate: the slot's checks here */
        int rc = aio__direct_check(e, it);
        if (rc) return rc;
    }
    aio_group *gr = &e->groups[g];
    aio_rail *r = e->rails[it->rail];
    uint64_t bytes = it->length * (uint64_t)(ngather > 1 ? ngather : 1);
    aio_op *op;
    /* by default on tcp, whose poller pushes bytes into sockets under the rail's lock; on shm
     * only requests under HAND_MIN_BYTES whose rail the poller holds (a spinning poller holds it
     * for most of each pass: a zero-byte immediate waited 3-20 us for the lock on a futex).
     * Handing 64 KiB shm writes to the poller cut them to a third (the poller then queues every
     * write into the target's shm queue itself, against the target's lock). On tcp a write of
     * HAND_MIN_BYTES or more is always handed: copied in the posting thread, a batch of 16 writes
     * of 1 MiB held the posting call for 75 us on average and up to 430 us (a Python event
     * loop), and that thread became the bottleneck at 64 KiB and 16 MiB (aiote bench, 2 vCPUs) */
    if (direct && (op = op_start(e, r, g, m, it, bytes))) {
        /* a direct copy takes no rail lock: its op comes from the pool (a lock of its own) and
         * poller 0 copies it. Waiting for the lock cost the posting thread a futex sleep
         * whenever a spinning poller held the rail (a 1 KiB copy's post: 80-100 us in an
         * MoE step on the 2 x H200 host, 14 us with the poller asleep) */
        direct_copy_enqueue(e, op, it, ngather, stride);
        return 1;
    }
    int hand = atomic_load_explicit(&e->hand_posts, memory_order_relaxed);
    int how = HOLD_WAIT;
    if (hand >= 0 && !direct && ngather <= 1 && defer_get(r, it->peer)) {
        if (hand > 0)
            how = HOLD_NONE;
        else if (r->is_tcp)
            how = it->op == AIO_OP_WRITE && it->length >= HAND_MIN_BYTES ? HOLD_HAND : HOLD_TRY;
        else if (r->is_shm && (it->length < HAND_MIN_BYTES || atomic_load(&r->ndeferred) > 0))
            how = HOLD_TRY; /* a small one need not wait for the poller's pass; a larger one
                               behind handed ones queues behind them, in order */
    }
    if (!hold_rail(h, r, how)) {
        /* the poller holds the rail (it is moving data): it posts this request when it is done */
        if ((op = op_start(e, r, g, m, it, bytes))) {
            aio__direct_enqueue(e, op, it, 1);
            return 1;
        }
        hold_rail(h, r, HOLD_WAIT); /* no op free: wait for the lock, and drive completions, as below */
    }
    /* (a request with a direct code: its peer's pidfd was looked at, aio__direct_check) */
    if (!it->direct && !hold_peer_lives(h, it->peer)) return aio__peer_gone_refusal(e);
    int64_t idle = 0; /* when the self-driven progress found nothing for POST_IDLE_NS: give up */
    while (!(op = op_start(e, r, g, m, it, bytes))) {
        if (!post_progress(e, r, deadline, &idle)) break;
    }
    if (!op) return 0;
    h->posts++;
    ssize_t ret = 0;
    if (direct) {
        direct_copy_enqueue(e, op, it, ngather, stride); /* the poller copies (aio_post kicks it) */
    } else {
        for (;;) {
            ret = ngather > 1 ? post_gather(r, it, gather, ngather, op) : aio__post_one(r, it, op);
            if (ret != -FI_EAGAIN) break;
            if (!post_progress(e, r, deadline, &idle)) break;
        }
        if (!ret) aio__posted_to(e, r, it->peer);
    }
    if (ret) {
        atomic_fetch_sub(&m->inflight, 1);
        atomic_fetch_sub(&gr->posted, 1);
        atomic_fetch_sub(&gr->outstanding, 1);
        atomic_fetch_sub_explicit(&r->bytes_inflight, bytes, memory_order_relaxed);
        inflight_add(e, r, -1);
        aio__op_put(r, op);
    }
    if (ret == -FI_EAGAIN) return 0;
    return ret ? (int)ret : 1;
}

int64_t aio_post(aio_engine *e, int64_t g, const aio_op_desc *items, int64_t n, int64_t budget_ns) {
    if (!aio__group_postable(e, g)) return -FI_EINVAL;
    int64_t deadline = now_ns() + budget_ns;
    int64_t i = 0;
    int rc = 0;
    rail_hold h = {0};
    uint32_t mask = 0; /* the rails posted to: their pollers are kicked */
    for (; i < n; i++) {
        rc = post_item_g(e, g, &items[i], NULL, 1, 0, deadline, &h);
        if (rc <= 0) break;
        mask |= 1u << items[i].rail;
        if (items[i].direct) mask |= 1u; /* a direct copy may be queued for poller 0 (rail 0's) */
    }
    release_rail(&h);
    if (i > 0) aio__kick_rails(e, mask);
    if (i == 0 && rc < 0) return rc;
    return i;
}

static int64_t submit(aio_engine *e, uint64_t token, const aio_op_desc *items, int64_t n,
                      int64_t budget_ns, int64_t *group, int quiet) {
    int64_t g = aio_group_open(e, token);
    *group = g;
    if (g < 0) return g;
    e->groups[g].quiet = quiet; /* read when the group finishes, after it was posted */
    int64_t k = aio_post(e, g, items, n, budget_ns);
    if (k == n) aio_group_seal(e, g);
    return k;
}

int64_t aio_submit(aio_engine *e, uint64_t token, const aio_op_desc *items, int64_t n,
                   int64_t budget_ns, int64_t *group) {
    return submit(e, token, items, n, budget_ns, group, 0);
}

int64_t aio_submit_quiet(aio_engine *e, uint64_t token, const aio_op_desc *items, int64_t n,
                         int64_t budget_ns, int64_t *group) {
    return submit(e, token, items, n, budget_ns, group, 1);
}

int64_t aio_post_paged(aio_engine *e, int64_t g, const aio_paged_desc *d, int64_t start, int64_t n,
                       int64_t budget_ns) {
    if (!aio__group_postable(e, g) || !d || !d->mr || d->nroutes < 1 || d->nroutes > AIO_MAX_RAILS ||
        d->first_route < 0 || start < 0 || n < start || d->page_size == 0)
        return -FI_EINVAL;
    aio_mr *m = d->mr;
    int64_t deadline = now_ns() + budget_ns;
    aio_op_desc it;
    memset(&it, 0, sizeof(it));
    it.mr = m;
    it.length = d->page_size;
    it.data = d->data;
    it.op = AIO_OP_WRITE;
    it.flags = d->flags & AIO_F_DATA;
    /* pages whose destinations follow each other go as one request gathering their
     * sources (up to the rail's iov limit); such a request carries the credit of all its
     * pages as one weight, so it is only formed when the weight can travel. To a direct route
     * such pages whose sources are evenly spaced go as one strided copy (up to
     * AIO_MAX_STRIDED pages; sources a page apart: one contiguous copy) */
    int64_t k = start;
    int rc = 0;
    uint64_t gather[AIO_MAX_GATHER];
    int64_t req = 0; /* requests posted by this call: the route of the next one */
    uint32_t mask = 0; /* the rails posted to: their pollers are kicked */
    rail_hold h = {0};
    while (k < n) {
        const aio_route *rt = &d->routes[(uint64_t)(d->first_route + start + req) % (uint64_t)d->nroutes];
        aio_rail *r = (rt->rail >= 0 && rt->rail < e->nrails) ? e->rails[rt->rail] : NULL;
        int limit = 1;
        if (r && d->gather) {
            limit = rt->direct ? AIO_MAX_STRIDED : (int)r->iov_limit;
            if ((d->flags & AIO_F_DATA) && r->cq_data_size < 8) limit = 1;
        }
        int cnt = 0;
        uint64_t dst0 = 0, src0 = 0, stride = 0;
        for (; cnt < limit && k + cnt < n; cnt++) {
            int64_t si = d->src_pages[k + cnt], di = d->dst_pages[k + cnt];
            if (si < 0 || di < 0 ||
                !fits((uint64_t)si, d->src_stride, d->src_offset + d->page_size, m->len) ||
                !fits((uint64_t)di, d->dst_stride, d->dst_offset + d->page_size, d->remote_len)) {
                if (cnt == 0) rc = -FI_EINVAL;
                break;
            }
            uint64_t dst = d->dst_offset + (uint64_t)di * d->dst_stride;
            uint64_t src = d->src_offset + (uint64_t)si * d->src_stride;
            if (cnt == 0) {
                dst0 = dst;
                src0 = src;
            } else if (dst != dst0 + (uint64_t)cnt * d->page_size) {
                break;
            } else if (rt->direct) { /* evenly spaced sources, ascending */
                if (cnt == 1) stride = src - src0;
                if (src < src0 || src - src0 != (uint64_t)cnt * stride) break;
            }
            if (!rt->direct) gather[cnt] = src;
        }
        if (cnt == 0) break;
        it.offset = src0;
        it.length = d->page_size;
        it.rail = rt->rail;
        it.peer = rt->peer;
        it.rkey = rt->rkey;
        it.direct = rt->direct;
        it.raddr = rt->rbase + dst0;
        it.data = d->data;
        if ((d->flags & AIO_F_DATA) && cnt > 1) it.data = (d->data & 0xffffffffULL) | (((uint64_t)cnt * AIO_CREDIT_UNIT) << 32);
        if (rt->direct && cnt > 1 && stride == d->page_size) { /* one contiguous copy */
            it.length = d->page_size * (uint64_t)cnt;
            rc = post_item_g(e, g, &it, NULL, 1, 0, deadline, &h);
        } else {
            rc = post_item_g(e, g, &it, rt->direct ? NULL : gather, cnt, stride, deadline, &h);
        }
        if (rc <= 0) break;
        mask |= 1u << it.rail;
        if (rt->direct) mask |= 1u; /* a direct copy is queued for poller 0 (rail 0's) */
        k += cnt;
        req++;
    }
    release_rail(&h);
    if (k > start) aio__kick_rails(e, mask);
    if (k == start && rc < 0) return rc;
    return k - start;
}

/* A message's body: n parts, copied back to back behind the head; `framed`: each behind its
 * length (4 bytes, little-endian), as a combined message carries them. */
typedef struct msg_parts {
    const void *const *ptr;
    const uint64_t *len;
    uint32_t n;
    int framed;
    int in_place; /* one part, sent from where it lies (see aio_submit_sendv_ref) */
} msg_parts;

static uint64_t parts_bytes(const msg_parts *b) {
    uint64_t n = 0;
    for (uint32_t i = 0; i < b->n; i++) n += b->len[i] + (b->framed ? 4 : 0);
    return n;
}

static void parts_copy(char *dst, const msg_parts *b) {
    for (uint32_t i = 0; i < b->n; i++) {
        if (b->framed) {
            uint32_t l = (uint32_t)b->len[i];
            uint8_t le[4] = {(uint8_t)l, (uint8_t)(l >> 8), (uint8_t)(l >> 16), (uint8_t)(l >> 24)};
            memcpy(dst, le, 4);
            dst += 4;
        }
        if (b->len[i]) memcpy(dst, b->ptr[i], b->len[i]);
        dst += b->len[i];
    }
}

static int post_send_parts(aio_engine *e, int64_t g, int rail, uint64_t peer, const void *head,
                           uint64_t hlen, const msg_parts *body, int64_t budget_ns) {
    if (rail < 0 || rail >= e->nrails || !aio__group_postable(e, g)) return -FI_EINVAL;
    aio_rail *r = e->rails[rail];
    for (uint32_t i = 0; i < body->n; i++)
        if (body->len[i] > r->slot_size || (body->framed && body->len[i] > UINT32_MAX)) return -FI_EMSGSIZE;
    uint64_t blen = parts_bytes(body);
    uint64_t len = hlen + blen;
    if (hlen > r->slot_size || blen > r->slot_size || len > r->slot_size) return -FI_EMSGSIZE;
    int64_t deadline = now_ns() + budget_ns;
    pthread_mutex_lock(&r->mu);
    if (r->is_shm && aio__shm_peer_gone(r, peer)) { /* see hold_peer_lives */
        pthread_mutex_unlock(&r->mu);
        return aio__peer_gone_refusal(e);
    }
    aio_op *op = NULL;
    for (;;) {
        if (r->send_nfree > 0 && (op = aio__op_get(r))) break;
        aio__progress_locked(e, r);
        if (now_ns() >= deadline) break;
    }
    if (!op) {
        pthread_mutex_unlock(&r->mu);
        aio__kick_rails(e, 1u << rail);
        return 0;
    }
    uint32_t slot = r->send_free[--r->send_nfree];
    char *sbuf = r->send_buf + (uint64_t)slot * r->slot_size;
    /* the slot and the op are ours alone now: copy without the rail's lock, so the poller
     * drives the rail meanwhile (a large message is a long copy). A body sent in place goes
     * as the second of two pieces, the head in the slot: only where the provider reads local
     * memory without a descriptor (no FI_MR_LOCAL: tcp;ofi_rxm and shm) and takes two pieces */
    int in_place = body->in_place && body->n == 1 && blen && !(r->mr_mode & FI_MR_LOCAL) &&
                   (hlen == 0 || r->iov_limit >= 2);
    pthread_mutex_unlock(&r->mu);
    if (hlen) memcpy(sbuf, head, hlen);
    if (!in_place) parts_copy(sbuf + hlen, body);
    op->kind = OPK_SEND;
    op->bytes = 0;
    op->rail = rail;
    op->group = g;
    op->mr = NULL;
    op->slot = slot;
    atomic_fetch_add(&e->groups[g].posted, 1);
    atomic_fetch_add(&e->groups[g].outstanding, 1);
    inflight_add(e, r, 1);
    pthread_mutex_lock(&r->mu);
    ssize_t ret;
    for (;;) {
        if (in_place) {
            struct iovec iov[2] = {{sbuf, hlen}, {(void *)(uintptr_t)body->ptr[0], blen}};
            void *desc[2] = {r->send_desc, NULL};
            int first = hlen ? 0 : 1; /* no head: the body alone */
            ret = fi_sendv(r->ep, iov + first, desc + first, (size_t)(2 - first), peer, &op->ctx);
        } else {
            ret = fi_send(r->ep, sbuf, len, r->send_desc, peer, &op->ctx);
        }
        if (r->is_shm) aio__shm_wake(r, peer);
        if (ret != -FI_EAGAIN) break;
        aio__progress_locked(e, r);
        if (now_ns() >= deadline) break;
    }
    if (!ret) aio__posted_to(e, r, peer);
    if (!ret && in_place) atomic_fetch_add_explicit(&e->st_in_place, 1, memory_order_relaxed);
    /* shm completes a small message as it takes it, and tcp often has written one into its
     * socket by now: read the completion on this thread, so that no poller is woken for it
     * and the caller may find its group ended (aio_submit_sendv) */
    int settled = 0;
    if (!ret && len <= (r->is_shm ? INLINE_SEND_MAX : HAND_MIN_BYTES)) {
        aio__progress_locked(e, r);
        settled = atomic_load(&e->groups[g].done) == atomic_load(&e->groups[g].posted);
    }
    if (ret) {
        atomic_fetch_sub(&e->groups[g].posted, 1);
        atomic_fetch_sub(&e->groups[g].outstanding, 1);
        inflight_add(e, r, -1);
        r->send_free[r->send_nfree++] = slot;
        aio__op_put(r, op);
        pthread_mutex_unlock(&r->mu);
        aio__kick_rails(e, 1u << rail);
        return ret == -FI_EAGAIN ? 0 : (int)ret;
    }
    pthread_mutex_unlock(&r->mu);
    if (!settled) aio__kick_rails(e, 1u << rail);
    return 1;
}

/* A message whose body is one part: copied behind the head, or sent in place. */
typedef struct one_part {
    const void *ptr[1];
    uint64_t len[1];
    msg_parts m;
} one_part;

static const msg_parts *one(one_part *o, const void *body, uint64_t blen, int in_place) {
    o->ptr[0] = body;
    o->len[0] = blen;
    o->m = (msg_parts){o->ptr, o->len, blen ? 1 : 0, 0, in_place};
    return &o->m;
}

int aio_post_sendv(aio_engine *e, int64_t g, int rail, uint64_t peer, const void *head, uint64_t hlen,
                   const void *body, uint64_t blen, int64_t budget_ns) {
    one_part o;
    return post_send_parts(e, g, rail, peer, head, hlen, one(&o, body, blen, 0), budget_ns);
}

int aio_post_sendv_ref(aio_engine *e, int64_t g, int rail, uint64_t peer, const void *head, uint64_t hlen,
                       const void *body, uint64_t blen, int64_t budget_ns) {
    one_part o;
    return post_send_parts(e, g, rail, peer, head, hlen, one(&o, body, blen, 1), budget_ns);
}

/* open, post, seal inline (see aio_submit_sendv) */
static int64_t submit_parts(aio_engine *e, uint64_t token, int rail, uint64_t peer, const void *head,
                            uint64_t hlen, const msg_parts *body, int64_t budget_ns, int64_t *out) {
    int64_t g = aio_group_open(e, token);
    out[0] = g;
    out[1] = 0;
    if (g < 0) return g;
    int k = post_send_parts(e, g, rail, peer, head, hlen, body, budget_ns);
    if (k == 1) {
        int32_t status = 0, prov_errno = 0;
        if (aio__group_seal_inline(e, g, &status, &prov_errno) == 1) {
            out[1] = 1;
            out[2] = status;
            out[3] = prov_errno;
        }
    }
    return k;
}

int64_t aio_submit_sendv(aio_engine *e, uint64_t token, int rail, uint64_t peer, const void *head,
                         uint64_t hlen, const void *body, uint64_t blen, int64_t budget_ns, int64_t *out) {
    one_part o;
    return submit_parts(e, token, rail, peer, head, hlen, one(&o, body, blen, 0), budget_ns, out);
}

int64_t aio_submit_sendv_ref(aio_engine *e, uint64_t token, int rail, uint64_t peer, const void *head,
                             uint64_t hlen, const void *body, uint64_t blen, int64_t budget_ns, int64_t *out) {
    one_part o;
    return submit_parts(e, token, rail, peer, head, hlen, one(&o, body, blen, 1), budget_ns, out);
}

int64_t aio_submit_sendparts(aio_engine *e, uint64_t token, int rail, uint64_t peer, const void *head,
                             uint64_t hlen, const void *const *parts, const uint64_t *lens, uint32_t n,
                             int64_t budget_ns, int64_t *out) {
    if (n == 0 || !parts || !lens) {
        out[0] = -1;
        out[1] = 0;
        return -FI_EINVAL;
    }
    msg_parts b = {parts, lens, n, 1, 0};
    return submit_parts(e, token, rail, peer, head, hlen, &b, budget_ns, out);
}

int aio_post_send(aio_engine *e, int64_t g, int rail, uint64_t peer, const void *buf, uint64_t len,
                  int64_t budget_ns) {
    return aio_post_sendv(e, g, rail, peer, buf, len, NULL, 0, budget_ns);
}

void *aio_recv_slot(aio_engine *e, int rail, uint32_t slot) {
    if (rail < 0 || rail >= e->nrails) return NULL;
    aio_rail *r = e->rails[rail];
    if (slot >= r->nslots) return NULL;
    return r->recv_buf + (uint64_t)slot * r->slot_size;
}

int aio_recv_repost(aio_engine *e, int rail, uint32_t slot) {
    if (rail < 0 || rail >= e->nrails) return -FI_EINVAL;
    aio_rail *r = e->rails[rail];
    if (slot >= r->nslots) return -FI_EINVAL;
    pthread_mutex_lock(&r->mu);
    int ret = aio__post_recv_locked(r, slot);
    pthread_mutex_unlock(&r->mu);
    aio__kick_rails(e, 1u << rail);
    return ret;
}
