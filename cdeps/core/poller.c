/* The poller threads: who reads the completion queues, and how they wait.
 *
 * Theory of operation. Nothing moves unless a rail's completion queue is read: aiote asks the
 * providers for manual progress (FI_PROGRESS_MANUAL), so tcp copies bytes into and out of its
 * sockets, and shm carries messages, only while someone polls. An engine runs n poller threads
 * (aio_engine_set_pollers, at most one per rail); rail i is driven by poller i % n, so that an
 * engine with several rails (NICs, or several connections to one NIC) moves data on several
 * cores at once (one thread copies into one tcp connection at about one core's speed). Poller
 * 0 also makes every direct same-host copy (its queue holds them: handoff.c), reads the
 * watched words (watch.c) and drains the link monitor (link.c). One pass of a poller: move its
 * stash into the ring if the ring was full (and produce nothing else until it is empty); run
 * its queue; read a batch of each of its rails' completions, each under that rail's lock;
 * then, on poller 0, the words and netlink.
 *
 * Spinning and sleeping. After activity a poller polls on (yielding the CPU between passes:
 * with few cores, the thread it waits for may need this very one) for spin_ns, or for
 * busy_spin_ns while work of ours is in flight on its rails, or for the adaptive window
 * (below) if longer. Then it sleeps in epoll_wait on its epoll set: its rails' wait fds
 * (after fi_trywait on each: a CQ with work pending must not be slept on), its kick eventfd,
 * the wake fifos of its shm rails, and on poller 0 the netlink socket; with a timeout, since
 * not every rail has a wait object: 1 ms steps while work of ours is in flight or a rail has
 * none; 50 us while a task awaits something only such a rail reports; watch_us while words
 * other than credit lanes are watched (finer in an expected change's window: watch.c); LANE_WAIT_US while lanes are read and a task awaits a
 * counter (a lane's credit arriving while nobody waits is read at the next pass, at most
 * sleep_ms later, or at once when a task arms a watch: that kicks poller 0); else sleep_ms. Whoever gives a poller work kicks it: post_seq is bumped (its
 * spin restarts), and its kick eventfd written only if it sleeps. The sleeper sets `sleeping`
 * and then looks at post_seq once more, the kicker bumps post_seq and then reads `sleeping`
 * (seq_cst both): one of them sees the other, so no kick is lost and none costs a system
 * call while the poller is awake.
 *
 * Adaptive spin. The spin window after the last activity grows while activity comes densely:
 * a stream of data arrives in many pieces (a large write's bytes come long before its
 * completion), and a sleep plus a wake-up per piece costs this side and the sender (an IPI on
 * a VM) far more than spinning through the gaps. Activity is a completion, a post, or bytes
 * arriving (a rail's wait fd ready on a socket rail, looked at while spinning with nothing of
 * ours in flight). An idle gap (from the last activity to the poll that finds the next) of at
 * most ADAPT_DENSE_NS, with a sleep in it, doubles the window (up to ADAPT_MAX_NS); a gap
 * longer than ADAPT_SPARSE_NS resets it to the base when the next activity comes. So traffic
 * with more than ADAPT_SPARSE_NS between events spins no more than the base window from its
 * first such gap on, and an engine that goes idle spins out the grown window once, then
 * sleeps.
 *
 * Sleeping on shm. The shm provider has no wait object. A poller whose every rail either has
 * one or is an shm rail that aiote peers wake (shm_wake.c), with nothing of ours in flight and
 * idle for WAKE_IDLE_NS, sets its shm rails' wake words, reads them once more, and sleeps the
 * full sleep_ms: a peer that posts to it reads the word and writes its fifo.
 *
 * Keeping to the loop's CPU (cfg.follow_loop). Every record this poller hands the loop is a
 * wake-up of the loop thread; woken on another CPU that CPU may be halted, and on a VM waking
 * it costs an interrupt and an exit to the hypervisor at each hop. Two processes ping-ponging
 * on a 2-vCPU VM ran their WriteImm round trips at 36 us one way when each one's loop and
 * poller shared a CPU (the two processes on different ones) and at 71 to 98 us in every other
 * placement (docs/benchmarks.md), and the scheduler settles in either for seconds. With
 * follow_loop, the loop notes its CPU at each aio_drain, and poller 0 (the poller of the first
 * rail: messages and the immediates of small transfers, direct copies) pins itself to that CPU,
 * looked at every FOLLOW_CHECK_NS; it gives the pin back (its affinity at start) once the loop
 * has not drained for FOLLOW_STALE_NS, so that a loop busy elsewhere or gone leaves it free,
 * and while it moves bulk data (its passes that found work, sending or receiving, took over a
 * quarter of the time): a stream of 1 MiB writes moved about 8% slower over tcp with its poller
 * kept on the loop's CPU (2 vCPUs). The other pollers (the rails that move bulk data on
 * many-core hosts) are never pinned. open_engine turns it on where the process may use at most
 * 2 CPUs, where every thread shares one anyway. */
