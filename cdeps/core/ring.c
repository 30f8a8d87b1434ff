/* The completion ring: how records reach the event loop.
 *
 * Theory of operation. Every outcome the loop must learn of (a group finished, a message
 * arrived, a counter or a watched word reached what a task awaits, a link changed, room to
 * post again) is an aio_record pushed into one ring per engine. Producers are many (the
 * poller threads, and any posting thread that drives a rail itself) and serialize on ring_mu;
 * the consumer is one, the loop, which drains without a lock (aio_drain: head is the loop's,
 * tail the producers'; acquire/release on the two indices). A ring rather than a queue per
 * waiter because the loop wants everything that happened since it last looked, in order, in
 * one call from Python.
 *
 * The loop sleeps in its selector on the engine's eventfd. Writing it costs a system call
 * and a wake-up, so a producer writes it only when the loop said it is going to sleep
 * (aio_arm sets `armed`; the first push after that exchanges it back to 0 and signals): one
 * signal per drain cycle, however many records came. aio_arm returns 1 when records are
 * already waiting, which closes the race with a push made just before the flag was set.
 * A record pushed quiet (a group submitted with aio_submit_quiet: work posted now and awaited
 * later) signals only while some task counts itself waiting for one (aio_quiet_waiters), or
 * when the ring is half full; each side looks at the other's count after a seq_cst fence.
 *
 * Records are never dropped for want of memory (aio__ring_put). When the ring is full they
 * queue behind it on the overflow list, in nodes from malloc; when malloc fails:
 *   - a poller thread keeps the record in its own stash (RING_STASH records, allocated with the
 *     poller) and stops producing: while its stash is not empty it neither reads its rails'
 *     CQs nor makes copies, holding no lock, and moves the stash into the ring as the loop
 *     drains it (backpressure: completions wait in the provider, nothing is lost);
 *   - any other thread (the loop's posts, aio_want_space, aio_counter_add: a few records per
 *     call, and it may be the very thread that drains the ring, so it must not wait) takes a
 *     node from the engine's reserve (RING_RESERVE nodes, allocated with the engine), which
 *     the drain gives back.
 * While the ring is full, threads other than pollers read no completions (aio__progress_locked):
 * their own records are a few per call. Only such a thread producing more than RING_RESERVE
 * records while the ring is full and malloc fails would lose one; it is counted (st_lost) and
 * logged to stderr.
 *
 * aio_poll_ring is the loop thread's own low-latency wait (the GIL released): rather than
 * sleep until a poller's record signals the eventfd (a wake-up of another thread, then of the
 * loop), it drives the rails' CQs itself, skipping a rail whose lock the poller holds (the
 * poller pushes what it reads), polls for LOOP_POLL_SPIN_NS, then sleeps on the rails' wait
 * objects and the armed eventfd together.
 *
 * A poller's records signal the eventfd only once it has let go of the rail it read them under
 * (aio__ring_signal_due, after each rail's pass): the loop a signal wakes is often on the
 * poller's own CPU, preempts it at once, and would find the rail still locked by a poller that
 * cannot run, so that the request it posts next goes to the poller's queue and leaves only
 * once the loop sleeps again (a WriteImm ping-pong's hop then waits out the loop's work after
 * its post). Other threads signal at once. */
#include "internal.h"

#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>

#include "completion.h"
#include "poller.h"
#include "ring.h"
#include "watch.h"

/* aio_poll_ring polls (yielding the CPU in between) this long, then sleeps on the rails' wait
 * objects and the eventfd in steps of at most LOOP_POLL_BLOCK_MAX_NS: on a busy machine a
 * thread that yields may wait out another process's whole time slice, one that sleeps is
 * woken at once */
#define LOOP_POLL_SPIN_NS 30000LL
#define LOOP_POLL_BLOCK_MAX_NS 1000000LL

#ifdef AIO_TEST_HOOKS
_Atomic int aio_test_ovf_malloc_fail; /* tests: the overflow list's malloc fails */
#endif

/* the poller this thread is (poller.c sets it): aio__ring_put's stash */
__thread struct aio_poller *aio__tl_poller;

/* Places a record in the ring or behind it. Caller holds ring_mu. 0: no room and no memory
 * (only when `may_stash`, a poller that keeps it; other callers take a reserve node). */
