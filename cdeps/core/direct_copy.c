/* Same-host direct copies, the copies: made by poller 0 for its engine.
 *
 * Theory of operation. A write or read of one byte or more whose descriptor carries a direct
 * code (AIO_DIRECT(attach, slot), from aio_post or a direct route of aio_post_paged) is not
 * given to the shm provider: the posting thread queues it for poller 0 (handoff.c), which
 * copies it here and then completes it, or posts its immediate as a zero-byte write on the
 * shm rail so that the target's counters work as over the provider (handoff.c). One thread
 * makes every copy because a peer's slot has one busy bit per attached engine, set and
 * cleared around each copy; and copying in the poller, not in the posting thread, keeps a
 * large copy off the event loop.
 *
 * Each copy makes the target's checks itself (slot_refuses: the slot's key against the
 * descriptor's, the range against the region's bounds, the right for the direction), between
 * setting the engine's busy bit and clearing it (see direct_table.c for why that order makes
 * retiring a region safe). Into or out of the peer's arena, mapped here, a copy is a memcpy
 * and a fence; elsewhere the kernel copies (process_vm_writev / readv). A peer whose process
 * exited fails its copies with -FI_ECONNRESET (its pidfd, polled once per pass). A strided
 * write (a paged write's run of pages with adjacent destinations and evenly spaced sources)
 * is one op: its pieces go into the peer's contiguous range by a 2-D memcpy (arena) or by
 * process_vm_writev calls of up to DIRECT_IOV local pieces each, with no staging copy. A bare
 * immediate with a direct code copies nothing: aio__direct_check makes the same checks in
 * place, in the posting thread, before it goes to shm. */
#include "internal.h"

#include <sys/uio.h>

#include "copier.h"
#include "direct_copy.h"
#include "direct_table.h"
#include "shm_wake.h"

/* Whether [raddr, raddr + len) of the peer's memory lies in its arena, mapped here. */
static int in_arena(const direct_peer *p, uint64_t raddr, uint64_t len) {
    return p->amap && raddr - p->abase < p->alen && len <= p->alen - (raddr - p->abase);
}

/* Whether a slot refuses request d: closed (key 0), another key, a range past its region, or
 * no right for the direction. The key is read first (seq_cst), after the caller's busy mark
 * when it copies: see aio__direct_copy. */
static int slot_refuses(direct_slot *s, const aio_op_desc *d) {
    uint64_t key = atomic_load(&s->key);
    uint64_t base = atomic_load_explicit(&s->base, memory_order_relaxed);
    uint64_t len = atomic_load_explicit(&s->len, memory_order_relaxed);
    uint32_t need = d->op == AIO_OP_READ ? AIO_ACCESS_REMOTE_READ : AIO_ACCESS_REMOTE_WRITE;
    return key == 0 || key != d->rkey || d->raddr < base || d->raddr - base > len ||
           d->length > len - (d->raddr - base) || !(atomic_load_explicit(&s->access, memory_order_relaxed) & need);
}

/* One direct copy's parts (copier.c calls these, for the whole copy or for each half). A
 * strided write (piece > 0: aio_post_paged's pages to a direct route) reads its local bytes
 * as pieces of `piece` bytes, `stride` apart; the peer's side is one contiguous range. */
typedef struct {
    direct_peer *p;
    const aio_op_desc *d;
    char *there; /* the peer's bytes, mapped here (its arena), or NULL */
    char *here;  /* ours */
    uint64_t piece;
    uint64_t stride;
} part_ctx;

/* Copies the peer's bytes [off, off + len) of a strided write from their local pieces. */
static void strided_part(const part_ctx *c, uint64_t off, uint64_t len) {
    uint64_t i = off / c->piece, at = off % c->piece;
    char *dst = c->there + off;
    while (len) {
        uint64_t n = c->piece - at < len ? c->piece - at : len;
        memcpy(dst, c->here + i * c->stride + at, n);
        dst += n;
        len -= n;
        i++;
        at = 0;
    }
}

static int mapped_part(void *arg, uint64_t off, uint64_t len) {
    part_ctx *c = arg;
    if (c->piece) strided_part(c, off, len);
    else if (c->d->op == AIO_OP_READ) memcpy(c->here + off, c->there + off, len);
    else memcpy(c->there + off, c->here + off, len);
    return 0;
}

#define DIRECT_IOV 512 /* local pieces per process_vm_writev (IOV_MAX is 1024) */

static int vm_error(ssize_t k) {
    return k == 0 ? -FI_EFAULT : errno == ESRCH ? -FI_ECONNRESET : -errno;
}