#include "internal.h"

#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>

#include "completion.h"
#include "handoff.h"
#include "link.h"
#include "poller.h"
#include "ring.h"
#include "watch.h"

/* the poller's adaptive spin (see "Adaptive spin" above): idle gaps of at most ADAPT_DENSE_NS,
 * with a sleep in one, double the spin window up to ADAPT_MAX_NS; an idle gap over
 * ADAPT_SPARSE_NS resets it */
#ifndef ADAPT_DENSE_NS
#define ADAPT_DENSE_NS 250000LL
#endif
#ifndef ADAPT_MAX_NS
#define ADAPT_MAX_NS 500000LL
#endif
#ifndef ADAPT_SPARSE_NS
#define ADAPT_SPARSE_NS 250000LL
#endif

/* A poller relies on wake-ups only once idle this long: until then it keeps its short timed
 * steps (50 us while a task awaits something), which on a VM answer a ping-pong faster than a
 * wake-up from another process (an interrupt to a sleeping CPU: aiote's imm-latency p50 went
 * from 23 to 66 us with wake-ups alone; see shm_wake.c). Idle means idle after this. */
#define WAKE_IDLE_NS 200000000LL
/* The longest sleep of poller 0 while credit lanes are read and a task awaits a counter. */
#define LANE_WAIT_US 20
#define WATCH_FINE_US 5 /* reads of the watched words inside an expected change's window */

/* follow_loop: how often poller 0 looks where the loop runs, and how long without a drain it
 * keeps to the loop's CPU (see "Keeping to the loop's CPU" above) */
#define FOLLOW_CHECK_NS 2000000LL
#define FOLLOW_STALE_NS 100000000LL
/* ... and a poller that spent more than 1/FOLLOW_BULK_SHARE of the time since its last look in
 * passes that found work is moving bulk data, which wants a CPU of its own: it keeps to none */
#define FOLLOW_BULK_SHARE 4
/* a pass this long moved bytes (a receiver's socket reads complete nothing until the last) */
#define FOLLOW_PASS_WORK_NS 20000LL

/* How long poller 0 may sleep while words other than lanes are watched: watch_us, less up
 * to an expected change's window (aio_watch_soon), WATCH_FINE_US inside it. */
static long watch_sleep_us(aio_engine *e) {
    long w = e->cfg.watch_us;
    int64_t now = now_ns(), from = atomic_load(&e->fine_from), until = atomic_load(&e->fine_until);
    if (until <= now) return w;
    if (from <= now) return WATCH_FINE_US < w ? WATCH_FINE_US : w;
    long to = (long)((from - now) / 1000);
    if (to < WATCH_FINE_US) to = WATCH_FINE_US;
    return to < w ? to : w;
}

/* Tells poller q there is work (its spin restarts), waking it if it sleeps. */
static void kick_poller(aio_poller *q) {
    atomic_fetch_add(&q->post_seq, 1);
    if (atomic_load(&q->sleeping)) {
        uint64_t one = 1;
        ssize_t w = write(q->kick_fd, &one, sizeof(one));
        (void)w;
    }
}