static int ring_place_locked(aio_engine *e, const aio_record *r, int may_stash) {
    uint64_t tail = atomic_load_explicit(&e->ring_tail, memory_order_relaxed);
    uint64_t head = atomic_load_explicit(&e->ring_head, memory_order_acquire);
    if (atomic_load(&e->ovf_count) == 0 && tail - head <= e->ring_mask) {
        e->ring[tail & e->ring_mask] = *r;
        atomic_store_explicit(&e->ring_tail, tail + 1, memory_order_release);
        return 1;
    }
    /* keep order: once anything overflowed, everything goes behind it */
    overflow_node *n = NULL;
#ifdef AIO_TEST_HOOKS
    if (!atomic_load(&aio_test_ovf_malloc_fail))
#endif

        n = malloc(sizeof(*n));
    if (n) {
        n->reserve = 0;
    } else if (may_stash) {
        return 0;
    } else if ((n = e->ovf_free)) {
        e->ovf_free = n->next;
    } else {
        if (atomic_fetch_add(&e->st_lost, 1) == 0)
            fprintf(stderr, "aiote: out of memory for completion records: a record was lost\n");
        return 1;
    }
    n->rec = *r;
    n->next = NULL;
    if (e->ovf_tail) e->ovf_tail->next = n; else e->ovf_head = n;
    e->ovf_tail = n;
    atomic_fetch_add(&e->ovf_count, 1);
    return 1;
}

static void ring_signal(aio_engine *e) {
    if (atomic_exchange(&e->armed, 0)) {
        uint64_t one = 1;
        ssize_t w = write(e->efd, &one, sizeof(one));
        (void)w;
        atomic_fetch_add_explicit(&e->st_wakeups, 1, memory_order_relaxed);
    }
}

/* A poller moves its stash into the ring (in order): 1 if some is left (it must not produce
 * more meanwhile). */
int aio__stash_flush(aio_poller *q) {
    aio_engine *e = q->e;
    int k = 0;
    pthread_mutex_lock(&e->ring_mu);
    while (k < q->nstash && ring_place_locked(e, &q->stash[k], 1)) k++;
    pthread_mutex_unlock(&e->ring_mu);
    if (k) {
        memmove(q->stash, q->stash + k, (size_t)(q->nstash - k) * sizeof(aio_record));
        q->nstash -= k;
    }
    ring_signal(e); /* the loop drains: room for the rest */
    return q->nstash > 0;
}

void aio__ring_put(aio_engine *e, const aio_record *r, int quiet) {
    aio_poller *q = aio__tl_poller && aio__tl_poller->e == e && aio__tl_poller->stash ? aio__tl_poller : NULL;
    int placed = 0;
    pthread_mutex_lock(&e->ring_mu);
    if (!q || q->nstash == 0) placed = ring_place_locked(e, r, q && q->nstash < RING_STASH);
    if (!placed && q && q->nstash >= RING_STASH) placed = ring_place_locked(e, r, 0);
    pthread_mutex_unlock(&e->ring_mu);
    if (!placed) { /* behind the stash, in order; the poller stops producing (poller.c) */
        q->stash[q->nstash++] = *r;
        quiet = 0;
    }
    if (quiet) {
        /* signal only if a task waits for a quiet record (it counted itself in before it
         * looked at the ring: one of the two sees the other), or the ring fills up */
        atomic_thread_fence(memory_order_seq_cst);
        uint64_t used = atomic_load(&e->ring_tail) - atomic_load(&e->ring_head);
        if (atomic_load(&e->quiet_waiters) == 0 && used <= (e->ring_mask >> 1) &&
            atomic_load(&e->ovf_count) == 0)
            return;
    }
    if (q) { /* a poller: once it lets go of the rail (aio__ring_signal_due) */
        q->signal_due = 1;
        return;
    }
    ring_signal(e);
}

void aio__ring_signal_due(aio_poller *q) {
    if (!q->signal_due) return;
    q->signal_due = 0;
    ring_signal(q->e);
}

int aio_drain(aio_engine *e, aio_record *out, int max) {
    int n = 0;
    if (e->cfg.follow_loop) { /* where the loop runs, for poller 0 (poller.c: follow_loop) */
        atomic_store_explicit(&e->loop_cpu, sched_getcpu(), memory_order_relaxed);
        atomic_store_explicit(&e->loop_seen, now_ns(), memory_order_relaxed);
    }
    uint64_t head = atomic_load_explicit(&e->ring_head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&e->ring_tail, memory_order_acquire);
    while (n < max && head != tail) {
        out[n++] = e->ring[head & e->ring_mask];
        head++;
    }
    atomic_store_explicit(&e->ring_head, head, memory_order_release);
    if (n < max && atomic_load(&e->ovf_count) > 0) {
        pthread_mutex_lock(&e->ring_mu);
        /* ring first (records pushed before the overflow began are all there) */
        tail = atomic_load_explicit(&e->ring_tail, memory_order_acquire);
        while (n < max && head != tail) {
            out[n++] = e->ring[head & e->ring_mask];
            head++;
        }
        atomic_store_explicit(&e->ring_head, head, memory_order_release);
        while (n < max && e->ovf_head && head == tail) {
            overflow_node *x = e->ovf_head;
            out[n++] = x->rec;
            e->ovf_head = x->next;
            if (!e->ovf_head) e->ovf_tail = NULL;
            if (x->reserve) {
                x->next = e->ovf_free;
                e->ovf_free = x;
            } else {
                free(x);
            }
            atomic_fetch_sub(&e->ovf_count, 1);
        }
        pthread_mutex_unlock(&e->ring_mu);
    }
    return n;
}