static int vm_part(void *arg, uint64_t off, uint64_t len) {
    part_ctx *c = arg;
    int rd = c->d->op == AIO_OP_READ;
    uint64_t done = 0;
    while (done < len) {
        struct iovec lio = {.iov_base = c->here + off + done, .iov_len = len - done};
        struct iovec rio = {.iov_base = (void *)(uintptr_t)(c->d->raddr + off + done), .iov_len = len - done};
        ssize_t k = rd ? process_vm_readv(c->p->pid, &lio, 1, &rio, 1, 0)
                       : process_vm_writev(c->p->pid, &lio, 1, &rio, 1, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return vm_error(k);
        done += (uint64_t)k;
    }
    return 0;
}

/* A strided write outside an arena: up to DIRECT_IOV local pieces per system call into the
 * peer's contiguous range (a short copy resumes where it stopped, mid-piece if need be). */
static int vm_strided(const part_ctx *c) {
    struct iovec lio[DIRECT_IOV];
    uint64_t len = c->d->length, done = 0;
    while (done < len) {
        uint64_t i = done / c->piece, at = done % c->piece, want = 0;
        int k = 0;
        for (; k < DIRECT_IOV && done + want < len; k++, i++, at = 0) {
            uint64_t n = c->piece - at;
            if (n > len - done - want) n = len - done - want;
            lio[k].iov_base = c->here + i * c->stride + at;
            lio[k].iov_len = n;
            want += n;
        }
        struct iovec rio = {.iov_base = (void *)(uintptr_t)(c->d->raddr + done), .iov_len = want};
        ssize_t got = process_vm_writev(c->p->pid, lio, (unsigned long)k, &rio, 1, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return vm_error(got);
        done += (uint64_t)got;
    }
    return 0;
}

/* Makes one direct copy (poller 0's thread, the only one that copies: a peer's slot has one busy
 * bit per engine, set and cleared around each copy): 0, or a negative error for its op. */
int aio__direct_copy(aio_engine *e, const aio_op *op, uint64_t run) {
    const aio_op_desc *d = &op->d;
    direct_peer *p = &e->dpeers[(d->direct >> 16) - 1];
    uint32_t idx = (uint32_t)d->direct & 0xffff;
    if (atomic_load(&p->dead)) return -FI_ECONNRESET;
    if (p->checked != run) { /* once per pass: has its process exited (pid reuse)? */
        p->checked = run;
        if (aio__peer_gone(p)) return -FI_ECONNRESET;
    }
    direct_slot *s = &p->t->slots[idx];
    uint64_t bit = 1ULL << p->index;
    part_ctx c = {p, d, NULL, (char *)((aio_mr *)d->mr)->buf + d->offset, 0, 0};
    if (op->dpieces > 1) {
        c.piece = d->length / op->dpieces;
        c.stride = op->dstride;
    }
    /* mark, then read the key (seq_cst both): the owner clears the key, then reads the marks,
     * so either it sees our mark and waits, or we see its cleared key and do not copy */
    atomic_fetch_or(&s->busy, bit);
    int rc = 0;
    if (slot_refuses(s, d)) {
        rc = -FI_EACCES;
    } else if (in_arena(p, d->raddr, d->length)) {
        /* in the peer's arena, mapped here: a plain copy, then a release fence so that whoever
         * learns of the completion (the immediate, a message) finds the bytes */
        c.there = p->amap + (d->raddr - p->abase);
        rc = aio__split(e, d->length, mapped_part, &c);
        atomic_thread_fence(memory_order_seq_cst);
        atomic_fetch_add_explicit(&e->st_mapped, 1, memory_order_relaxed);
    } else if (c.piece) { /* outside the arena: the kernel copies between the two address spaces */
        rc = vm_strided(&c);
    } else {
        rc = vm_part(&c, 0, d->length); /* not split: the kernel's copy gained nothing in halves */
    }
    atomic_fetch_and(&s->busy, ~bit);
    return rc;
}

/* The checks of a direct copy, made in place for a request that moves no bytes itself (a bare
 * immediate to a same-host peer): the peer's process alive, the slot's key, bounds and right.
 * 0, -FI_EINVAL (bad code), -AIO_EPEERGONE (the peer died: nothing posted, counted as
 * posts_peer_gone) or -FI_EACCES. No busy mark: nothing of the region is touched. */
int aio__direct_check(aio_engine *e, const aio_op_desc *d) {
    direct_peer *p = &e->dpeers[(d->direct >> 16) - 1];
    if (aio__peer_gone(p)) return aio__peer_gone_refusal(e);
    if (slot_refuses(&p->t->slots[d->direct & 0xffff], d)) return -FI_EACCES;
    return 0;
}

/* Direct copies in runs (poller 0, before aio__direct_run posts anything). A paged write to a
 * same-host peer queues one op per page unless its pages form strided runs (aio_post_paged:
 * then one strided op per run, copied alone); copied one by one, each page costs a system call
 * and, with an immediate, a zero-byte shm message. So consecutive queued copies into one
 * region of one peer (same attachment and slot, same direction, outside an arena) are made
 * by one process_vm_writev / readv of up to DIRECT_IOV pieces, after the same slot checks
 * as aio__direct_copy (busy mark, key of every op, bounds of every op, right); a short copy
 * falls back to aio__direct_copy for each op. Then, within a run of copied writes to one peer on
 * one rail carrying the same immediate, only the last posts it, with the run's weights
 * added up (as a gathered paged request does); the others are marked dmerged and complete
 * at once, whatever their connection's queue (they post nothing). An op merged once is
 * never counted into another run, though it waits a pass; a carrier kept for room keeps its
 * weight. The immediate still follows every byte of its run. */
static int direct_same_run(const aio_op *a, const aio_op *b) {
    return b && !b->dcopied && !b->dpost && b->dpieces <= 1 && a->dpieces <= 1 && b->d.direct == a->d.direct &&
           b->d.op == a->d.op;
}

/* The copies: runs of two or more made at once, each op's status set. */
static void direct_batch_copy(aio_engine *e, aio_op *list, uint64_t run) {
    struct iovec lio[DIRECT_IOV], rio[DIRECT_IOV];
    for (aio_op *op = list; op;) {
        if (op->dcopied || op->dpost) {
            op = op->dnext;
            continue;
        }
        direct_peer *p = &e->dpeers[(op->d.direct >> 16) - 1];
        int k = 0;
        aio_op *end = op;
        uint64_t total = 0;
        while (k < DIRECT_IOV && direct_same_run(op, end) && !in_arena(p, end->d.raddr, end->d.length)) {
            aio_mr *m = end->d.mr;
            lio[k].iov_base = (char *)m->buf + end->d.offset;
            lio[k].iov_len = end->d.length;
            rio[k].iov_base = (void *)(uintptr_t)end->d.raddr;
            rio[k].iov_len = end->d.length;
            total += end->d.length;
            k++;
            end = end->dnext;
        }
        if (k < 2) { /* a single copy (or an arena's memcpy): aio__direct_run makes it */
            op = k ? end : op->dnext;
            continue;
        }
        int ok = !atomic_load(&p->dead);
        direct_slot *s = &p->t->slots[op->d.direct & 0xffff];
        uint64_t bit = 1ULL << p->index;
        if (ok) { /* the checks of aio__direct_copy, once for the slot and for each op's range */
            atomic_fetch_or(&s->busy, bit);
            uint64_t key = atomic_load(&s->key);
            uint64_t base = atomic_load_explicit(&s->base, memory_order_relaxed);
            uint64_t len = atomic_load_explicit(&s->len, memory_order_relaxed);
            uint32_t need = op->d.op == AIO_OP_READ ? AIO_ACCESS_REMOTE_READ : AIO_ACCESS_REMOTE_WRITE;
            ok = key != 0 && (atomic_load_explicit(&s->access, memory_order_relaxed) & need);
            for (aio_op *o = op; ok && o != end; o = o->dnext)
                ok = o->d.rkey == key && o->d.raddr >= base && o->d.raddr - base <= len &&
                     o->d.length <= len - (o->d.raddr - base);
            if (ok) {
                ssize_t got = op->d.op == AIO_OP_READ ? process_vm_readv(p->pid, lio, (unsigned long)k, rio,
                                                                         (unsigned long)k, 0)
                                                      : process_vm_writev(p->pid, lio, (unsigned long)k, rio,
                                                                          (unsigned long)k, 0);
                ok = got == (ssize_t)total;
            }
            atomic_fetch_and(&s->busy, ~bit);
        }
        for (aio_op *o = op; o != end; o = o->dnext) {
            if (ok) {
                o->dstatus = 0;
                o->dcopied = 1;
                atomic_fetch_add_explicit(&e->st_direct, 1, memory_order_relaxed);
            } else { /* one by one, each with its own status */
                o->dstatus = aio__direct_copy(e, o, run);
                o->dcopied = 1;
                if (!o->dstatus) atomic_fetch_add_explicit(&e->st_direct, 1, memory_order_relaxed);
            }
        }
        op = end;
    }
}

/* The immediates: a run of copied writes to one peer with one immediate posts it once. */
static void direct_batch_merge(aio_engine *e, aio_op *list) {
    for (aio_op *op = list; op; op = op->dnext) {
        if (!op->dcopied || op->dstatus || op->dpost || op->dmerged || !(op->d.flags & AIO_F_DATA)) continue;
        aio_rail *r = e->rails[op->rail];
        if (r->cq_data_size < 8) continue;
        aio_op *last = op;
        uint64_t units = 0;
        int n = 0;
        for (aio_op *o = op; o && n < 4096; o = o->dnext) {
            if (!o->dcopied || o->dstatus || o->dpost || o->dmerged || !(o->d.flags & AIO_F_DATA) || o->rail != op->rail ||
                o->d.peer != op->d.peer || (uint32_t)o->d.data != (uint32_t)op->d.data)
                break;
            uint64_t w = o->d.data >> 32;
            units += w ? w : AIO_CREDIT_UNIT;
            last = o;
            n++;
        }
        if (n < 2 || units > UINT32_MAX) continue;
        for (aio_op *o = op; o != last; o = o->dnext) o->dmerged = 1;
        last->d.data = (last->d.data & 0xffffffffULL) | (units << 32);
        op = last;
    }
}

void aio__direct_batch(aio_engine *e, aio_op *list, uint64_t run) {
    direct_batch_copy(e, list, run);
    direct_batch_merge(e, list);
}