/* Kicks the pollers of the rails in `mask` (bit i: rail i). */
void aio__kick_rails(aio_engine *e, uint32_t mask) {
    uint32_t done = 0;
    for (int i = 0; i < e->nrails && mask; i++, mask >>= 1) {
        int q = e->rails[i]->poller;
        if ((mask & 1) && !(done & (1u << q))) {
            done |= 1u << q;
            kick_poller(&e->pollers[q]);
        }
    }
}

/* Kicks every poller. */
void aio__kick(aio_engine *e) {
    for (int i = 0; i < e->npollers; i++) kick_poller(&e->pollers[i]);
}

/* Kicks poller 0, which reads the watched words. */
void aio__kick_watcher(aio_engine *e) {
    if (e->npollers) kick_poller(&e->pollers[0]);
}

/* fi_trywait on a rail's CQ, under the rail's lock: FI_SUCCESS when its wait fd may be
 * slept on (nothing pending in the provider), else what the provider said */
int aio__rail_trywait(aio_rail *r) {
    struct fid *f = &r->cq->fid;
    pthread_mutex_lock(&r->mu);
    int tw = fi_trywait(r->fabric, &f, 1);
    pthread_mutex_unlock(&r->mu);
    return tw;
}

/* Whether bytes arrived on a socket rail since its provider last read (its wait fd ready):
 * each such rail's CQ re-armed with fi_trywait first, so that a completion signal already seen
 * does not count. A rail whose fi_trywait says -FI_EAGAIN (work pending in the provider) counts
 * as ready; another error does not (it would keep the poller from ever sleeping). Rails whose
 * wait fd does not signal bytes (shm has none; verbs and efa signal completions) are not looked
 * at: their completions are their activity. */
static int rails_ready(aio_poller *q) {
    for (int i = 0; i < q->nrails; i++) {
        aio_rail *r = q->rails[i];
        if (!r->bytes_fd) continue;
        int tw = aio__rail_trywait(r);
        if (tw == -FI_EAGAIN) return 1;
        if (tw != FI_SUCCESS) continue;
        struct pollfd p = {.fd = r->wait_fd, .events = POLLIN};
        if (poll(&p, 1, 0) > 0 && (p.revents & POLLIN)) return 1;
    }
    return 0;
}

/* What a poller's loop keeps from one pass to the next (poller_main). */
typedef struct poll_state {
    aio_poller *q;
    aio_engine *e;
    int watcher;          /* poller 0 also reads the watched words and the link monitor */
    int64_t last_active;  /* when the last activity was seen */
    int64_t adapt;        /* the adaptive spin window (see "Adaptive spin" above); 0: the base */
    int slept;            /* the poller slept since the last activity */
    int io_wake;          /* a rail's wait fd was ready: bytes are moving */
    int64_t io_checked;   /* when rails_ready last looked */
    uint64_t seen_seq;    /* post_seq at the last activity */
    int all_fd, any_fd;   /* any_fd: some rail's wait fd signals bytes arriving */
    int woken;            /* every rail has a wait fd, or is an shm rail its peers wake (aio__shm_wake) */
    int follow;           /* poller 0 of an engine with follow_loop */
    int pinned;           /* the CPU it keeps to, -1: none (its affinity at start) */
    int64_t follow_checked;
    int64_t work_ns;      /* time in passes that found work since follow_checked */
    cpu_set_t start_mask; /* its affinity at start, given back when it unpins */
} poll_state;

static void poll_state_init(poll_state *s, aio_poller *q) {
    memset(s, 0, sizeof(*s));
    s->q = q;
    s->e = q->e;
    s->watcher = q->index == 0;
    s->last_active = now_ns();
    s->seen_seq = atomic_load(&q->post_seq);
    s->all_fd = 1;
    s->woken = 1;
    s->pinned = -1;
    s->follow = q->index == 0 && s->e->cfg.follow_loop &&
                sched_getaffinity(0, sizeof(s->start_mask), &s->start_mask) == 0;
    for (int i = 0; i < q->nrails; i++) {
        if (q->rails[i]->wait_fd < 0) s->all_fd = 0;
        if (q->rails[i]->wait_fd < 0 && q->rails[i]->wake_fd < 0) s->woken = 0;
        if (q->rails[i]->bytes_fd) s->any_fd = 1;
    }
}