int aio_arm(aio_engine *e) {
    atomic_store(&e->armed, 1);
    uint64_t head = atomic_load(&e->ring_head);
    uint64_t tail = atomic_load(&e->ring_tail);
    return (head != tail || atomic_load(&e->ovf_count) > 0) ? 1 : 0;
}

static inline int ring_ready(aio_engine *e) {
    return atomic_load_explicit(&e->ring_head, memory_order_relaxed) !=
               atomic_load_explicit(&e->ring_tail, memory_order_acquire) ||
           atomic_load_explicit(&e->ovf_count, memory_order_relaxed) > 0;
}

int aio_quiet_waiters(aio_engine *e, int delta) {
    atomic_fetch_add(&e->quiet_waiters, delta);
    atomic_thread_fence(memory_order_seq_cst);
    return ring_ready(e);
}

void aio_clear_eventfd(aio_engine *e) {
    uint64_t v;
    ssize_t r = read(e->efd, &v, sizeof(v));
    (void)r;
}

int aio_engine_eventfd(aio_engine *e) { return e->efd; }
/* The blocking half of aio_poll_ring: sleeps for at most `ns` on the rails' wait objects and
 * on the engine's eventfd, armed, so that a record the poller pushes meanwhile (it keeps
 * polling too) wakes it. 0 if some rail has no wait object or has work ready (fi_trywait
 * refused), or a record is already waiting: the caller polls again instead. */
static int loop_block(aio_engine *e, int64_t ns) {
    struct pollfd p[AIO_MAX_RAILS + 1];
    for (int i = 0; i < e->nrails; i++) {
        aio_rail *r = e->rails[i];
        if (r->wait_fd < 0) return 0;
        if (aio__rail_trywait(r) != FI_SUCCESS) return 0;
        p[i].fd = r->wait_fd;
        p[i].events = POLLIN;
        p[i].revents = 0;
    }
    p[e->nrails].fd = e->efd;
    p[e->nrails].events = POLLIN;
    p[e->nrails].revents = 0;
    if (aio_arm(e)) { /* a record came in meanwhile (the missed-wakeup check) */
        atomic_store(&e->armed, 0);
        return 0;
    }
    if (ns > LOOP_POLL_BLOCK_MAX_NS) ns = LOOP_POLL_BLOCK_MAX_NS;
    if (atomic_load(&e->nwatch) > 0 && ns > (int64_t)e->cfg.watch_us * 1000) /* read them again soon */
        ns = (int64_t)e->cfg.watch_us * 1000;
    struct timespec ts = {.tv_sec = ns / 1000000000LL, .tv_nsec = ns % 1000000000LL};
    ppoll(p, (nfds_t)e->nrails + 1, &ts, NULL);
    /* disarm, then clear: a push in between wrote the eventfd, which this read empties, so the
     * event loop is not woken later for records its caller drains now */
    atomic_store(&e->armed, 0);
    aio_clear_eventfd(e);
    return 1;
}

int aio_poll_ring(aio_engine *e, int64_t budget_ns) {
    if (ring_ready(e)) return 1;
    /* records pushed from now on must not signal the eventfd: the caller drains them (and
     * re-arms with aio_arm) right after this returns */
    atomic_store(&e->armed, 0);
    atomic_fetch_add_explicit(&e->st_loop_polls, 1, memory_order_relaxed);
    int64_t start = now_ns();
    int64_t deadline = start + (budget_ns > 0 ? budget_ns : 0);
    for (;;) {
        for (int i = 0; i < e->nrails; i++) {
            aio_rail *r = e->rails[i];
            /* busy: the poller is reading it (and pushes what it reads) */
            if (pthread_mutex_trylock(&r->mu) != 0) continue;
            aio__progress_locked(e, r);
            pthread_mutex_unlock(&r->mu);
        }
        aio__poll_watches(e);
        if (ring_ready(e)) return 1;
        int64_t t = now_ns();
        if (t >= deadline) return 0;
        if (t - start < LOOP_POLL_SPIN_NS || !loop_block(e, deadline - t)) {
            /* the peer process or the kernel's network work may need this very core */
            sched_yield();
        }
    }
}