/* One pass: the poller's queue, a batch of each of its rails' completions, and on poller 0 the
 * watched words and the link monitor. Returns what it found; *t_poll: when it read the rails. */
static int poll_pass(poll_state *s, int64_t *t_poll) {
    aio_poller *q = s->q;
    aio_engine *e = s->e;
    int got = aio__direct_run(q);
    *t_poll = now_ns(); /* idle gaps end here: reading a large message is not idle */
    aio__ring_signal_due(q); /* the queue's records (copies made, handed requests failed) */
    for (int i = 0; i < q->nrails; i++) {
        aio_rail *r = q->rails[i];
        pthread_mutex_lock(&r->mu);
        got += aio__progress_locked(e, r);
        pthread_mutex_unlock(&r->mu);
        aio__ring_signal_due(q); /* the loop may run now: the rail is free for its next post */
    }
    if (s->watcher) got += aio__poll_watches(e);
    atomic_fetch_add_explicit(&e->st_polls, 1, memory_order_relaxed);
    if (s->watcher && e->nl_fd >= 0) {
        int64_t t = now_ns();
        if (t - e->nl_checked > 1000000) {
            e->nl_checked = t;
            aio__drain_netlink(e);
        }
    }
    aio__ring_signal_due(q);
    return got;
}

/* Poller 0 with follow_loop: keeps to the CPU the loop last drained on, or gives its pin back
 * once the loop has not drained for FOLLOW_STALE_NS, or while it moves bulk data (its passes
 * that found work took over 1/FOLLOW_BULK_SHARE of the time since it last looked); see
 * "Keeping to the loop's CPU" above. */
static void follow_loop(poll_state *s, int64_t t) {
    if (t - s->follow_checked < FOLLOW_CHECK_NS) return;
    aio_engine *e = s->e;
    int cpu = atomic_load_explicit(&e->loop_cpu, memory_order_relaxed);
    int64_t seen = atomic_load_explicit(&e->loop_seen, memory_order_relaxed);
    int bulk = s->work_ns * FOLLOW_BULK_SHARE > t - s->follow_checked;
    s->follow_checked = t;
    s->work_ns = 0;
    if (cpu < 0 || bulk || t - seen > FOLLOW_STALE_NS || !CPU_ISSET(cpu, &s->start_mask)) {
        if (s->pinned >= 0 && sched_setaffinity(0, sizeof(s->start_mask), &s->start_mask) == 0) {
            s->pinned = -1;
            atomic_store(&e->st_follow_cpu, -1);
        }
        return;
    }
    if (cpu == s->pinned) return;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    if (sched_setaffinity(0, sizeof(one), &one) == 0) { /* (a cpuset that changed refuses it) */
        s->pinned = cpu;
        atomic_store(&e->st_follow_cpu, cpu);
        atomic_fetch_add_explicit(&e->st_follow_moves, 1, memory_order_relaxed);
    }
}

/* Activity (a completion, a post, bytes moving): the spin window adapts to the idle gap that
 * ended at t_poll (see "Adaptive spin" above), and the spin starts again. */
static void poll_active(poll_state *s, int64_t t_poll, uint64_t seq) {
    int64_t t = now_ns();
    int64_t idle = t_poll - s->last_active;
    if (idle > ADAPT_SPARSE_NS) {
        s->adapt = 0; /* sparse: the base window */
    } else if (s->slept && idle <= ADAPT_DENSE_NS) { /* dense, and we slept through it */
        s->adapt = s->adapt ? s->adapt * 2 : s->e->cfg.spin_ns * 2;
        if (s->adapt > ADAPT_MAX_NS) s->adapt = ADAPT_MAX_NS;
    }
    atomic_store_explicit(&s->e->st_adapt, s->adapt, memory_order_relaxed);
    s->slept = s->io_wake = 0;
    s->seen_seq = seq;
    s->last_active = t;
}

/* Spins a short budget after the last activity; longer while work of ours is in flight
 * (manual-progress providers move data only when polled), or the adaptive window. 1: still
 * spinning (the caller polls again), 0: time to sleep. */
static int poll_spin(poll_state *s, int64_t inflight) {
    aio_engine *e = s->e;
    int64_t spin = e->cfg.spin_ns;
    if (inflight > 0 && spin < e->cfg.busy_spin_ns) spin = e->cfg.busy_spin_ns;
    if (spin < s->adapt) spin = s->adapt;
    int64_t t = now_ns();
    if (t - s->last_active >= spin) return 0;
    /* while spinning with nothing of ours in flight (a receiver), bytes arriving count as
     * activity (a rail's wait fd ready after fi_trywait re-armed it): a stream keeps its window;
     * at most every 5 us. A sender is not looked at: its completions are its activity, and its
     * posting thread needs the rail's lock. */
    if (s->any_fd && inflight == 0 && t - s->io_checked > 5000) {
        s->io_checked = t;
        s->io_wake = rails_ready(s->q);
        if (s->io_wake) return 1;
    }
    /* yield rather than only pause: with few cores, the thread this spin waits for (the loop
     * that posts the next request, a peer process) may need this very core */
    sched_yield();
    return 1;
}

/* fi_trywait on each rail with a wait fd, before sleeping on them: 1 when the poller may sleep.
 * *fd_broken: a rail's wait fd cannot be trusted to wake us. */
static int rails_trywait(aio_poller *q, int *fd_broken) {
    int can_sleep = 1;
    for (int i = 0; i < q->nrails && can_sleep; i++) {
        aio_rail *r = q->rails[i];
        if (r->wait_fd < 0) continue;
        int tw = aio__rail_trywait(r);
        /* -FI_EAGAIN: work pending in the provider, poll again at once. Another error: its
         * wait fd cannot be trusted to wake us, so sleep in short timed steps rather than
         * spin on it for ever */
        if (tw == -FI_EAGAIN) can_sleep = 0;
        else if (tw != FI_SUCCESS) *fd_broken = 1;
    }
    return can_sleep;
}

/* shm rails whose peers wake us: nothing of ours in flight, so what can come is a peer's
 * request, and the peer wakes us (aio__shm_wake). Say that we sleep (the rails' wake words),
 * then look once more. 1: sleep; 0: something came meanwhile (the words are cleared again, and
 * it counts as activity). */
static int wake_arm(poll_state *s) {
    aio_poller *q = s->q;
    for (int i = 0; i < q->nrails; i++)
        if (q->rails[i]->wake_word) atomic_store(q->rails[i]->wake_word, 1);
    atomic_thread_fence(memory_order_seq_cst);
    int more = 0;
    for (int i = 0; i < q->nrails; i++) {
        aio_rail *r = q->rails[i];
        if (!r->wake_word) continue;
        pthread_mutex_lock(&r->mu);
        more += aio__progress_locked(s->e, r);
        pthread_mutex_unlock(&r->mu);
    }
    aio__ring_signal_due(q);
    if (more || atomic_load(&q->post_seq) != s->seen_seq) {
        for (int i = 0; i < q->nrails; i++)
            if (q->rails[i]->wake_word) atomic_store(q->rails[i]->wake_word, 0);
        s->io_wake = 1; /* activity: the top of the loop counts it */
        return 0;
    }
    return 1;
}

/* What woke the poller: a peer (its fifo), a kick, netlink, or a rail's wait object. */
static void poll_events(poll_state *s, const struct epoll_event *evs, int ne) {
    aio_poller *q = s->q;
    for (int k = 0; k < ne; k++) {
        int wk = -1;
        for (int i = 0; i < q->nrails && wk < 0; i++)
            if (q->rails[i]->wake_fd >= 0 && evs[k].data.fd == q->rails[i]->wake_fd) wk = i;
        if (wk >= 0) { /* a peer woke us: its request is in our queue */
            char buf[256];
            while (read(q->rails[wk]->wake_fd, buf, sizeof(buf)) > 0) {
            }
            s->io_wake = 1;
        } else if (evs[k].data.fd == q->kick_fd) {
            uint64_t v;
            ssize_t rr = read(q->kick_fd, &v, sizeof(v));
            (void)rr;
        } else if (evs[k].data.fd == s->e->nl_fd) {
            aio__drain_netlink(s->e);
        } else {
            /* a rail's wait object: data is moving even before any completion
             * (a large message arrives in many pieces): activity */
            s->io_wake = 1;
        }
    }
}

/* Sleeps on the poller's epoll set, for as long as its rails allow (see "Spinning and sleeping"
 * above), then takes in what woke it. */
static void poll_wait(poll_state *s, int64_t inflight, int fd_broken, int wake_sleep) {
    aio_poller *q = s->q;
    aio_engine *e = s->e;
    struct epoll_event evs[AIO_MAX_RAILS * 2 + 2]; /* rails' wait and wake fds, kick, netlink */
    int timeout = e->cfg.sleep_ms;
    /* a rail without a wait object, or work of ours in flight on a
     * manual-progress provider: sleep in short steps */
    if (inflight > 0 || fd_broken) timeout = 1;
    else if (!s->all_fd && !wake_sleep) /* no wait object: short steps, longer once idle a while */
        timeout = (now_ns() - s->last_active > 200000000LL) ? 5 : 1;
    atomic_fetch_add_explicit(&e->st_sleeps, 1, memory_order_relaxed);
    int ne;
    /* a rail without a wait object (shm) that no peer wakes, or a completion of ours to
     * come on one, tells nobody that it arrived: while a task awaits one, poll it every
     * 50 us rather than every millisecond */
    long short_us = (!s->all_fd && !wake_sleep && atomic_load(&e->nwant) > 0) ? 50 : 0;
    /* watched words (GPU completions, UVM words): read them again soon. Credit lanes stay
     * watched for the engine's life, so they alone do not count: an engine with lanes and
     * nothing awaited sleeps as long as any other */
    int32_t nlane = atomic_load(&e->nlane);
    if (s->watcher && atomic_load(&e->nwatch) > nlane) {
        long w = watch_sleep_us(e);
        if (!short_us || w < short_us) short_us = w;
    }
    /* a task awaits a counter (not a message), and a lane may bring its credit (watch.c) */
    if (s->watcher && nlane > 0 && atomic_load(&e->ncwant) > 0 && (!short_us || short_us > LANE_WAIT_US))
        short_us = LANE_WAIT_US;
    s->slept = 1;
    if (short_us) {
        struct timespec ts = {.tv_sec = short_us / 1000000L, .tv_nsec = (short_us % 1000000L) * 1000L};
        ne = epoll_pwait2(q->epfd, evs, AIO_MAX_RAILS * 2 + 2, &ts, NULL);
    } else {
        ne = epoll_wait(q->epfd, evs, AIO_MAX_RAILS * 2 + 2, timeout);
    }
    if (wake_sleep)
        for (int i = 0; i < q->nrails; i++)
            if (q->rails[i]->wake_word) atomic_store(q->rails[i]->wake_word, 0);
    poll_events(s, evs, ne);
    aio__ring_signal_due(q); /* netlink's link records */
}

/* Goes to sleep, unless work came meanwhile (a kick, a provider with work pending, a peer's
 * request on an shm rail). */
static void poll_sleep(poll_state *s, int64_t inflight) {
    aio_poller *q = s->q;
    aio__ring_signal_due(q); /* never sleep on a record the loop was not told of */
    atomic_store(&q->sleeping, 1);
    if (atomic_load(&q->post_seq) != s->seen_seq) {
        atomic_store(&q->sleeping, 0);
        return;
    }
    int fd_broken = 0;
    int can_sleep = rails_trywait(q, &fd_broken);
    int wake_sleep = can_sleep && !s->all_fd && s->woken && inflight == 0 && !fd_broken &&
                     now_ns() - s->last_active > WAKE_IDLE_NS;
    if (wake_sleep && !wake_arm(s)) {
        atomic_store(&q->sleeping, 0);
        return;
    }
    if (can_sleep) poll_wait(s, inflight, fd_broken, wake_sleep);
    atomic_store(&q->sleeping, 0);
}

static void *poller_main(void *arg) {
    aio_poller *q = arg;
    aio_engine *e = q->e;
    /* short timed sleeps (watched words) must not be stretched by the default 50 us slack */
    prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
    poll_state s;
    poll_state_init(&s, q);
    aio__tl_poller = q;
    while (!atomic_load(&e->stop)) {
        /* records the ring could not take (aio__ring_put): produce nothing more until they are in */
        if (q->nstash && aio__stash_flush(q)) {
            struct timespec ts = {.tv_sec = 0, .tv_nsec = 200000};
            nanosleep(&ts, NULL);
            continue;
        }
        int64_t t_poll, t0 = s.follow ? now_ns() : 0;
        int got = poll_pass(&s, &t_poll);
        uint64_t seq = atomic_load(&q->post_seq);
        if (s.follow) {
            int64_t took = now_ns() - t0;
            if (got || s.io_wake || took > FOLLOW_PASS_WORK_NS) s.work_ns += took;
            follow_loop(&s, t_poll);
        }
        if (got || seq != s.seen_seq || s.io_wake) {
            poll_active(&s, t_poll, seq);
            continue;
        }
        int64_t inflight = atomic_load(&q->inflight);
        if (poll_spin(&s, inflight)) continue;
        poll_sleep(&s, inflight);
    }
    return NULL;
}

/* Opens the next poller's kick eventfd and epoll set (not its thread: aio_engine_start): 0, or
 * -1 with errno (nothing left open). */
int aio__poller_open(aio_engine *e) {
    aio_poller *q = &e->pollers[e->npollers];
    q->e = e;
    q->index = e->npollers;
    q->stash = calloc(RING_STASH, sizeof(aio_record));
    if (!q->stash) {
        errno = ENOMEM;
        return -1;
    }
    q->kick_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    q->epfd = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = q->kick_fd};
    if (q->kick_fd < 0 || q->epfd < 0 || epoll_ctl(q->epfd, EPOLL_CTL_ADD, q->kick_fd, &ev) != 0) {
        int saved = errno;
        if (q->kick_fd >= 0) close(q->kick_fd);
        if (q->epfd >= 0) close(q->epfd);
        free(q->stash);
        q->stash = NULL;
        errno = saved;
        return -1;
    }
    pthread_mutex_init(&q->qmu, NULL);
    e->npollers++;
    return 0;
}

int aio_engine_set_pollers(aio_engine *e, int n) {
    if (e->started || e->nrails || n < 1 || n > AIO_MAX_RAILS) return -FI_EINVAL;
    e->npollers_want = n;
    return 0;
}

int aio_engine_num_pollers(aio_engine *e) {
    int n = 0; /* a poller whose rail failed to open, with no rail after it, runs no thread */
    for (int i = 0; i < e->npollers; i++) n += e->pollers[i].nrails > 0;
    return n;
}

/* Stops and joins the running poller threads. */
void aio__pollers_join(aio_engine *e) {
    atomic_store(&e->stop, 1);
    for (int i = 0; i < e->npollers; i++) {
        uint64_t one = 1;
        ssize_t w = write(e->pollers[i].kick_fd, &one, sizeof(one));
        (void)w;
    }
    for (int i = 0; i < e->npollers; i++) {
        if (!e->pollers[i].running) continue;
        pthread_join(e->pollers[i].thread, NULL);
        e->pollers[i].running = 0;
    }
}

int aio__pollers_start(aio_engine *e) {
    for (int i = 0; i < e->npollers; i++) {
        aio_poller *q = &e->pollers[i];
        if (!q->nrails) continue; /* its rail failed to open, and no later one came */
        int ret = pthread_create(&q->thread, NULL, poller_main, q);
        if (ret) {
            aio__pollers_join(e);
            atomic_store(&e->stop, 0);
            return -ret;
        }
        q->running = 1;
        char name[16]; /* seen in top -H, perf and py-spy; set before this returns */
        snprintf(name, sizeof(name), "aiote-poll%d", q->index);
        pthread_setname_np(q->thread, name);
    }
    return 0;
}
