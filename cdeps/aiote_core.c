/* aiote C core: see aiote_core.h for the contract. */
#define _GNU_SOURCE
#include "aiote_core.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <time.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <net/if.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <sys/socket.h>
#ifndef IFF_LOWER_UP /* <linux/if.h>, which clashes with <net/if.h> */
#define IFF_LOWER_UP 0x10000
#endif
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#define OPK_WRITE 1
#define OPK_READ 2
#define OPK_SEND 3
#define OPK_RECV 4

#define CQ_BATCH 64
/* aio_poll_ring polls (yielding the CPU in between) this long, then sleeps on the rails' wait
 * objects and the eventfd in steps of at most LOOP_POLL_BLOCK_MAX_NS: on a busy machine a
 * thread that yields may wait out another process's whole time slice, one that sleeps is
 * woken at once */
#define LOOP_POLL_SPIN_NS 30000LL
/* the poller's adaptive spin (see poller_main): idle gaps of at most ADAPT_DENSE_NS, with a sleep
 * in one, double the spin window up to ADAPT_MAX_NS; an idle gap over ADAPT_SPARSE_NS resets it */
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
 * from 23 to 66 us with wake-ups alone; see "Owned shm
 * names and wake-ups"). Idle means idle after this. */
#define WAKE_IDLE_NS 200000000LL
/* a post waiting for room stops driving the rail itself after this long without a completion */
#define POST_IDLE_NS 20000LL
/* Requests handed to the poller (post_item_g): only to peers whose connection has carried a
 * request since its last failure (a flag per address, in chunks of DEFER_CHUNK allocated at a
 * peer's first post and kept until the rail closes: a lock-free read for the poller; addresses
 * past DEFER_PEERS, which libfabric's reuse of removed addresses keeps out of reach for bounded
 * peer sets, are posted in place); one that the provider still refuses (queue full,
 * reconnecting) after DEFER_STALL_NS fails as "timed out". */
#define DEFER_CHUNK 256
#define DEFER_PEERS 65536
#define DEFER_STALL_NS 1000000000LL
/* By default (hand mode 0) a tcp write of at least this many bytes is always handed to the
 * poller: its bytes go into the socket from the poller's thread, never from the posting one
 * (an event loop's). Smaller ones are posted in place when the rail is free, for latency. */
#define HAND_MIN_BYTES (16 * 1024)
#define LOOP_POLL_BLOCK_MAX_NS 1000000LL

typedef struct aio_op {
    struct fi_context2 ctx; /* first: FI_CONTEXT / FI_CONTEXT2 mode */
    int32_t kind;
    int32_t rail;
    int64_t group;
    aio_mr *mr;
    uint32_t slot;
    int32_t next_free;
    /* a direct same-host copy, queued for the poller (see direct_run) */
    struct aio_op *dnext;
    aio_op_desc d;
    int32_t dstatus; /* the copy's result, once made */
    int32_t dcopied;
    int32_t dpost; /* not a copy: a request the poller posts to the rail's provider (see post_item_g) */
    int32_t dmerged; /* a copied write whose immediate a later op of its run carries (direct_batch) */
    int64_t dsince; /* dpost: when the provider first refused it for room (0: not yet) */
    uint64_t peer;  /* a write's or read's peer (complete_op: a failure stops deferrals to it) */
} aio_op;

/* ------------------------------------------------------------------ direct copy table
 * (see aiote_core.h, "Direct same-host copies"). Shared by processes: fixed layout. */
#define DIRECT_MAGIC 0x414d43455449414fULL /* "OAITECMA" */
#define DIRECT_VERSION 2

typedef struct direct_slot {
    _Atomic uint64_t key;  /* 0: closed; else the key of the region's first shm registration */
    _Atomic uint64_t busy; /* bit p: attached engine p is copying into / out of the region */
    _Atomic uint64_t base;
    _Atomic uint64_t len;
    _Atomic uint32_t access; /* AIO_ACCESS_* */
    uint32_t pad;
} direct_slot;

typedef struct direct_table {
    uint64_t magic;
    uint32_t version;
    uint32_t nslots;
    uint64_t nonce;
    int32_t pid;
    _Atomic int32_t closed;
    _Atomic int32_t peers[AIO_DIRECT_PEERS]; /* pid of each attached engine's process, 0: free */
    /* the owner's arena (aio_engine_set_arena), 0 length: none. Set before any region is
     * published, so a peer that finds a region in it has seen these fields. */
    int32_t arena_fd;
    uint32_t arena_pad;
    uint64_t arena_base;
    uint64_t arena_len;
    uint64_t arena_dev;
    uint64_t arena_ino;
    direct_slot slots[AIO_DIRECT_SLOTS];
} direct_table;

typedef struct direct_peer { /* a peer's table this engine attached to */
    direct_table *t;
    int32_t pid;
    int pidfd;
    uint64_t nonce;
    int index;           /* our bit in its slots' busy words */
    _Atomic int dead;    /* its process exited */
    uint64_t checked;    /* poller 0's direct_run pass that last checked it is alive */
    char *amap;          /* its arena, mapped here (NULL: none), ... */
    uint64_t abase;      /* ... which is at abase in its process, */
    uint64_t alen;       /* alen bytes long */
} direct_peer;

/* Whether [raddr, raddr + len) of the peer's memory lies in its arena, mapped here. */
static int in_arena(const direct_peer *p, uint64_t raddr, uint64_t len) {
    return p->amap && raddr - p->abase < p->alen && len <= p->alen - (raddr - p->abase);
}

typedef struct aio_rail {
    pthread_mutex_t mu;
    pthread_mutex_t pool_mu;      /* the op pool only (op_get, op_put): innermost, held briefly */
    _Atomic int32_t ndeferred;    /* requests queued for the poller to post (post_item_g) */
    _Atomic(_Atomic uint8_t *) defer_ok[DEFER_PEERS / DEFER_CHUNK]; /* see defer_get */
    int index;
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_ep *ep;
    struct fid_av *av;
    struct fid_cq *cq;
    int wait_fd;
    int bytes_fd; /* the wait fd signals bytes arriving, before their completion (sockets) */
    uint64_t mr_mode;
    uint64_t mode;
    uint32_t cq_data_size;
    uint8_t addr[AIO_MAX_ADDR];
    size_t addr_len;
    /* op pool (under mu) */
    aio_op *ops;
    int32_t free_head;
    uint32_t nops;
    /* receive and send slots */
    uint32_t nslots;
    uint64_t slot_size;
    char *recv_buf;
    struct fid_mr *recv_mr;
    void *recv_desc;
    aio_op *recv_ops;
    char *send_buf;
    struct fid_mr *send_mr;
    void *send_desc;
    uint32_t *send_free;
    uint32_t send_nfree;
    uint64_t tx_op_flags; /* default transmit flags (fi_writemsg does not apply them) */
    int by_addr;          /* a tcp rail bound to an interface's address */
    int is_shm;           /* the shm provider: regions get a direct-copy slot */
    int is_tcp;           /* the tcp provider: its sockets' send buffers are set (tcp_tune) */
    /* shm wake-ups (see "Owned shm names and wake-ups"): ours, and our peers' (per fi_addr) */
    int wake_fd;                   /* our endpoint's fifo (read end), -1: none */
    _Atomic uint32_t *wake_word;   /* our endpoint's "the poller sleeps" word, shared */
    char shm_name[64];             /* our endpoint's name (its files' prefix in /dev/shm) */
    struct shm_wpeer *wpeers;      /* per fi_addr (< wcap): how to wake that peer */
    uint32_t wcap;
    uint8_t *tune_tries;  /* per fi_addr (< tune_cap): scans made for it, TUNE_TRIES when done */
    uint32_t tune_cap;
    size_t iov_limit;     /* local iovecs per RMA request */
    /* link state of the interface behind a tcp rail (ifindex 0: not watched) */
    int ifindex;
    _Atomic int link_up;
    int poller; /* the poller thread that drives it (aio_engine_add_rail: rail index % pollers) */
} aio_rail;

/* Whether a request to `peer` may be handed to the poller (see DEFER_PEERS): lock-free. */
static int defer_get(aio_rail *r, uint64_t peer) {
    if (peer >= DEFER_PEERS) return 0;
    _Atomic uint8_t *c = atomic_load(&r->defer_ok[peer / DEFER_CHUNK]);
    return c ? atomic_load(&c[peer % DEFER_CHUNK]) : 0;
}

/* Sets the flag; a chunk is allocated when set to 1 the first time (caller holds r->mu). */
static void defer_set(aio_rail *r, uint64_t peer, uint8_t on) {
    if (peer >= DEFER_PEERS) return;
    _Atomic uint8_t *c = atomic_load(&r->defer_ok[peer / DEFER_CHUNK]);
    if (!c) {
        if (!on || !(c = calloc(DEFER_CHUNK, 1))) return;
        atomic_store(&r->defer_ok[peer / DEFER_CHUNK], c);
    }
    atomic_store(&c[peer % DEFER_CHUNK], on);
}


struct aio_mr {
    void *buf;
    uint64_t len;
    uint32_t access;
    int nrails;
    struct fid_mr *mr[AIO_MAX_RAILS];
    void *desc[AIO_MAX_RAILS];
    uint64_t key[AIO_MAX_RAILS];
    uint64_t base[AIO_MAX_RAILS];
    _Atomic int64_t inflight;
    int32_t direct_slot; /* -1: none */
    aio_mr *prev, *next;
};

typedef struct aio_group {
    uint64_t token;
    _Atomic int64_t posted;
    _Atomic int64_t done;
    /* posted - done, plus 1 until sealed: whoever brings it to 0 finishes the group
     * (one atomic decides, so no stale read of a slot already reused can finish it) */
    _Atomic int64_t outstanding;
    _Atomic int32_t status;
    _Atomic int32_t prov_errno;
    _Atomic int32_t sealed;
    _Atomic int32_t finished;
    int32_t quiet; /* set before anything is posted: the completion record does not signal */
    int32_t next_free;
    int32_t in_use;
} aio_group;

typedef struct cslot {
    uint32_t imm;
    uint32_t used;
    uint64_t avail;
    uint64_t total;
    uint64_t want;
} cslot;

typedef struct watch_slot {
    const volatile uint64_t *word; /* NULL: free */
    uint64_t last;
    uint64_t token;
} watch_slot;

typedef struct overflow_node {
    aio_record rec;
    struct overflow_node *next;
    int reserve; /* from the engine's reserve block (ovf_block): goes back there, not to free() */
} overflow_node;

/* Records are never dropped for want of memory (ring_put). When the ring is full they queue
 * behind it on the overflow list, in nodes from malloc; when malloc fails:
 *   - a poller thread keeps the record in its own stash (RING_STASH records, allocated with the
 *     poller) and stops producing: while its stash is not empty it neither reads its rails'
 *     CQs nor makes copies, holding no lock, and moves the stash into the ring as the loop
 *     drains it (backpressure: completions wait in the provider, nothing is lost);
 *   - any other thread (the loop's posts, aio_want_space, aio_counter_add: a few records per
 *     call, and it may be the very thread that drains the ring, so it must not wait) takes a
 *     node from the engine's reserve (RING_RESERVE nodes, allocated with the engine), which
 *     the drain gives back.
 * While the ring is full, threads other than pollers read no completions (progress_locked):
 * their own records are a few per call. Only such a thread producing more than RING_RESERVE
 * records while the ring is full and malloc fails would lose one; it is counted (st_lost) and
 * logged to stderr. */
#define RING_RESERVE 1024
#define RING_STASH 1024
#ifdef AIO_TEST_HOOKS
_Atomic int aio_test_ovf_malloc_fail; /* tests: the overflow list's malloc fails */
#endif

/* One poller thread and what it drives: its rails (rail i goes to poller i % npollers), the
 * queue of requests handed to it for those rails, and its sleep (an epoll set of its rails' wait
 * fds and its kick eventfd). Poller 0 also makes every direct copy (its queue holds them) and
 * reads the watched words and the link monitor. */
typedef struct aio_poller {
    struct aio_engine *e;
    int index;
    pthread_t thread;
    int running; /* its thread was started (a poller whose rail failed to open has none) */
    int epfd;
    int kick_fd;
    _Atomic int sleeping;
    _Atomic uint64_t post_seq;  /* bumped by every kick: posts to its rails, new watches */
    _Atomic int64_t inflight;   /* our ops in flight on its rails */
    int nrails;
    aio_rail *rails[AIO_MAX_RAILS];
    pthread_mutex_t qmu;        /* the queue below */
    aio_op *dq_head, *dq_tail;  /* handed-over requests (and, on poller 0, direct copies), in order */
    _Atomic int32_t dq_pending;
    uint64_t drun;              /* direct_run passes (poller 0's tell direct_copy its pass) */
    aio_record *stash;          /* records the ring could not take (see RING_STASH); poller only */
    int nstash;
} aio_poller;

struct aio_engine {
    aio_engine_config cfg;
    int nrails;
    aio_rail *rails[AIO_MAX_RAILS];

    /* ring: producers serialized by ring_mu, one consumer (the loop) */
    pthread_mutex_t ring_mu;
    aio_record *ring;
    uint32_t ring_mask;
    _Atomic uint64_t ring_head;
    _Atomic uint64_t ring_tail;
    overflow_node *ovf_head, *ovf_tail;
    _Atomic uint64_t ovf_count;
    overflow_node *ovf_block, *ovf_free; /* the reserve (RING_RESERVE nodes) and its free list */
    _Atomic uint64_t st_lost;
    _Atomic int armed;
    int efd;

    /* groups */
    pthread_mutex_t groups_mu;
    aio_group *groups;
    int32_t groups_free;

    /* counters */
    pthread_mutex_t cnt_mu;
    cslot *cslots;
    uint32_t ccap;
    uint32_t cused;

    /* regions */
    pthread_mutex_t mr_mu;
    aio_mr *mrs;

    /* pollers */
    int npollers_want;   /* aio_engine_set_pollers (default 1) */
    int npollers;        /* opened (add_rail): min(npollers_want, rails added so far) */
    aio_poller pollers[AIO_MAX_RAILS];
    int started;
    _Atomic int stop;
    int nl_fd;           /* netlink socket for link changes, or -1 */
    int64_t nl_checked;  /* last time the poller drained it while spinning */
    _Atomic int64_t ops_in_flight;
    _Atomic int64_t want_below; /* a poster waits for queue space: report when in flight <= it (-1: none) */
    _Atomic int32_t nwant;      /* counters with an armed watch (a task awaits an immediate) */
    _Atomic int32_t quiet_waiters; /* tasks awaiting a quiet group's record (aio_quiet_waiters) */
    /* low-latency waits (aio_poll_ring) made by the loop thread */
    _Atomic uint64_t st_loop_polls;

    /* watched words */
    pthread_mutex_t watch_mu;
    watch_slot *watches;     /* AIO_MAX_WATCHES, allocated on first use */
    int32_t watch_hi;        /* slots [0, watch_hi) may be in use */
    _Atomic int32_t nwatch;

    /* direct same-host copies: this engine's table (as a target), under mr_mu */
    direct_table *dtab;
    int dfd;
    uint8_t *dused; /* AIO_DIRECT_SLOTS: the slot belongs to a region */
    uint32_t dhint;
    /* ... and the peers' tables it copies into (as an initiator), under dmu */
    pthread_mutex_t dmu;
    direct_peer *dpeers; /* AIO_DIRECT_ATTACH, allocated on the first attach */
    _Atomic int32_t ndpeers;
    _Atomic uint64_t st_direct;
    _Atomic uint64_t st_mapped;
    int afd; /* the arena's memfd (aio_engine_set_arena), -1: none */

    /* tcp send buffers (aio_engine_set_tcp_sndbuf) */
    int32_t sndbuf;
    int sndbuf_all;
    _Atomic int sndbuf_got; /* SO_SNDBUF as the kernel reported it after the last setting */
    _Atomic uint64_t st_tuned;
    _Atomic uint64_t st_handed;  /* requests handed to the poller to post (post_item_g) */
    _Atomic uint64_t st_handed_waited; /* ... of which the provider refused for room at first */
    _Atomic int32_t hand_posts;  /* aio_engine_set_hand_posts */

    /* stats */
    _Atomic uint64_t st_polls, st_sleeps, st_wakeups, st_completions, st_remote, st_errors;
    _Atomic int64_t st_adapt; /* the poller's adaptive spin window (0: the base) */
};

/* ------------------------------------------------------------------ utils */

static void set_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int iface_up(int ifindex);
static int progress_locked(aio_engine *e, struct aio_rail *r);
static int poll_watches(aio_engine *e);
static void set_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || errlen == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

const char *aio_strerror(int code) {
    if (code < 0) code = -code;
    return fi_strerror(code);
}

uint32_t aio_fabric_version(void) { return fi_version(); }

/* ------------------------------------------------------------------ ring */

/* the poller this thread is (poller_main sets it): ring_put's stash */
static __thread struct aio_poller *tl_poller;

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
static int stash_flush(aio_poller *q) {
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

static void ring_put(aio_engine *e, const aio_record *r, int quiet) {
    aio_poller *q = tl_poller && tl_poller->e == e && tl_poller->stash ? tl_poller : NULL;
    int placed = 0;
    pthread_mutex_lock(&e->ring_mu);
    if (!q || q->nstash == 0) placed = ring_place_locked(e, r, q && q->nstash < RING_STASH);
    if (!placed && q && q->nstash >= RING_STASH) placed = ring_place_locked(e, r, 0);
    pthread_mutex_unlock(&e->ring_mu);
    if (!placed) { /* behind the stash, in order; the poller stops producing (poller_main) */
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
    ring_signal(e);
}

static void ring_push(aio_engine *e, const aio_record *r) { ring_put(e, r, 0); }

int aio_drain(aio_engine *e, aio_record *out, int max) {
    int n = 0;
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

/* ------------------------------------------------------------------ groups */

int64_t aio_group_open(aio_engine *e, uint64_t token) {
    pthread_mutex_lock(&e->groups_mu);
    int32_t g = e->groups_free;
    if (g >= 0) {
        aio_group *gr = &e->groups[g];
        e->groups_free = gr->next_free;
        gr->in_use = 1;
        gr->token = token;
        atomic_store(&gr->posted, 0);
        atomic_store(&gr->done, 0);
        atomic_store(&gr->outstanding, 1);
        atomic_store(&gr->status, 0);
        atomic_store(&gr->prov_errno, 0);
        atomic_store(&gr->sealed, 0);
        atomic_store(&gr->finished, 0);
        gr->quiet = 0;
    }
    pthread_mutex_unlock(&e->groups_mu);
    return g >= 0 ? (int64_t)g : -FI_EAGAIN;
}

static void group_finish(aio_engine *e, int64_t g) {
    aio_group *gr = &e->groups[g];
    int expect = 0;
    if (!atomic_compare_exchange_strong(&gr->finished, &expect, 1)) return;
    aio_record r = {0};
    r.kind = AIO_REC_GROUP;
    r.token = gr->token;
    r.status = atomic_load(&gr->status);
    r.prov_errno = atomic_load(&gr->prov_errno);
    r.a = (uint64_t)atomic_load(&gr->done);
    r.rail = -1;
    pthread_mutex_lock(&e->groups_mu);
    gr->in_use = 0;
    gr->next_free = e->groups_free;
    e->groups_free = (int32_t)g;
    int quiet = gr->quiet;
    pthread_mutex_unlock(&e->groups_mu);
    ring_put(e, &r, quiet);
}

static void group_op_done(aio_engine *e, int64_t g, int status, int prov_errno) {
    if (g < 0) return;
    aio_group *gr = &e->groups[g];
    if (status) {
        int32_t z = 0;
        if (atomic_compare_exchange_strong(&gr->status, &z, status))
            atomic_store(&gr->prov_errno, prov_errno);
    }
    atomic_fetch_add(&gr->done, 1);
    if (atomic_fetch_sub(&gr->outstanding, 1) == 1) group_finish(e, g);
}

int aio_group_seal(aio_engine *e, int64_t g) {
    if (g < 0 || (uint32_t)g >= e->cfg.max_groups || !e->groups[g].in_use) return -FI_EINVAL;
    aio_group *gr = &e->groups[g];
    int32_t unsealed = 0;
    if (!atomic_compare_exchange_strong(&gr->sealed, &unsealed, 1)) return -FI_EINVAL;
    if (atomic_fetch_sub(&gr->outstanding, 1) == 1) group_finish(e, g);
    return 0;
}

int64_t aio_group_pending(aio_engine *e, int64_t g) {
    if (g < 0 || (uint32_t)g >= e->cfg.max_groups) return -FI_EINVAL;
    return atomic_load(&e->groups[g].posted) - atomic_load(&e->groups[g].done);
}

int64_t aio_ops_in_flight(aio_engine *e) { return atomic_load(&e->ops_in_flight); }

/* ------------------------------------------------------------------ counters */

static inline uint32_t hash32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

static cslot *counter_find(aio_engine *e, uint32_t imm, int create) {
    uint32_t mask = e->ccap - 1;
    uint32_t i = hash32(imm) & mask;
    for (;;) {
        cslot *s = &e->cslots[i];
        if (!s->used) break;
        if (s->imm == imm) return s;
        i = (i + 1) & mask;
    }
    if (!create) return NULL;
    if ((e->cused + 1) * 2 > e->ccap) {
        uint32_t ncap = e->ccap * 2;
        cslot *ns = calloc(ncap, sizeof(cslot));
        if (!ns) return NULL;
        for (uint32_t k = 0; k < e->ccap; k++) {
            if (!e->cslots[k].used) continue;
            uint32_t j = hash32(e->cslots[k].imm) & (ncap - 1);
            while (ns[j].used) j = (j + 1) & (ncap - 1);
            ns[j] = e->cslots[k];
        }
        free(e->cslots);
        e->cslots = ns;
        e->ccap = ncap;
        mask = ncap - 1;
    }
    uint32_t i2 = hash32(imm) & mask;
    while (e->cslots[i2].used) i2 = (i2 + 1) & mask;
    cslot *s = &e->cslots[i2];
    memset(s, 0, sizeof(*s));
    s->used = 1;
    s->imm = imm;
    e->cused++;
    return s;
}

/* Adds credits (a refund does not count towards the total received) and fires the
 * armed watch once it is satisfied. */
static void counter_credit(aio_engine *e, uint32_t imm, uint64_t units, int received) {
    int fire = 0;
    pthread_mutex_lock(&e->cnt_mu);
    cslot *s = counter_find(e, imm, 1);
    if (s) {
        s->avail += units;
        if (received) s->total += units;
        if (s->want && s->avail >= s->want) {
            s->want = 0;
            atomic_fetch_sub(&e->nwant, 1);
            fire = 1;
        }
    }
    pthread_mutex_unlock(&e->cnt_mu);
    if (fire) {
        aio_record r = {0};
        r.kind = AIO_REC_COUNTER;
        r.token = imm;
        r.rail = -1;
        ring_push(e, &r);
    }
}

void aio_counter_add(aio_engine *e, uint32_t imm, uint64_t units) { counter_credit(e, imm, units, 1); }

int aio_counter_take(aio_engine *e, uint32_t imm, uint64_t units) {
    int ok = 0;
    pthread_mutex_lock(&e->cnt_mu);
    cslot *s = counter_find(e, imm, 0);
    if (units == 0) ok = 1;
    else if (s && s->avail >= units) {
        s->avail -= units;
        ok = 1;
    }
    pthread_mutex_unlock(&e->cnt_mu);
    return ok;
}

int aio_counter_release(aio_engine *e, uint32_t imm) {
    pthread_mutex_lock(&e->cnt_mu);
    cslot *s = counter_find(e, imm, 0);
    if (!s) {
        pthread_mutex_unlock(&e->cnt_mu);
        return 0;
    }
    if (s->want) {
        pthread_mutex_unlock(&e->cnt_mu);
        return -FI_EBUSY;
    }
    /* linear probing: delete by shifting later entries of the cluster back */
    uint32_t mask = e->ccap - 1;
    uint32_t i = (uint32_t)(s - e->cslots);
    uint32_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!e->cslots[j].used) break;
        uint32_t home = hash32(e->cslots[j].imm) & mask;
        /* entry j may move to i if its home is not cyclically in (i, j] */
        int in_range = (i <= j) ? (home > i && home <= j) : (home > i || home <= j);
        if (!in_range) {
            e->cslots[i] = e->cslots[j];
            i = j;
        }
    }
    memset(&e->cslots[i], 0, sizeof(cslot));
    e->cused--;
    pthread_mutex_unlock(&e->cnt_mu);
    return 1;
}

int aio_counter_watch(aio_engine *e, uint32_t imm, uint64_t units) {
    int ready = 0;
    pthread_mutex_lock(&e->cnt_mu);
    cslot *s = counter_find(e, imm, 1);
    if (!s) ready = -FI_ENOMEM;
    else if (s->avail >= units) {
        if (s->want) atomic_fetch_sub(&e->nwant, 1);
        s->want = 0;
        ready = 1;
    } else {
        if (!s->want) atomic_fetch_add(&e->nwant, 1);
        s->want = units;
    }
    pthread_mutex_unlock(&e->cnt_mu);
    return ready;
}

static void kick(aio_engine *e);

void aio_waiters_add(aio_engine *e, int32_t delta) {
    if (atomic_fetch_add(&e->nwant, delta) + delta > 0) kick(e); /* a sleeping poller: shorter steps now */
}

void aio_counter_refund(aio_engine *e, uint32_t imm, uint64_t units) {
    counter_credit(e, imm, units, 0);
}

uint64_t aio_counter_available(aio_engine *e, uint32_t imm) {
    pthread_mutex_lock(&e->cnt_mu);
    cslot *s = counter_find(e, imm, 0);
    uint64_t v = s ? s->avail : 0;
    pthread_mutex_unlock(&e->cnt_mu);
    return v;
}

uint64_t aio_counter_total(aio_engine *e, uint32_t imm) {
    pthread_mutex_lock(&e->cnt_mu);
    cslot *s = counter_find(e, imm, 0);
    uint64_t v = s ? s->total : 0;
    pthread_mutex_unlock(&e->cnt_mu);
    return v;
}

/* ------------------------------------------------------------------ ops */

static aio_op *op_get(aio_rail *r) {
    pthread_mutex_lock(&r->pool_mu);
    aio_op *op = NULL;
    if (r->free_head >= 0) {
        op = &r->ops[r->free_head];
        r->free_head = op->next_free;
    }
    pthread_mutex_unlock(&r->pool_mu);
    return op;
}

static void op_put(aio_rail *r, aio_op *op) {
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
static int post_recv_locked(aio_rail *r, uint32_t slot) {
    aio_op *op = &r->recv_ops[slot];
    int ret = -FI_EAGAIN;
    for (int attempt = 0; attempt < 1000 && ret == -FI_EAGAIN; attempt++)
        ret = (int)fi_recv(r->ep, r->recv_buf + (uint64_t)slot * r->slot_size, r->slot_size,
                           r->recv_desc, FI_ADDR_UNSPEC, &op->ctx);
    return ret;
}

/* Counts d ops in flight on rail r: in the engine, and for the rail's poller (its spin). */
static inline void inflight_add(aio_engine *e, aio_rail *r, int64_t d) {
    atomic_fetch_add(&e->ops_in_flight, d);
    atomic_fetch_add(&e->pollers[r->poller].inflight, d);
}

/* Completes our own op (write/read/send). Caller holds r->mu. */
static void complete_op(aio_engine *e, aio_rail *r, aio_op *op, int status, int prov_errno) {
    if (op->mr) atomic_fetch_sub(&op->mr->inflight, 1);
    if (op->kind == OPK_SEND) r->send_free[r->send_nfree++] = op->slot;
    else if (status) defer_set(r, op->peer, 0);
    int64_t g = op->group;
    op_put(r, op);
    inflight_add(e, r, -1);
    group_op_done(e, g, status, prov_errno);
    int64_t w = atomic_load_explicit(&e->want_below, memory_order_relaxed);
    if (w >= 0 && atomic_load(&e->ops_in_flight) <= w &&
        atomic_compare_exchange_strong(&e->want_below, &w, -1)) {
        aio_record rec = {.kind = AIO_REC_SPACE};
        ring_push(e, &rec);
    }
}

void aio_want_space(aio_engine *e, int64_t below) {
    atomic_store(&e->want_below, below < 0 ? 0 : below);
    /* everything may have completed meanwhile: nobody would report it */
    int64_t w = atomic_load(&e->want_below);
    if (w >= 0 && atomic_load(&e->ops_in_flight) <= w && atomic_compare_exchange_strong(&e->want_below, &w, -1)) {
        aio_record rec = {.kind = AIO_REC_SPACE};
        ring_push(e, &rec);
    }
}

/* fi_trywait on a rail's CQ, under the rail's lock: FI_SUCCESS when its wait fd may be
 * slept on (nothing pending in the provider), else what the provider said */
static int rail_trywait(aio_rail *r) {
    struct fid *f = &r->cq->fid;
    pthread_mutex_lock(&r->mu);
    int tw = fi_trywait(r->fabric, &f, 1);
    pthread_mutex_unlock(&r->mu);
    return tw;
}

/* The blocking half of aio_poll_ring: sleeps for at most `ns` on the rails' wait objects and
 * on the engine's eventfd, armed, so that a record the poller pushes meanwhile (it keeps
 * polling too) wakes it. 0 if some rail has no wait object or has work ready (fi_trywait
 * refused), or a record is already waiting: the caller polls again instead. */
static int loop_block(aio_engine *e, int64_t ns) {
    struct pollfd p[AIO_MAX_RAILS + 1];
    for (int i = 0; i < e->nrails; i++) {
        aio_rail *r = e->rails[i];
        if (r->wait_fd < 0) return 0;
        if (rail_trywait(r) != FI_SUCCESS) return 0;
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
            progress_locked(e, r);
            pthread_mutex_unlock(&r->mu);
        }
        poll_watches(e);
        if (ring_ready(e)) return 1;
        int64_t t = now_ns();
        if (t >= deadline) return 0;
        if (t - start < LOOP_POLL_SPIN_NS || !loop_block(e, deadline - t)) {
            /* the peer process or the kernel's network work may need this very core */
            sched_yield();
        }
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
static int progress_locked(aio_engine *e, aio_rail *r) {
    /* the ring is full: only pollers read completions (their records wait in their stash, see
     * RING_STASH); another thread leaves them in the provider rather than use up the reserve */
    if (!(tl_poller && tl_poller->e == e) &&
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
                if (is_recv_op(r, ctx)) post_recv_locked(r, ((aio_op *)ctx)->slot);
                continue;
            }
            if (fl & FI_REMOTE_WRITE || fl & FI_REMOTE_READ) continue;
            if (is_recv_op(r, ctx)) {
                aio_record rec = {0};
                rec.kind = AIO_REC_RECV;
                rec.rail = r->index;
                rec.a = ((aio_op *)ctx)->slot;
                rec.b = ent[i].len;
                ring_push(e, &rec);
                continue;
            }
            if (ctx) complete_op(e, r, (aio_op *)ctx, 0, 0);
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
                    ring_push(e, &rec);
                }
            } else if (err.op_context) {
                complete_op(e, r, (aio_op *)err.op_context, status, err.prov_errno);
            }
            return 1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ direct same-host copies */

static int pid_alive(int32_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

/* A free slot for a region (caller holds mr_mu), or -1 when the table is full. */
static int32_t direct_slot_get(aio_engine *e) {
    for (uint32_t k = 0; k < AIO_DIRECT_SLOTS; k++) {
        uint32_t i = (e->dhint + k) % AIO_DIRECT_SLOTS;
        if (!e->dused[i]) {
            e->dused[i] = 1;
            e->dhint = i + 1;
            return (int32_t)i;
        }
    }
    return -1;
}

/* Closes a slot to new copies and waits briefly for those under way: 0 when none is left,
 * -FI_EBUSY when an attached process that is alive still copies (the caller tries again later).
 * A mark whose engine detached or whose process died is cleared: it can copy no more. */
static int direct_retire(direct_table *t, int32_t idx, int64_t wait_ns) {
    direct_slot *s = &t->slots[idx];
    atomic_store(&s->key, 0); /* seq_cst, then busy is read: see direct_copy */
    int64_t until = now_ns() + wait_ns;
    for (;;) {
        uint64_t b = atomic_load(&s->busy);
        if (!b) return 0;
        if (now_ns() >= until) {
            for (int p = 0; p < AIO_DIRECT_PEERS; p++) {
                if (!(b & (1ULL << p))) continue;
                int32_t pid = atomic_load(&t->peers[p]);
                if (!pid_alive(pid)) atomic_fetch_and(&s->busy, ~(1ULL << p));
            }
            return atomic_load(&s->busy) ? -FI_EBUSY : 0;
        }
        sched_yield();
    }
}

int aio_engine_enable_direct(aio_engine *e, char *err, size_t errlen) {
    if (e->dtab) return 0;
    int shm = 0;
    for (int i = 0; i < e->nrails; i++) shm |= e->rails[i]->is_shm;
    if (!shm) {
        set_err(err, errlen, "direct same-host copies need an shm rail");
        return -FI_EINVAL;
    }
    int fd = memfd_create("aiote-direct", MFD_CLOEXEC);
    if (fd < 0) {
        set_err(err, errlen, "memfd_create: %s", strerror(errno));
        return -errno;
    }
    if (ftruncate(fd, sizeof(direct_table)) != 0) {
        int en = errno;
        close(fd);
        set_err(err, errlen, "ftruncate: %s", strerror(en));
        return -en;
    }
    void *p = mmap(NULL, sizeof(direct_table), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    uint8_t *used = calloc(AIO_DIRECT_SLOTS, 1);
    if (p == MAP_FAILED || !used) {
        int en = p == MAP_FAILED ? errno : ENOMEM;
        if (p != MAP_FAILED) munmap(p, sizeof(direct_table));
        free(used);
        close(fd);
        set_err(err, errlen, "mapping the direct-copy table: %s", strerror(en));
        return -en;
    }
    direct_table *t = p; /* zero-filled by ftruncate */
    t->magic = DIRECT_MAGIC;
    t->version = DIRECT_VERSION;
    t->nslots = AIO_DIRECT_SLOTS;
    t->pid = (int32_t)getpid();
    while (getrandom(&t->nonce, sizeof(t->nonce), 0) != sizeof(t->nonce)) {
    }
    pthread_mutex_lock(&e->mr_mu);
    e->dused = used;
    e->dfd = fd;
    e->dtab = t;
    pthread_mutex_unlock(&e->mr_mu);
    return 0;
}

int aio_direct_info_get(aio_engine *e, aio_direct_info *out) {
    if (!e->dtab) return -FI_ENODATA;
    out->pid = e->dtab->pid;
    out->fd = e->dfd;
    out->nonce = e->dtab->nonce;
    out->table = (uint64_t)(uintptr_t)e->dtab;
    return 0;
}

int32_t aio_mr_direct_slot(aio_mr *m) { return m->direct_slot; }

int aio_engine_set_arena(aio_engine *e, int fd, void *base, uint64_t len, char *err, size_t errlen) {
    struct stat st;
    if (!e->dtab) {
        set_err(err, errlen, "an arena needs the direct-copy table (aio_engine_enable_direct)");
        return -FI_EINVAL;
    }
    if (!base || len == 0 || (uintptr_t)base % 4096 || fd < 0 || fstat(fd, &st) != 0 ||
        !S_ISREG(st.st_mode) || (uint64_t)st.st_size < len) {
        set_err(err, errlen, "the arena must be a page-aligned mapping of a memfd at least len long");
        return -FI_EINVAL;
    }
    pthread_mutex_lock(&e->mr_mu);
    int used = e->afd >= 0;
    for (uint32_t i = 0; i < AIO_DIRECT_SLOTS && !used; i++) used = e->dused[i];
    int dup_fd = used ? -1 : fcntl(fd, F_DUPFD_CLOEXEC, 0);
    int en = errno;
    if (used || dup_fd < 0) {
        pthread_mutex_unlock(&e->mr_mu);
        if (used) set_err(err, errlen, "the arena is set before any region is registered, once");
        else set_err(err, errlen, "dup: %s", strerror(en));
        return used ? -FI_EBUSY : -en;
    }
    e->afd = dup_fd;
    direct_table *t = e->dtab;
    t->arena_fd = dup_fd;
    t->arena_base = (uint64_t)(uintptr_t)base;
    t->arena_dev = (uint64_t)st.st_dev;
    t->arena_ino = (uint64_t)st.st_ino;
    atomic_store((_Atomic uint64_t *)&t->arena_len, len); /* before any slot's key: see direct_publish */
    pthread_mutex_unlock(&e->mr_mu);
    return 0;
}

/* Publishes a new region in the table (caller holds mr_mu): its slot, or -1. */
static int32_t direct_publish(aio_engine *e, aio_mr *m) {
    int first = -1;
    for (int i = 0; i < m->nrails && first < 0; i++)
        if (e->rails[i]->is_shm) first = i;
    if (first < 0 || m->key[first] == 0) return -1;
    int32_t idx = direct_slot_get(e);
    if (idx < 0) return -1;
    direct_slot *s = &e->dtab->slots[idx];
    atomic_store_explicit(&s->base, (uint64_t)(uintptr_t)m->buf, memory_order_relaxed);
    atomic_store_explicit(&s->len, m->len, memory_order_relaxed);
    atomic_store_explicit(&s->access, m->access, memory_order_relaxed);
    atomic_store(&s->key, m->key[first]); /* publishes the fields above */
    return idx;
}

static void direct_unpublish(aio_engine *e, aio_mr *m) {
    pthread_mutex_lock(&e->mr_mu);
    e->dused[m->direct_slot] = 0;
    m->direct_slot = -1;
    pthread_mutex_unlock(&e->mr_mu);
}

int aio_direct_attach(aio_engine *e, const aio_direct_info *pi, char *err, size_t errlen) {
    pthread_mutex_lock(&e->dmu);
    int n = atomic_load(&e->ndpeers);
    for (int i = 0; i < n; i++) {
        direct_peer *p = &e->dpeers[i];
        if (p->t && p->pid == pi->pid && p->nonce == pi->nonce && !atomic_load(&p->dead)) {
            pthread_mutex_unlock(&e->dmu);
            return i;
        }
    }
    int slot = n; /* an entry freed by aio_direct_detach is reused first */
    for (int i = 0; i < n && slot == n; i++)
        if (e->dpeers && !e->dpeers[i].t) slot = i;
    int ret = 0;
    int fd = -1, pidfd = -1, index = -1;
    direct_table *t = MAP_FAILED;
    int32_t me = (int32_t)getpid();
    if (!e->dpeers && !(e->dpeers = calloc(AIO_DIRECT_ATTACH, sizeof(direct_peer)))) {
        ret = -FI_ENOMEM;
        goto out;
    }
    if (slot >= AIO_DIRECT_ATTACH) {
        set_err(err, errlen, "this engine is attached to %d peers' tables already", n);
        ret = -FI_ENOSPC;
        goto out;
    }
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)pi->pid, (int)pi->fd);
    fd = open(path, O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || (uint64_t)st.st_size < sizeof(direct_table)) {
        ret = fd < 0 ? -errno : -FI_EINVAL;
        set_err(err, errlen, "opening the peer's table %s: %s", path,
                fd < 0 ? strerror(errno) : "not a table");
        goto out;
    }
    t = mmap(NULL, sizeof(direct_table), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (t == MAP_FAILED) {
        ret = -errno;
        set_err(err, errlen, "mapping the peer's table: %s", strerror(errno));
        goto out;
    }
    if (t->magic != DIRECT_MAGIC || t->version != DIRECT_VERSION || t->nslots != AIO_DIRECT_SLOTS ||
        t->nonce != pi->nonce || t->pid != pi->pid || atomic_load(&t->closed)) {
        set_err(err, errlen, "%s is not the table the peer published (closed, or another process)",
                path);
        ret = -FI_EINVAL;
        goto out;
    }
    pidfd = (int)syscall(SYS_pidfd_open, (pid_t)pi->pid, 0);
    if (pidfd < 0) {
        ret = -errno;
        set_err(err, errlen, "pidfd_open(%d): %s", (int)pi->pid, strerror(errno));
        goto out;
    }
    for (int p = 0; p < AIO_DIRECT_PEERS && index < 0; p++) {
        int32_t cur = atomic_load(&t->peers[p]);
        if (cur != 0 && pid_alive(cur)) continue;
        if (!atomic_compare_exchange_strong(&t->peers[p], &cur, me)) continue;
        index = p;
        if (cur != 0) /* the marks of an engine whose process died are void */
            for (int k = 0; k < AIO_DIRECT_SLOTS; k++) atomic_fetch_and(&t->slots[k].busy, ~(1ULL << p));
    }
    if (index < 0) {
        set_err(err, errlen, "the peer's table has %d attached engines already", AIO_DIRECT_PEERS);
        ret = -FI_ENOSPC;
        goto out;
    }
    /* the probe: the table's nonce read through the peer's memory proves that this process may
     * copy from and into it (the same permission) and that the pid names the table's owner */
    uint64_t v = 0;
    struct iovec lio = {.iov_base = &v, .iov_len = sizeof(v)};
    struct iovec rio = {.iov_base = (void *)(uintptr_t)(pi->table + offsetof(direct_table, nonce)),
                        .iov_len = sizeof(v)};
    ssize_t k = process_vm_readv((pid_t)pi->pid, &lio, 1, &rio, 1, 0);
    if (k != (ssize_t)sizeof(v) || v != pi->nonce) {
        ret = k < 0 ? -errno : -FI_EINVAL;
        set_err(err, errlen, "a probe copy from process %d %s", (int)pi->pid,
                k < 0 ? strerror(errno) : "did not read its table");
        atomic_store(&t->peers[index], 0);
        goto out;
    }
    /* the peer's arena, if it has one: mapped here, after checking the file is the one it
     * published (its fd number names that file in its process, the device and inode say so) */
    char *amap = NULL;
    uint64_t alen = atomic_load((_Atomic uint64_t *)&t->arena_len);
    if (alen) {
        snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)pi->pid, (int)t->arena_fd);
        int afd = open(path, O_RDWR | O_CLOEXEC);
        struct stat ast;
        void *am = MAP_FAILED;
        if (afd >= 0 && fstat(afd, &ast) == 0 && (uint64_t)ast.st_dev == t->arena_dev &&
            (uint64_t)ast.st_ino == t->arena_ino && (uint64_t)ast.st_size >= alen)
            am = mmap(NULL, alen, PROT_READ | PROT_WRITE, MAP_SHARED, afd, 0);
        if (afd >= 0) close(afd);
        if (am == MAP_FAILED) {
            set_err(err, errlen, "mapping the peer's arena %s: %s", path,
                    afd < 0 ? strerror(errno) : "not the file it published");
            ret = -FI_EINVAL;
            atomic_store(&t->peers[index], 0);
            goto out;
        }
        amap = am;
    }
    direct_peer *p = &e->dpeers[slot];
    p->amap = amap;
    p->abase = t->arena_base;
    p->alen = alen;
    p->t = t;
    p->pid = pi->pid;
    p->pidfd = pidfd;
    p->nonce = pi->nonce;
    p->index = index;
    atomic_store(&p->dead, 0);
    p->checked = 0;
    close(fd);
    if (slot == n) atomic_store(&e->ndpeers, n + 1);
    pthread_mutex_unlock(&e->dmu);
    return slot;
out:
    if (fd >= 0) close(fd);
    if (pidfd >= 0) close(pidfd);
    if (t != MAP_FAILED) munmap(t, sizeof(direct_table));
    pthread_mutex_unlock(&e->dmu);
    return ret;
}

/* Lets go of a peer's table: our busy marks and our place in it, its mappings and its pidfd.
 * The entry is reused by a later attach. Caller's promise: nothing of ours to that peer is
 * queued or in flight, and no direct code naming it will be posted again. */
static void dpeer_release(direct_peer *p) {
    int32_t me = (int32_t)getpid();
    for (int k = 0; k < AIO_DIRECT_SLOTS; k++) atomic_fetch_and(&p->t->slots[k].busy, ~(1ULL << p->index));
    atomic_compare_exchange_strong(&p->t->peers[p->index], &me, 0);
    munmap(p->t, sizeof(direct_table));
    if (p->amap) munmap(p->amap, p->alen);
    close(p->pidfd);
    p->t = NULL, p->amap = NULL, p->pid = 0, p->pidfd = -1;
}

int aio_direct_detach(aio_engine *e, int attach) {
    pthread_mutex_lock(&e->dmu);
    int ret = -FI_EINVAL;
    if (attach >= 0 && attach < atomic_load(&e->ndpeers) && e->dpeers[attach].t) {
        dpeer_release(&e->dpeers[attach]);
        ret = 0;
    }
    pthread_mutex_unlock(&e->dmu);
    return ret;
}

static int peer_gone(direct_peer *p);

int aio_direct_gone(aio_engine *e, int attach) {
    pthread_mutex_lock(&e->dmu);
    int ret = -FI_EINVAL;
    if (attach >= 0 && attach < atomic_load(&e->ndpeers) && e->dpeers[attach].t)
        ret = peer_gone(&e->dpeers[attach]);
    pthread_mutex_unlock(&e->dmu);
    return ret;
}

int aio_direct_mark(aio_engine *e, int attach, int32_t slot, int on) {
    if (attach < 0 || attach >= atomic_load(&e->ndpeers) || slot < 0 || slot >= AIO_DIRECT_SLOTS ||
        !e->dpeers[attach].t)
        return -FI_EINVAL;
    direct_peer *p = &e->dpeers[attach];
    if (on) atomic_fetch_or(&p->t->slots[slot].busy, 1ULL << p->index);
    else atomic_fetch_and(&p->t->slots[slot].busy, ~(1ULL << p->index));
    return 0;
}

/* Whether an attached peer's process exited or closed its table (its pidfd is readable):
 * marks it dead for good. A poll of the pidfd, no wait. */
static int peer_gone(direct_peer *p) {
    if (atomic_load(&p->dead)) return 1;
    struct pollfd pf = {.fd = p->pidfd, .events = POLLIN};
    if (poll(&pf, 1, 0) > 0 || atomic_load(&p->t->closed)) {
        atomic_store(&p->dead, 1);
        return 1;
    }
    return 0;
}

/* Whether a slot refuses request d: closed (key 0), another key, a range past its region, or
 * no right for the direction. The key is read first (seq_cst), after the caller's busy mark
 * when it copies: see direct_copy. */
static int slot_refuses(direct_slot *s, const aio_op_desc *d) {
    uint64_t key = atomic_load(&s->key);
    uint64_t base = atomic_load_explicit(&s->base, memory_order_relaxed);
    uint64_t len = atomic_load_explicit(&s->len, memory_order_relaxed);
    uint32_t need = d->op == AIO_OP_READ ? AIO_ACCESS_REMOTE_READ : AIO_ACCESS_REMOTE_WRITE;
    return key == 0 || key != d->rkey || d->raddr < base || d->raddr - base > len ||
           d->length > len - (d->raddr - base) || !(atomic_load_explicit(&s->access, memory_order_relaxed) & need);
}

/* Makes one direct copy (poller 0's thread, the only one that copies: a peer's slot has one busy
 * bit per engine, set and cleared around each copy): 0, or a negative error for its op. */
static int direct_copy(aio_engine *e, const aio_op_desc *d, uint64_t run) {
    direct_peer *p = &e->dpeers[(d->direct >> 16) - 1];
    uint32_t idx = (uint32_t)d->direct & 0xffff;
    if (atomic_load(&p->dead)) return -FI_ECONNRESET;
    if (p->checked != run) { /* once per pass: has its process exited (pid reuse)? */
        p->checked = run;
        if (peer_gone(p)) return -FI_ECONNRESET;
    }
    direct_slot *s = &p->t->slots[idx];
    uint64_t bit = 1ULL << p->index;
    /* mark, then read the key (seq_cst both): the owner clears the key, then reads the marks,
     * so either it sees our mark and waits, or we see its cleared key and do not copy */
    atomic_fetch_or(&s->busy, bit);
    int rc = 0;
    if (slot_refuses(s, d)) {
        rc = -FI_EACCES;
    } else if (in_arena(p, d->raddr, d->length)) {
        /* in the peer's arena, mapped here: a plain copy, then a release fence so that whoever
         * learns of the completion (the immediate, a message) finds the bytes */
        char *there = p->amap + (d->raddr - p->abase);
        char *here = (char *)((aio_mr *)d->mr)->buf + d->offset;
        if (d->op == AIO_OP_READ) memcpy(here, there, d->length);
        else memcpy(there, here, d->length);
        atomic_thread_fence(memory_order_seq_cst);
        atomic_fetch_add_explicit(&e->st_mapped, 1, memory_order_relaxed);
    } else { /* outside the arena: the kernel copies between the two address spaces */
        aio_mr *m = d->mr;
        uint64_t done = 0;
        int rd = d->op == AIO_OP_READ;
        while (done < d->length) {
            struct iovec lio = {.iov_base = (char *)m->buf + d->offset + done, .iov_len = d->length - done};
            struct iovec rio = {.iov_base = (void *)(uintptr_t)(d->raddr + done), .iov_len = d->length - done};
            ssize_t k = rd ? process_vm_readv(p->pid, &lio, 1, &rio, 1, 0)
                           : process_vm_writev(p->pid, &lio, 1, &rio, 1, 0);
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) {
                rc = k == 0 ? -FI_EFAULT : errno == ESRCH ? -FI_ECONNRESET : -errno;
                break;
            }
            done += (uint64_t)k;
        }
    }
    atomic_fetch_and(&s->busy, ~bit);
    return rc;
}

/* The checks of a direct copy, made in place for a request that moves no bytes itself (a bare
 * immediate to a same-host peer): the peer's process alive, the slot's key, bounds and right.
 * 0, -FI_EINVAL (bad code), -FI_ECONNRESET (the peer died) or -FI_EACCES. No busy mark: nothing
 * of the region is touched. */
static int direct_check(aio_engine *e, const aio_op_desc *d) {
    direct_peer *p = &e->dpeers[(d->direct >> 16) - 1];
    if (peer_gone(p)) return -FI_ECONNRESET;
    if (slot_refuses(&p->t->slots[d->direct & 0xffff], d)) return -FI_EACCES;
    return 0;
}

/* Direct copies in runs (poller 0, before direct_run posts anything). A paged write to a
 * same-host peer queues one op per page; copied one by one, each page costs a system call
 * and, with an immediate, a zero-byte shm message. So consecutive queued copies into one
 * region of one peer (same attachment and slot, same direction, outside an arena) are made
 * by one process_vm_writev / readv of up to DIRECT_IOV pieces, after the same slot checks
 * as direct_copy (busy mark, key of every op, bounds of every op, right); a short copy
 * falls back to direct_copy for each op. Then, within a run of copied writes to one peer on
 * one rail carrying the same immediate, only the last posts it, with the run's weights
 * added up (as a gathered paged request does); the others are marked dmerged and complete
 * at once, whatever their connection's queue (they post nothing). An op merged once is
 * never counted into another run, though it waits a pass; a carrier kept for room keeps its
 * weight. The immediate still follows every byte of its run. */
#define DIRECT_IOV 512

static int direct_same_run(const aio_op *a, const aio_op *b) {
    return b && !b->dcopied && !b->dpost && b->d.direct == a->d.direct && b->d.op == a->d.op;
}

static void direct_batch(aio_engine *e, aio_op *list, uint64_t run) {
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
        if (k < 2) { /* a single copy (or an arena's memcpy): direct_run makes it */
            op = k ? end : op->dnext;
            continue;
        }
        int ok = !atomic_load(&p->dead);
        direct_slot *s = &p->t->slots[op->d.direct & 0xffff];
        uint64_t bit = 1ULL << p->index;
        if (ok) { /* the checks of direct_copy, once for the slot and for each op's range */
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
                o->dstatus = direct_copy(e, &o->d, run);
                o->dcopied = 1;
                if (!o->dstatus) atomic_fetch_add_explicit(&e->st_direct, 1, memory_order_relaxed);
            }
        }
        op = end;
    }
    /* immediates: a run of copied writes to one peer with one immediate posts it once */
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

/* Queues a direct copy (`post` 0) for poller 0, which makes every direct copy (see
 * direct_copy), or a request for the poller of the op's rail to post to the rail's provider
 * (`post` 1, see post_item_g). The caller kicks that poller. */
static void direct_enqueue(aio_engine *e, aio_op *op, const aio_op_desc *it, int post) {
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

static ssize_t post_one(aio_rail *r, const aio_op_desc *it, aio_op *op);
static void posted_to(aio_engine *e, aio_rail *r, uint64_t peer);
static void shm_wake(aio_rail *r, uint64_t fa);
static void shm_own_release(aio_rail *r);

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
 * direct_run: the queue's later requests to it wait behind that one. */
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

/* The poller's part: makes the queued copies in order; a write carrying an immediate then
 * posts it as a zero-byte write on the op's rail, whose completion completes the op. Posts the
 * queued requests (dpost) to their rails' providers. A request the provider refuses for room
 * stays queued, and so do the later ones to the same connection (rail and peer), in order;
 * requests to other peers and other rails, and copies, go on past it (one slow or stopped
 * peer does not hold up the rest). Returns how many ops it handled, plus one while ops wait
 * for room (the poller polls on at once: room comes as the rails' requests complete). */
static int direct_run(aio_poller *q) {
    aio_engine *e = q->e;
    if (!atomic_load_explicit(&q->dq_pending, memory_order_acquire)) return 0;
    pthread_mutex_lock(&q->qmu);
    aio_op *list = q->dq_head;
    q->dq_head = q->dq_tail = NULL;
    atomic_store(&q->dq_pending, 0);
    pthread_mutex_unlock(&q->qmu);
    uint64_t run = ++q->drun;
    if (q->index == 0) direct_batch(e, list, run);
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
            op->dstatus = direct_copy(e, &op->d, run);
            op->dcopied = 1;
            if (!op->dstatus) atomic_fetch_add_explicit(&e->st_direct, 1, memory_order_relaxed);
        }
        aio_rail *r = e->rails[op->rail];
        pthread_mutex_lock(&r->mu);
        if (op->dmerged) { /* copied; a later op of its run carries its immediate */
            list = op->dnext;
            complete_op(e, r, op, 0, 0);
        } else if (op->dpost || (!op->dstatus && (d->flags & AIO_F_DATA))) {
            aio_mr *m = d->mr;
            ssize_t ret = op->dpost ? post_one(r, d, op)
                                    : fi_writedata(r->ep, (char *)m->buf + d->offset, 0, m->desc[op->rail],
                                                   d->data, d->peer, d->raddr, d->rkey, &op->ctx);
            if (!op->dpost && r->is_shm) shm_wake(r, d->peer);
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
            if (ret == -FI_EAGAIN) { /* this and its connection's later ops wait, in order, for room */
                progress_locked(e, r);
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
                if (!ret) posted_to(e, r, d->peer);
            }
            if (ret) complete_op(e, r, op, (int)ret, 0);
        } else {
            list = op->dnext;
            complete_op(e, r, op, op->dstatus, op->dstatus ? -op->dstatus : 0);
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

static void direct_destroy(aio_engine *e) {
    for (int i = 0; i < atomic_load(&e->ndpeers); i++)
        if (e->dpeers[i].t) dpeer_release(&e->dpeers[i]);
    free(e->dpeers);
    if (e->dtab) { /* closed since aio_engine_destroy began */
        munmap(e->dtab, sizeof(direct_table));
        close(e->dfd);
        free(e->dused);
    }
    if (e->afd >= 0) close(e->afd);
}

/* ------------------------------------------------------------------ engine */

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
static void kick_rails(aio_engine *e, uint32_t mask) {
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
static void kick(aio_engine *e) {
    for (int i = 0; i < e->npollers; i++) kick_poller(&e->pollers[i]);
}

/* Kicks poller 0, which reads the watched words. */
static void kick_watcher(aio_engine *e) {
    if (e->npollers) kick_poller(&e->pollers[0]);
}

/* ------------------------------------------------------------------ watched words */

uint64_t aio_word_load(const volatile uint64_t *word) {
    return __atomic_load_n((const uint64_t *)word, __ATOMIC_ACQUIRE);
}

void aio_word_store(aio_engine *e, volatile uint64_t *word, uint64_t value) {
    __atomic_store_n((uint64_t *)word, value, __ATOMIC_RELEASE);
    kick_watcher(e);
}

int aio_watch_add(aio_engine *e, const volatile uint64_t *word, uint64_t last, uint64_t token) {
    if (!word || ((uintptr_t)word & 7)) return -FI_EINVAL;
    pthread_mutex_lock(&e->watch_mu);
    if (!e->watches) {
        e->watches = calloc(AIO_MAX_WATCHES, sizeof(watch_slot));
        if (!e->watches) {
            pthread_mutex_unlock(&e->watch_mu);
            return -FI_ENOMEM;
        }
    }
    int id = -1;
    for (int i = 0; i < AIO_MAX_WATCHES; i++)
        if (!e->watches[i].word) {
            id = i;
            break;
        }
    if (id < 0) {
        pthread_mutex_unlock(&e->watch_mu);
        return -FI_ENOSPC;
    }
    e->watches[id].word = word;
    e->watches[id].last = last;
    e->watches[id].token = token;
    if (id >= e->watch_hi) e->watch_hi = id + 1;
    atomic_fetch_add(&e->nwatch, 1);
    pthread_mutex_unlock(&e->watch_mu);
    kick_watcher(e); /* a sleeping poller must start reading it */
    return id;
}

int aio_watch_remove(aio_engine *e, int id) {
    if (id < 0 || id >= AIO_MAX_WATCHES) return -FI_EINVAL;
    pthread_mutex_lock(&e->watch_mu);
    if (!e->watches || !e->watches[id].word) {
        pthread_mutex_unlock(&e->watch_mu);
        return -FI_EINVAL;
    }
    e->watches[id].word = NULL;
    while (e->watch_hi > 0 && !e->watches[e->watch_hi - 1].word) e->watch_hi--;
    atomic_fetch_sub(&e->nwatch, 1);
    pthread_mutex_unlock(&e->watch_mu);
    return 0;
}

/* Reads every watched word; one record per change. Returns the number of changes. */
static int poll_watches(aio_engine *e) {
    if (atomic_load_explicit(&e->nwatch, memory_order_relaxed) == 0) return 0;
    int got = 0;
    pthread_mutex_lock(&e->watch_mu);
    for (int i = 0; i < e->watch_hi; i++) {
        watch_slot *w = &e->watches[i];
        if (!w->word) continue;
        uint64_t v = __atomic_load_n((const uint64_t *)w->word, __ATOMIC_ACQUIRE);
        if (v == w->last) continue;
        w->last = v;
        aio_record rec = {.kind = AIO_REC_WATCH, .token = w->token, .a = v};
        ring_push(e, &rec);
        got++;
    }
    pthread_mutex_unlock(&e->watch_mu);
    return got;
}

/* ------------------------------------------------------------------ link monitor */

static int iface_up(int ifindex) {
    char name[IF_NAMESIZE];
    if (!if_indextoname((unsigned)ifindex, name)) return 0;
    char path[96];
    snprintf(path, sizeof(path), "/sys/class/net/%s/carrier", name);
    FILE *f = fopen(path, "r");
    if (!f) return 1; /* no carrier file (unusual): assume up */
    int c = fgetc(f);
    fclose(f);
    return c == '1';
}

static void link_changed(aio_engine *e, int ifindex, int up) {
    for (int i = 0; i < e->nrails; i++) {
        aio_rail *r = e->rails[i];
        if (r->ifindex != ifindex) continue;
        if (atomic_exchange(&r->link_up, up) == up) continue;
        aio_record rec = {.kind = AIO_REC_LINK, .rail = i, .a = (uint64_t)up};
        ring_push(e, &rec);
    }
}

/* Reads every pending netlink message (non-blocking) and reports link changes. */
static void drain_netlink(aio_engine *e) {
    char buf[8192] __attribute__((aligned(__alignof__(struct nlmsghdr))));
    for (;;) {
        ssize_t n = recv(e->nl_fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n <= 0) {
            if (n < 0 && errno == ENOBUFS) { /* lost messages: re-read every watched link */
                for (int i = 0; i < e->nrails; i++)
                    if (e->rails[i]->ifindex)
                        link_changed(e, e->rails[i]->ifindex, iface_up(e->rails[i]->ifindex));
                continue;
            }
            return;
        }
        for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (unsigned)n);
             h = NLMSG_NEXT(h, n)) {
            if (h->nlmsg_type != RTM_NEWLINK && h->nlmsg_type != RTM_DELLINK) continue;
            struct ifinfomsg *ifi = NLMSG_DATA(h);
            int up = h->nlmsg_type == RTM_NEWLINK && (ifi->ifi_flags & IFF_UP) &&
                     (ifi->ifi_flags & IFF_LOWER_UP);
            link_changed(e, ifi->ifi_index, up);
        }
    }
}

static void open_netlink(aio_engine *e) {
    e->nl_fd = -1;
    int any = 0;
    for (int i = 0; i < e->nrails; i++)
        if (e->rails[i]->ifindex) any = 1;
    if (!any) return;
    int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC | SOCK_NONBLOCK, NETLINK_ROUTE);
    if (fd < 0) return;
    struct sockaddr_nl sa;
    memset(&sa, 0, sizeof(sa));
    sa.nl_family = AF_NETLINK;
    sa.nl_groups = RTMGRP_LINK;
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        close(fd);
        return;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
    if (epoll_ctl(e->pollers[0].epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
        close(fd);
        return;
    }
    e->nl_fd = fd;
}

int aio_rail_link_up(aio_engine *e, int rail) {
    if (rail < 0 || rail >= e->nrails) return -FI_EINVAL;
    return atomic_load(&e->rails[rail]->link_up);
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
        int tw = rail_trywait(r);
        if (tw == -FI_EAGAIN) return 1;
        if (tw != FI_SUCCESS) continue;
        struct pollfd p = {.fd = r->wait_fd, .events = POLLIN};
        if (poll(&p, 1, 0) > 0 && (p.revents & POLLIN)) return 1;
    }
    return 0;
}

static void *poller_main(void *arg) {
    aio_poller *q = arg;
    aio_engine *e = q->e;
    int watcher = q->index == 0; /* poller 0 also reads the watched words and the link monitor */
    /* short timed sleeps (watched words) must not be stretched by the default 50 us slack */
    prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
    int64_t last_active = now_ns();
    /* Adaptive spin. The spin window after the last activity (spin_ns, or busy_spin_ns with
     * work of ours in flight) grows while activity comes densely: a stream of data arrives in
     * many pieces (a large write's bytes come long before its completion), and a sleep plus a
     * wake-up per piece costs this side and the sender (an IPI on a VM) far more than spinning
     * through the gaps. Activity is a completion, a post, or bytes arriving (a rail's wait fd
     * ready on a socket rail, looked at while spinning with nothing of ours in flight). An idle
     * gap (from the last activity to the poll that finds the next) of at most ADAPT_DENSE_NS,
     * with a sleep in it, doubles the window (up to ADAPT_MAX_NS); a gap longer than
     * ADAPT_SPARSE_NS resets it to the base when the next activity comes. So traffic with more
     * than ADAPT_SPARSE_NS between events spins no more than the base window from its first such
     * gap on, and an engine that goes idle spins out the grown window once, then sleeps. */
    int64_t adapt = 0;
    int slept = 0;   /* the poller slept since the last activity */
    int io_wake = 0; /* a rail's wait fd was ready: bytes are moving */
    int64_t io_checked = 0;
    uint64_t seen_seq = atomic_load(&q->post_seq);
    int all_fd = 1, any_fd = 0; /* any_fd: some rail's wait fd signals bytes arriving */
    int woken = 1; /* every rail has a wait fd, or is an shm rail its peers wake (shm_wake) */
    for (int i = 0; i < q->nrails; i++) {
        if (q->rails[i]->wait_fd < 0) all_fd = 0;
        if (q->rails[i]->wait_fd < 0 && q->rails[i]->wake_fd < 0) woken = 0;
        if (q->rails[i]->bytes_fd) any_fd = 1;
    }
    tl_poller = q;
    while (!atomic_load(&e->stop)) {
        /* records the ring could not take (ring_put): produce nothing more until they are in */
        if (q->nstash && stash_flush(q)) {
            struct timespec ts = {.tv_sec = 0, .tv_nsec = 200000};
            nanosleep(&ts, NULL);
            continue;
        }
        int got = direct_run(q);
        int64_t t_poll = now_ns(); /* idle gaps end here: reading a large message is not idle */
        for (int i = 0; i < q->nrails; i++) {
            aio_rail *r = q->rails[i];
            pthread_mutex_lock(&r->mu);
            got += progress_locked(e, r);
            pthread_mutex_unlock(&r->mu);
        }
        if (watcher) got += poll_watches(e);
        atomic_fetch_add_explicit(&e->st_polls, 1, memory_order_relaxed);
        if (watcher && e->nl_fd >= 0) {
            int64_t t = now_ns();
            if (t - e->nl_checked > 1000000) {
                e->nl_checked = t;
                drain_netlink(e);
            }
        }
        uint64_t seq = atomic_load(&q->post_seq);
        if (got || seq != seen_seq || io_wake) {
            int64_t t = now_ns();
            int64_t idle = t_poll - last_active;
            if (idle > ADAPT_SPARSE_NS) {
                adapt = 0; /* sparse: the base window */
            } else if (slept && idle <= ADAPT_DENSE_NS) { /* dense, and we slept through it */
                adapt = adapt ? adapt * 2 : e->cfg.spin_ns * 2;
                if (adapt > ADAPT_MAX_NS) adapt = ADAPT_MAX_NS;
            }
            atomic_store_explicit(&e->st_adapt, adapt, memory_order_relaxed);
            slept = io_wake = 0;
            seen_seq = seq;
            last_active = t;
            continue;
        }
        /* spin a short budget after the last activity; longer while work of ours
         * is in flight (manual-progress providers move data only when polled) */
        int64_t inflight = atomic_load(&q->inflight);
        int64_t spin = e->cfg.spin_ns;
        if (inflight > 0 && spin < e->cfg.busy_spin_ns) spin = e->cfg.busy_spin_ns;
        if (spin < adapt) spin = adapt;
        int64_t t = now_ns();
        if (t - last_active < spin) {
            /* while spinning with nothing of ours in flight (a receiver), bytes arriving count
             * as activity (a rail's wait fd ready after fi_trywait re-armed it): a stream keeps
             * its window; at most every 5 us. A sender is not looked at: its completions are its
             * activity, and its posting thread needs the rail's lock. */
            if (any_fd && inflight == 0 && t - io_checked > 5000) {
                io_checked = t;
                io_wake = rails_ready(q);
                if (io_wake) continue;
            }
            /* yield rather than only pause: with few cores, the thread this spin
             * waits for (the loop that posts the next request, a peer process) may
             * need this very core */
            sched_yield();
            continue;
        }
        /* go to sleep */
        atomic_store(&q->sleeping, 1);
        if (atomic_load(&q->post_seq) != seen_seq) {
            atomic_store(&q->sleeping, 0);
            continue;
        }
        int can_sleep = 1, fd_broken = 0;
        for (int i = 0; i < q->nrails && can_sleep; i++) {
            aio_rail *r = q->rails[i];
            if (r->wait_fd < 0) continue;
            int tw = rail_trywait(r);
            /* -FI_EAGAIN: work pending in the provider, poll again at once. Another error: its
             * wait fd cannot be trusted to wake us, so sleep in short timed steps rather than
             * spin on it for ever */
            if (tw == -FI_EAGAIN) can_sleep = 0;
            else if (tw != FI_SUCCESS) fd_broken = 1;
        }
        /* shm rails whose peers wake us: nothing of ours in flight, so what can come is a peer's
         * request, and the peer wakes us (shm_wake). Say that we sleep, then look once more. */
        int wake_sleep = can_sleep && !all_fd && woken && inflight == 0 && !fd_broken &&
                         now_ns() - last_active > WAKE_IDLE_NS;
        if (wake_sleep) {
            for (int i = 0; i < q->nrails; i++)
                if (q->rails[i]->wake_word) atomic_store(q->rails[i]->wake_word, 1);
            atomic_thread_fence(memory_order_seq_cst);
            int more = 0;
            for (int i = 0; i < q->nrails; i++) {
                aio_rail *r = q->rails[i];
                if (!r->wake_word) continue;
                pthread_mutex_lock(&r->mu);
                more += progress_locked(e, r);
                pthread_mutex_unlock(&r->mu);
            }
            if (more || atomic_load(&q->post_seq) != seen_seq) {
                for (int i = 0; i < q->nrails; i++)
                    if (q->rails[i]->wake_word) atomic_store(q->rails[i]->wake_word, 0);
                atomic_store(&q->sleeping, 0);
                io_wake = 1; /* activity: the top of the loop counts it */
                continue;
            }
        }
        if (can_sleep) {
            struct epoll_event evs[AIO_MAX_RAILS * 2 + 2]; /* rails' wait and wake fds, kick, netlink */
            int timeout = e->cfg.sleep_ms;
            /* a rail without a wait object, or work of ours in flight on a
             * manual-progress provider: sleep in short steps */
            if (inflight > 0 || fd_broken) timeout = 1;
            else if (!all_fd && !wake_sleep) /* no wait object: short steps, longer once idle a while */
                timeout = (now_ns() - last_active > 200000000LL) ? 5 : 1;
            atomic_fetch_add_explicit(&e->st_sleeps, 1, memory_order_relaxed);
            int ne;
            /* a rail without a wait object (shm) that no peer wakes, or a completion of ours to
             * come on one, tells nobody that it arrived: while a task awaits one, poll it every
             * 50 us rather than every millisecond */
            long short_us = (!all_fd && !wake_sleep && atomic_load(&e->nwant) > 0) ? 50 : 0;
            if (watcher && atomic_load(&e->nwatch) > 0 && (!short_us || e->cfg.watch_us < short_us))
                short_us = e->cfg.watch_us; /* watched words: read them again soon */
            slept = 1;
            if (short_us) {
                struct timespec ts = {.tv_sec = 0, .tv_nsec = short_us * 1000L};
                ne = epoll_pwait2(q->epfd, evs, AIO_MAX_RAILS * 2 + 2, &ts, NULL);
            } else {
                ne = epoll_wait(q->epfd, evs, AIO_MAX_RAILS * 2 + 2, timeout);
            }
            if (wake_sleep)
                for (int i = 0; i < q->nrails; i++)
                    if (q->rails[i]->wake_word) atomic_store(q->rails[i]->wake_word, 0);
            for (int k = 0; k < ne; k++) {
                int wk = -1;
                for (int i = 0; i < q->nrails && wk < 0; i++)
                    if (q->rails[i]->wake_fd >= 0 && evs[k].data.fd == q->rails[i]->wake_fd) wk = i;
                if (wk >= 0) { /* a peer woke us: its request is in our queue */
                    char buf[256];
                    while (read(q->rails[wk]->wake_fd, buf, sizeof(buf)) > 0) {
                    }
                    io_wake = 1;
                } else if (evs[k].data.fd == q->kick_fd) {
                    uint64_t v;
                    ssize_t rr = read(q->kick_fd, &v, sizeof(v));
                    (void)rr;
                } else if (evs[k].data.fd == e->nl_fd) {
                    drain_netlink(e);
                } else {
                    /* a rail's wait object: data is moving even before any completion
                     * (a large message arrives in many pieces): activity */
                    io_wake = 1;
                }
            }
        }
        atomic_store(&q->sleeping, 0);
    }
    return NULL;
}

/* Opens the next poller's kick eventfd and epoll set (not its thread: aio_engine_start): 0, or
 * -1 with errno (nothing left open). */
static int poller_open(aio_engine *e) {
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

int aio_engine_create(const aio_engine_config *cfg, aio_engine **out, char *err, size_t errlen) {
    aio_engine *e = calloc(1, sizeof(*e));
    if (!e) return -FI_ENOMEM;
    e->cfg = *cfg;
    e->sndbuf = AIO_TCP_SNDBUF_AUTO;
    if (e->cfg.ring_capacity < 1024) e->cfg.ring_capacity = 1024;
    uint32_t cap = 1;
    while (cap < e->cfg.ring_capacity) cap <<= 1;
    e->cfg.ring_capacity = cap;
    if (e->cfg.max_ops == 0) e->cfg.max_ops = 16384;
    if (e->cfg.max_groups == 0) e->cfg.max_groups = 16384;
    if (e->cfg.sleep_ms <= 0) e->cfg.sleep_ms = 100;
    if (e->cfg.busy_spin_ns <= 0) e->cfg.busy_spin_ns = 200000; /* 200 us: longer starves a 2-core box */
    if (e->cfg.watch_us <= 0) e->cfg.watch_us = 100;
    if (e->cfg.watch_us > 1000000) e->cfg.watch_us = 1000000;
    e->ring = calloc(cap, sizeof(aio_record));
    e->ovf_block = calloc(RING_RESERVE, sizeof(overflow_node));
    if (!e->ovf_block) goto fail;
    for (int i = 0; i < RING_RESERVE; i++) {
        e->ovf_block[i].reserve = 1;
        e->ovf_block[i].next = i + 1 < RING_RESERVE ? &e->ovf_block[i + 1] : NULL;
    }
    e->ovf_free = e->ovf_block;
    e->ring_mask = cap - 1;
    e->groups = calloc(e->cfg.max_groups, sizeof(aio_group));
    e->ccap = 1024;
    e->cslots = calloc(e->ccap, sizeof(cslot));
    if (!e->ring || !e->groups || !e->cslots) goto fail;
    for (uint32_t i = 0; i < e->cfg.max_groups; i++)
        e->groups[i].next_free = (i + 1 < e->cfg.max_groups) ? (int32_t)(i + 1) : -1;
    e->groups_free = 0;
    pthread_mutex_init(&e->ring_mu, NULL);
    pthread_mutex_init(&e->groups_mu, NULL);
    pthread_mutex_init(&e->cnt_mu, NULL);
    pthread_mutex_init(&e->mr_mu, NULL);
    pthread_mutex_init(&e->watch_mu, NULL);
    pthread_mutex_init(&e->dmu, NULL);
    e->dfd = -1;
    e->afd = -1;
    e->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    e->nl_fd = -1;
    atomic_store(&e->want_below, -1);
    e->npollers_want = 1;
    if (e->efd < 0 || poller_open(e) != 0) {
        set_err(err, errlen, "eventfd/epoll: %s", strerror(errno));
        goto fail;
    }
    *out = e;
    return 0;
fail:
    if (e->efd > 0) close(e->efd);
    free(e->ovf_block);
    free(e->ring);
    free(e->groups);
    free(e->cslots);
    free(e);
    return -FI_ENOMEM;
}

/* libfabric probes every provider it knows on its first call (fi_ini), reading FI_PROVIDER
 * then and never again. aiote uses few of them, so when the user has not chosen (FI_PROVIDER
 * unset) the first call is made with FI_PROVIDER set to those, and the variable is removed
 * again as soon as fi_ini has read it: the process environment is left as it was (importing
 * aiote no longer touches it). Done once, under pthread_once, from the first function that
 * would call into libfabric (fab_init below). The variable exists only for the length of one
 * fi_getinfo: a thread that reads the C environment meanwhile (getenv) may see it, and glibc's
 * setenv/unsetenv take its environment lock against each other (Python's os.environ writes go
 * through putenv/unsetenv too), so nothing is lost or torn; a user who wants other providers
 * sets FI_PROVIDER, which is then left alone. */
#define AIO_DEFAULT_PROVIDERS "tcp,ofi_rxm,shm,verbs,efa"
static pthread_once_t fab_once = PTHREAD_ONCE_INIT;
static void fab_init_once(void) {
    if (getenv("FI_PROVIDER")) return; /* the user's choice; fi_ini reads it on first use */
    if (setenv("FI_PROVIDER", AIO_DEFAULT_PROVIDERS, 0)) return;
    struct fi_info *h = fi_allocinfo(), *info = NULL;
    if (h) {
        h->ep_attr->type = FI_EP_RDM;
        h->fabric_attr->prov_name = strdup("shm"); /* cheap; the call only has to run fi_ini */
        if (fi_getinfo(FI_VERSION(1, 9), NULL, NULL, 0, h, &info) == 0) fi_freeinfo(info);
        fi_freeinfo(h);
    }
    unsetenv("FI_PROVIDER");
}
static void fab_init(void) { pthread_once(&fab_once, fab_init_once); }

static const char *map_provider(const char *p) {
    if (!strcmp(p, "tcp")) return "tcp;ofi_rxm";
    if (!strcmp(p, "verbs")) return "verbs;ofi_rxm";
    return p;
}

static struct fi_info *make_hints(const char *prov, const char *nic) {
    struct fi_info *h = fi_allocinfo();
    if (!h) return NULL;
    h->caps = FI_RMA | FI_MSG | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_SEND |
              FI_RECV;
    h->ep_attr->type = FI_EP_RDM;
    h->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
    h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY |
                              FI_MR_ENDPOINT | FI_MR_HMEM;
    h->domain_attr->threading = FI_THREAD_DOMAIN;
    h->domain_attr->data_progress = FI_PROGRESS_MANUAL;
    h->tx_attr->msg_order = 0;
    /* tcp completes a write once its bytes are in the local socket otherwise: a wrong key
     * or a link that fails afterwards would lose it silently. Delivery completion makes a
     * completion mean "placed at the target" (shm in libfabric 1.17 mishandles the flag, and
     * its copies are done by the time they complete anyway). */
    if (!strcmp(prov, "tcp") || !strncmp(prov, "tcp;", 4)) h->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    h->fabric_attr->prov_name = strdup(map_provider(prov));
    if (nic && *nic) h->domain_attr->name = strdup(nic);
    return h;
}

static void list_nics(const char *prov, char *buf, size_t len) {
    fab_init();
    struct fi_info *h = make_hints(prov, NULL), *info = NULL;
    buf[0] = 0;
    if (!h) return;
    if (fi_getinfo(FI_VERSION(1, 9), NULL, NULL, 0, h, &info) == 0) {
        size_t used = 0;
        for (struct fi_info *i = info; i; i = i->next) {
            const char *nm = i->domain_attr->name;
            if (strstr(buf, nm)) continue;
            int w = snprintf(buf + used, len - used, "%s%s", used ? ", " : "", nm);
            if (w < 0 || (size_t)w >= len - used) break;
            used += (size_t)w;
        }
        fi_freeinfo(info);
    }
    fi_freeinfo(h);
}

int aio_probe(const char *provider, aio_probe_entry *out, int max) {
    fab_init();
    struct fi_info *h = make_hints(provider, NULL), *info = NULL;
    if (!h) return -FI_ENOMEM;
    int ret = fi_getinfo(FI_VERSION(1, 9), NULL, NULL, 0, h, &info);
    fi_freeinfo(h);
    if (ret == -FI_ENODATA) return 0;
    if (ret) return ret;
    int n = 0;
    for (struct fi_info *i = info; i && n < max; i = i->next) {
        const char *dom = i->domain_attr->name ? i->domain_attr->name : "";
        int dup = 0;
        for (int k = 0; k < n; k++)
            if (!strcmp(out[k].domain, dom)) dup = 1;
        if (dup) continue;
        aio_probe_entry *o = &out[n++];
        memset(o, 0, sizeof(*o));
        snprintf(o->provider, sizeof(o->provider), "%s", i->fabric_attr->prov_name);
        snprintf(o->domain, sizeof(o->domain), "%s", dom);
        snprintf(o->fabric, sizeof(o->fabric), "%s", i->fabric_attr->name ? i->fabric_attr->name : "");
        o->caps = i->caps;
        o->mr_mode = (uint64_t)i->domain_attr->mr_mode;
        o->max_msg_size = i->ep_attr->max_msg_size;
        o->cq_data_size = (uint32_t)i->domain_attr->cq_data_size;
        o->hmem = (i->caps & FI_HMEM) ? 1 : 0;
        o->iov_limit = (uint32_t)i->tx_attr->iov_limit;
        if (i->nic && i->nic->link_attr) o->link_speed = i->nic->link_attr->speed;
    }
    fi_freeinfo(info);
    return n;
}

/* The IPv4 (else IPv6) address of a network interface, for providers whose domains
 * are interfaces (tcp): rxm does not filter on the domain-name hint, so the source
 * address is what pins the endpoint to the NIC. */
static int nic_address(const char *nic, char *out, size_t len) {
    struct ifaddrs *ifa = NULL;
    int found = 0;
    if (!nic || !*nic || getifaddrs(&ifa) != 0) return 0;
    for (int pass = 0; pass < 2 && !found; pass++) {
        for (struct ifaddrs *i = ifa; i; i = i->ifa_next) {
            if (!i->ifa_addr || strcmp(i->ifa_name, nic) != 0) continue;
            int fam = i->ifa_addr->sa_family;
            if (pass == 0 && fam == AF_INET) {
                inet_ntop(AF_INET, &((struct sockaddr_in *)i->ifa_addr)->sin_addr, out, (socklen_t)len);
                found = 1;
                break;
            }
            if (pass == 1 && fam == AF_INET6) {
                inet_ntop(AF_INET6, &((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr, out, (socklen_t)len);
                found = 1;
                break;
            }
        }
    }
    freeifaddrs(ifa);
    return found;
}

static int reg_local(aio_rail *r, void *buf, size_t len, uint64_t access, struct fid_mr **mr,
                     void **desc, uint64_t key, int iface, int device) {
    int ret;
    if (iface == AIO_HMEM_SYSTEM) {
        ret = fi_mr_reg(r->domain, buf, len, access, 0, key, 0, mr, NULL);
    } else { /* device memory, on a provider with FI_HMEM */
        struct iovec iov = {.iov_base = buf, .iov_len = len};
        struct fi_mr_attr attr;
        memset(&attr, 0, sizeof(attr));
        attr.mr_iov = &iov;
        attr.iov_count = 1;
        attr.access = access;
        attr.requested_key = key;
        attr.iface = FI_HMEM_CUDA;
        attr.device.cuda = device;
        ret = fi_mr_regattr(r->domain, &attr, 0, mr);
    }
    if (ret) return ret;
    if (r->mr_mode & FI_MR_ENDPOINT) {
        ret = fi_mr_bind(*mr, &r->ep->fid, 0);
        if (!ret) ret = fi_mr_enable(*mr);
        if (ret) {
            fi_close(&(*mr)->fid);
            *mr = NULL;
            return ret;
        }
    }
    *desc = fi_mr_desc(*mr);
    return 0;
}

static uint64_t random_key(aio_rail *r) {
    uint64_t k = 0;
    while (getrandom(&k, sizeof(k), 0) != sizeof(k)) {
    }
    size_t ks = r->info->domain_attr->mr_key_size;
    if (ks > 0 && ks < 8) k &= (1ULL << (8 * ks)) - 1;
    return k;
}

/* ------------------------------------------------------------------ tcp send buffers */

#define TUNE_TRIES 3      /* scans per peer: its connection may still be on its way */
#define TUNE_MAX_ADDR 65536

int aio_engine_set_tcp_sndbuf(aio_engine *e, int32_t bytes, int all) {
    if (e->started || e->nrails || bytes < 0) return -FI_EINVAL;
    e->sndbuf = bytes;
    e->sndbuf_all = all ? 1 : 0;
    return 0;
}

/* The IP of an AF_INET/AF_INET6 address (len bytes at *ip), and its port; 0 for other families. */
static int sa_parts(const struct sockaddr *a, const void **ip, size_t *len, uint16_t *port) {
    if (a->sa_family == AF_INET) {
        const struct sockaddr_in *v = (const struct sockaddr_in *)(const void *)a;
        *ip = &v->sin_addr, *len = sizeof(v->sin_addr), *port = ntohs(v->sin_port);
        return 1;
    }
    if (a->sa_family == AF_INET6) {
        const struct sockaddr_in6 *v = (const struct sockaddr_in6 *)(const void *)a;
        *ip = &v->sin6_addr, *len = sizeof(v->sin6_addr), *port = ntohs(v->sin6_port);
        return 1;
    }
    return 0;
}

/* 1: same IP (and the same port when with_port); an unspecified IP in b matches any IP. */
static int sa_match(const struct sockaddr *a, const struct sockaddr *b, int with_port) {
    const void *ia, *ib;
    size_t la, lb;
    uint16_t pa, pb;
    if (!sa_parts(a, &ia, &la, &pa) || !sa_parts(b, &ib, &lb, &pb)) return 0;
    if (with_port && pa != pb) return 0;
    static const uint8_t zero[16];
    if (lb <= sizeof(zero) && !memcmp(ib, zero, lb)) return 1;
    return la == lb && !memcmp(ia, ib, la);
}

static int sa_loopback(const struct sockaddr *a) {
    if (a->sa_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)(const void *)a)->sin_addr.s_addr) >> 24) == 127;
    if (a->sa_family == AF_INET6)
        return IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)(const void *)a)->sin6_addr);
    return 0;
}

/* Which sockets are the rail's own. libfabric does not hand out its sockets, and addresses do
 * not tell them apart from the application's (a socket of the application connected to the
 * same peer port looks alike). But libfabric's tcp provider watches every socket of the rail
 * (its listener, the connections it made and accepted) in epoll sets that its CQ's wait object
 * (FI_GETWAIT: an epoll fd) holds, directly or through nested epoll sets. The kernel lists an
 * epoll set's members in /proc/self/fdinfo/<epfd> ("tfd: <fd> ... ino:<hex>"), with the inode
 * of the file registered, which tells a reused descriptor number apart. So the rail's sockets
 * are the inodes reached from its wait fd, and only those are ever tuned (tcp_tune). Fills
 * `ino` (at most `max`), returns how many; 0 when the rail has no epoll wait object. */
#define RAIL_SOCKS_MAX 4096
static int rail_sockets(aio_rail *r, uint64_t *ino, int max) {
    if (r->wait_fd < 0) return 0;
    enum { MAX_EP = 64 };
    int ep[MAX_EP], nep = 0, n = 0;
    ep[nep++] = r->wait_fd;
    for (int k = 0; k < nep; k++) {
        char path[64], link[64];
        snprintf(path, sizeof(path), "/proc/self/fd/%d", ep[k]);
        ssize_t ll = readlink(path, link, sizeof(link) - 1);
        if (ll <= 0) continue;
        link[ll] = 0;
        if (strcmp(link, "anon_inode:[eventpoll]")) continue;
        snprintf(path, sizeof(path), "/proc/self/fdinfo/%d", ep[k]);
        FILE *f = fopen(path, "re");
        if (!f) continue;
        char line[256];
        while (fgets(line, sizeof(line), f)) {
            int tfd;
            if (sscanf(line, "tfd: %d", &tfd) != 1) continue;
            const char *ip = strstr(line, "ino:");
            unsigned long long want = ip ? strtoull(ip + 4, NULL, 16) : 0;
            snprintf(path, sizeof(path), "/proc/self/fd/%d", tfd);
            ll = readlink(path, link, sizeof(link) - 1);
            if (ll <= 0) continue;
            link[ll] = 0;
            if (!strcmp(link, "anon_inode:[eventpoll]")) {
                int seen = 0;
                for (int j = 0; j < nep; j++) seen |= ep[j] == tfd;
                if (!seen && nep < MAX_EP) ep[nep++] = tfd;
                continue;
            }
            unsigned long long si;
            if (sscanf(link, "socket:[%llu]", &si) != 1 || !want || si != want) continue;
            if (n < max) ino[n++] = si;
        }
        fclose(f);
    }
    return n;
}

/* Sets e->sndbuf on the rail's sockets (see aio_engine_set_tcp_sndbuf): among those that are
 * the rail's own (rail_sockets: never a socket of the application's, whatever its addresses),
 * those whose local address is the rail's listening address (the listener and the connections
 * it accepted), and the connection to `peer` (its remote address is the peer's listening
 * address); same-host ones only unless sndbuf_all. Walks /proc/self/fd: a few system calls per
 * open descriptor. Returns 1 when it saw the connection to `peer`. */
static int tcp_tune(aio_engine *e, aio_rail *r, const struct sockaddr *peer) {
    uint64_t *own = malloc(RAIL_SOCKS_MAX * sizeof(uint64_t));
    if (!own) return 0;
    int nown = rail_sockets(r, own, RAIL_SOCKS_MAX);
    DIR *d = nown ? opendir("/proc/self/fd") : NULL;
    if (!d) {
        free(own);
        return 0;
    }
    struct sockaddr_storage mine_ss;
    memset(&mine_ss, 0, sizeof(mine_ss));
    memcpy(&mine_ss, r->addr, r->addr_len < sizeof(mine_ss) ? r->addr_len : sizeof(mine_ss));
    const struct sockaddr *me = (const struct sockaddr *)&mine_ss;
    int want = e->sndbuf, found = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] < '0' || de->d_name[0] > '9') continue;
        int fd = atoi(de->d_name), v = 0;
        socklen_t l = sizeof(v);
        if (fd == dirfd(d) || getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &v, &l) || v != IPPROTO_TCP) continue;
        struct stat st;
        int owned = 0;
        if (fstat(fd, &st) == 0)
            for (int k = 0; k < nown && !owned; k++) owned = own[k] == (uint64_t)st.st_ino;
        if (!owned) continue; /* not the rail's: the application's, or another library's */
        struct sockaddr_storage loc, rem;
        socklen_t ll = sizeof(loc), rl = sizeof(rem);
        if (getsockname(fd, (struct sockaddr *)&loc, &ll)) continue;
        int connected = getpeername(fd, (struct sockaddr *)&rem, &rl) == 0;
        int mine = sa_match((struct sockaddr *)&loc, me, 1); /* the listener or one it accepted */
        int to_peer = connected && peer && sa_match((struct sockaddr *)&rem, peer, 1);
        if (!mine && !to_peer) continue;
        if (to_peer) found = 1;
        if (!e->sndbuf_all && (connected ? !sa_match((struct sockaddr *)&loc, (struct sockaddr *)&rem, 0)
                                         : !sa_loopback((struct sockaddr *)&loc)))
            continue; /* another host's connection (or a listener that may accept one) */
        /* done already: the kernel reports twice the size asked, or what it gave an earlier
         * socket (it caps the size at net.core.wmem_max) */
        l = sizeof(v);
        int had = getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, &l) ? -1 : v;
        if (had == 2 * want || (had > 0 && had == atomic_load(&e->sndbuf_got))) continue;
        if (setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof(want))) continue;
        atomic_fetch_add(&e->st_tuned, 1);
        l = sizeof(v);
        if (!getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, &l)) atomic_store(&e->sndbuf_got, v);
    }
    closedir(d);
    free(own);
    return found;
}

/* After a post to `fa` on a tcp rail: the first posts to a peer set up its connection; tune it
 * (at most TUNE_TRIES scans per peer). Caller holds r->mu. */
static void tcp_tune_peer(aio_engine *e, aio_rail *r, fi_addr_t fa) {
    if (fa >= TUNE_MAX_ADDR) return;
    if (fa >= r->tune_cap) {
        uint32_t cap = r->tune_cap ? r->tune_cap : 64;
        while (cap <= fa) cap *= 2;
        uint8_t *t = realloc(r->tune_tries, cap);
        if (!t) return;
        memset(t + r->tune_cap, 0, cap - r->tune_cap);
        r->tune_tries = t, r->tune_cap = cap;
    }
    if (r->tune_tries[fa] >= TUNE_TRIES) return;
    r->tune_tries[fa]++;
    struct sockaddr_storage pa;
    size_t pl = sizeof(pa);
    if (fi_av_lookup(r->av, fa, &pa, &pl) == 0 && pl <= sizeof(pa) &&
        tcp_tune(e, r, (struct sockaddr *)&pa))
        r->tune_tries[fa] = TUNE_TRIES;
}

static void rail_free(aio_rail *r) {
    if (!r) return;
    if (r->ep) fi_close(&r->ep->fid);
    if (r->recv_mr) fi_close(&r->recv_mr->fid);
    if (r->send_mr) fi_close(&r->send_mr->fid);
    if (r->av) fi_close(&r->av->fid);
    if (r->cq) fi_close(&r->cq->fid);
    if (r->domain) fi_close(&r->domain->fid);
    if (r->fabric) fi_close(&r->fabric->fid);
    if (r->info) fi_freeinfo(r->info);
    free(r->ops);
    free(r->recv_ops);
    free(r->recv_buf);
    free(r->send_buf);
    free(r->send_free);
    free(r->tune_tries);
    for (int i = 0; i < DEFER_PEERS / DEFER_CHUNK; i++) free((void *)atomic_load(&r->defer_ok[i]));
    shm_own_release(r); /* after the endpoint's own file is gone (fi_close above) */
    pthread_mutex_destroy(&r->mu);
    pthread_mutex_destroy(&r->pool_mu);
    free(r);
}

/* ------------------------------------------------------------------ owned shm names and wake-ups
 *
 * Theory of operation. libfabric's shm provider keeps an endpoint's queues in a file in
 * /dev/shm named after the endpoint, and leaves it behind when its process is killed. By
 * default it names it <pid>:<uid>:<n>: a name that says neither whose it is nor, once another
 * PID namespace shares /dev/shm, whether its process lives. So aiote names its endpoints itself
 * (fi_setname, before fi_enable): aiote-<token>-<n>, where <token> is 64 random bits drawn once
 * per process (again in a forked child) and <n> counts the process's endpoints. Before the first
 * of them it creates /dev/shm/aiote-<token>.lock (O_EXCL) and holds an exclusive flock on it for
 * the rest of its life; the kernel drops the lock when the process dies, whatever its PID
 * namespace. Every file aiote (or libfabric on its behalf) creates for the endpoint starts with
 * aiote-<token>-: the endpoint's queues, the mmap-protocol files libfabric adds after the name,
 * and our wake-up word (.w) and fifo (.p).
 *
 * Sweeping (shm_sweep_stale, once per process, before its first shm endpoint) removes only
 * those: for each aiote-<token>.lock whose lock it can take at once (no living process holds
 * it, in any namespace), still the same file after the lock is taken, it removes every
 * aiote-<token>-* and then the lock file, holding the lock throughout. A creator that lost the
 * race (its new lock file was swept before it locked it) sees st_nlink == 0 after locking and
 * draws another token. Files aiote did not name (another program's <pid>:..., an old aiote's)
 * are never touched, nor are a living process's, whatever its pid.
 *
 * Wake-ups. The shm provider has no wait object: nothing tells a sleeping poller that a peer
 * put a message or an immediate in its queue, so an idle engine used to poll its shm rail every
 * 50 us to 1 ms. Each aiote shm endpoint has a word in a small shared file (aiote-...-<n>.w,
 * nonzero while its poller sleeps) and a fifo (aiote-...-<n>.p) in its poller's epoll set. After
 * every request it hands to the shm provider (taken or refused with -FI_EAGAIN, which may be a
 * connection request the target must answer), an aiote sender reads the target's word and, if
 * it is set, writes a byte into its fifo (shm_wake; the target's files are opened once per
 * address). A poller about to sleep sets its word, then reads its CQ once more: the sender's
 * queue write, fence, word read and the sleeper's word write, fence, queue read cannot both
 * miss each other. With every rail woken this way or by its own wait fd, and nothing of its own
 * in flight (a completion of our request needs no sender to wake us: then it keeps the short
 * steps), and idle for WAKE_IDLE_NS, the poller sleeps for sleep_ms (100 ms by default); a peer
 * that is not aiote (no word to read) is then served at that pace. */
#define OWN_PREFIX "aiote-"
#define WAKE_MAX_ADDR (1u << 20)
typedef struct shm_wpeer {
    int state; /* 0: not looked up, 1: fd and word valid, -1: cannot be woken (not aiote's) */
    int fd;
    _Atomic uint32_t *word;
} shm_wpeer;

static pthread_mutex_t own_mu = PTHREAD_MUTEX_INITIALIZER;
static pid_t own_pid;
static char own_token[17];
static int own_lockfd = -1;
static uint32_t own_next;
static int own_live; /* endpoints named with the token: at 0 the lock file goes */

/* This process's token and held lock file (caller holds own_mu): 0, or -1 with errno. */
static int own_init_locked(void) {
    if (own_lockfd >= 0 && own_pid == getpid()) return 0;
    if (own_lockfd >= 0) { /* a forked child: the lock is its parent's (closing keeps it there) */
        close(own_lockfd);
        own_lockfd = -1;
    }
    for (int tries = 0; tries < 16; tries++) {
        uint64_t v = 0;
        if (getrandom(&v, sizeof(v), 0) != sizeof(v)) v = (uint64_t)now_ns() * 0x9E3779B97F4A7C15ULL ^ (uint64_t)getpid();
        snprintf(own_token, sizeof(own_token), "%016llx", (unsigned long long)v);
        char path[96];
        snprintf(path, sizeof(path), "/dev/shm/" OWN_PREFIX "%s.lock", own_token);
        int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (fd < 0) {
            if (errno == EEXIST) continue;
            return -1;
        }
        struct stat st;
        if (flock(fd, LOCK_EX) != 0 || fstat(fd, &st) != 0 || st.st_nlink == 0) {
            close(fd); /* swept before we locked it: another token */
            continue;
        }
        own_lockfd = fd;
        own_pid = getpid();
        own_next = 0;
        return 0;
    }
    errno = EEXIST;
    return -1;
}

/* Removes the files of aiote processes that are gone (see above). Once per process. */
static void shm_sweep_stale(void) {
    static atomic_int done;
    if (atomic_exchange(&done, 1)) return;
    enum { MAX_DEAD = 256 };
    char dead[MAX_DEAD][17];
    int dead_fd[MAX_DEAD], ndead = 0;
    pthread_mutex_lock(&own_mu);
    char mine[17];
    snprintf(mine, sizeof(mine), "%s", own_lockfd >= 0 && own_pid == getpid() ? own_token : "");
    pthread_mutex_unlock(&own_mu);
    DIR *d = opendir("/dev/shm");
    if (!d) return;
    struct dirent *ent;
    const size_t pl = strlen(OWN_PREFIX);
    while ((ent = readdir(d)) != NULL && ndead < MAX_DEAD) {
        const char *nm = ent->d_name;
        if (strncmp(nm, OWN_PREFIX, pl) || strlen(nm) != pl + 16 + 5 || strcmp(nm + pl + 16, ".lock"))
            continue;
        if (!strncmp(nm + pl, mine, 16)) continue;
        char path[300];
        snprintf(path, sizeof(path), "/dev/shm/%s", nm);
        int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        if (fd < 0) continue;
        struct stat a, b;
        if (flock(fd, LOCK_EX | LOCK_NB) != 0 || fstat(fd, &a) != 0 || !S_ISREG(a.st_mode) ||
            stat(path, &b) != 0 || a.st_ino != b.st_ino || a.st_dev != b.st_dev) {
            close(fd); /* held: its process lives (in whatever PID namespace); or replaced */
            continue;
        }
        memcpy(dead[ndead], nm + pl, 16);
        dead[ndead][16] = 0;
        dead_fd[ndead++] = fd;
    }
    if (ndead) {
        rewinddir(d);
        while ((ent = readdir(d)) != NULL) {
            const char *nm = ent->d_name;
            if (strncmp(nm, OWN_PREFIX, pl) || strlen(nm) < pl + 17 || nm[pl + 16] != '-') continue;
            for (int i = 0; i < ndead; i++) {
                if (strncmp(nm + pl, dead[i], 16)) continue;
                char path[300];
                snprintf(path, sizeof(path), "/dev/shm/%s", nm);
                unlink(path);
                break;
            }
        }
        for (int i = 0; i < ndead; i++) {
            char path[96];
            snprintf(path, sizeof(path), "/dev/shm/" OWN_PREFIX "%.16s.lock", dead[i]);
            unlink(path); /* still holding its lock: a creator that raced us sees nlink 0 */
            close(dead_fd[i]);
        }
    }
    closedir(d);
}

/* Names a new shm endpoint (before fi_enable) and creates its wake word and fifo. 0, or a
 * negative error (nothing left behind). */
static int shm_own_endpoint(aio_rail *r) {
    pthread_mutex_lock(&own_mu);
    int rc = own_init_locked();
    if (!rc) own_live++;
    uint32_t n = own_next++;
    char tok[17];
    snprintf(tok, sizeof(tok), "%s", own_token);
    pthread_mutex_unlock(&own_mu);
    if (rc) return -FI_EIO;
    snprintf(r->shm_name, sizeof(r->shm_name), OWN_PREFIX "%s-%u", tok, n);
    int ret = fi_setname(&r->ep->fid, r->shm_name, strlen(r->shm_name) + 1);
    if (ret) return ret;
    char path[96];
    snprintf(path, sizeof(path), "/dev/shm/%s.w", r->shm_name);
    int wfd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (wfd < 0) return -errno;
    void *w = MAP_FAILED;
    if (ftruncate(wfd, 4096) == 0) w = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, wfd, 0);
    close(wfd);
    if (w == MAP_FAILED) {
        unlink(path);
        return -FI_ENOMEM;
    }
    r->wake_word = w;
    snprintf(path, sizeof(path), "/dev/shm/%s.p", r->shm_name);
    if (mkfifo(path, 0600) == 0) r->wake_fd = open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (r->wake_fd < 0) { /* no fifo: the rail is polled in short steps, as without names */
        unlink(path);
        munmap(r->wake_word, 4096);
        r->wake_word = NULL;
    }
    return 0;
}

static void shm_wpeer_forget(shm_wpeer *w) {
    if (w->state == 1) {
        close(w->fd);
        munmap((void *)w->word, 4096);
    }
    memset(w, 0, sizeof(*w));
}

/* Our own endpoint's and our peers' wake-up objects, at rail_free. */
static void shm_own_release(aio_rail *r) {
    for (uint32_t i = 0; i < r->wcap; i++) shm_wpeer_forget(&r->wpeers[i]);
    free(r->wpeers);
    r->wpeers = NULL;
    r->wcap = 0;
    char path[96];
    if (r->wake_word) {
        munmap((void *)r->wake_word, 4096);
        snprintf(path, sizeof(path), "/dev/shm/%s.w", r->shm_name);
        unlink(path);
    }
    if (r->wake_fd >= 0) {
        close(r->wake_fd);
        snprintf(path, sizeof(path), "/dev/shm/%s.p", r->shm_name);
        unlink(path);
    }
    if (!r->shm_name[0]) return;
    pthread_mutex_lock(&own_mu);
    if (own_pid == getpid() && own_lockfd >= 0 && --own_live == 0) {
        /* the process's last endpoint: its lock file goes (a later one draws a new token) */
        snprintf(path, sizeof(path), "/dev/shm/" OWN_PREFIX "%.16s.lock", own_token);
        unlink(path);
        close(own_lockfd);
        own_lockfd = -1;
    }
    pthread_mutex_unlock(&own_mu);
}

/* After a request to `fa` went to (or was refused by) an shm rail's provider: wake the target's
 * poller if it sleeps. Caller holds r->mu. */
static void shm_wake(aio_rail *r, uint64_t fa) {
    if (!r->is_shm || fa >= WAKE_MAX_ADDR) return;
    if (fa >= r->wcap) {
        uint32_t cap = r->wcap ? r->wcap : 64;
        while (cap <= fa) cap *= 2;
        shm_wpeer *t = realloc(r->wpeers, cap * sizeof(*t));
        if (!t) return;
        memset(t + r->wcap, 0, (cap - r->wcap) * sizeof(*t));
        r->wpeers = t, r->wcap = cap;
    }
    shm_wpeer *w = &r->wpeers[fa];
    if (w->state == 0) {
        w->state = -1;
        char name[256] = {0};
        size_t l = sizeof(name) - 1;
        if (fi_av_lookup(r->av, fa, name, &l) == 0 && l < sizeof(name) &&
            !strncmp(name, OWN_PREFIX, strlen(OWN_PREFIX)) && !strchr(name, '/')) {
            char path[300];
            snprintf(path, sizeof(path), "/dev/shm/%s.w", name);
            int wfd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
            void *m = MAP_FAILED;
            if (wfd >= 0) {
                m = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, wfd, 0);
                close(wfd);
            }
            snprintf(path, sizeof(path), "/dev/shm/%s.p", name);
            int pfd = m != MAP_FAILED ? open(path, O_WRONLY | O_NONBLOCK | O_CLOEXEC) : -1;
            if (pfd >= 0) {
                w->fd = pfd;
                w->word = m;
                w->state = 1;
            } else if (m != MAP_FAILED) {
                munmap(m, 4096);
            }
        }
    }
    if (w->state != 1) return;
    atomic_thread_fence(memory_order_seq_cst); /* our queue write, then their word: see above */
    if (atomic_load_explicit(w->word, memory_order_relaxed)) {
        char c = 0;
        ssize_t n = write(w->fd, &c, 1); /* a full fifo already wakes it */
        (void)n;
    }
}

int aio_engine_add_rail(aio_engine *e, const char *provider, const char *nic, uint32_t recv_slots,
                        uint64_t slot_size, char *err, size_t errlen) {
    if (e->started) {
        set_err(err, errlen, "rails must be added before the engine starts");
        return -FI_EINVAL;
    }
    if (e->nrails >= AIO_MAX_RAILS) {
        set_err(err, errlen, "at most %d NICs per engine", AIO_MAX_RAILS);
        return -FI_EINVAL;
    }
    /* rail i goes to poller i % npollers_want: open that poller first if it is new */
    int qi = e->nrails % e->npollers_want;
    if (qi >= e->npollers && poller_open(e) != 0) {
        set_err(err, errlen, "eventfd/epoll for poller %d: %s", qi, strerror(errno));
        return -FI_ENOMEM;
    }
    fab_init();
    if (recv_slots == 0) recv_slots = 1;
    if (slot_size < 64) slot_size = 64;
    if (!strcmp(map_provider(provider), "shm")) shm_sweep_stale();
    int ret;
    aio_rail *r = calloc(1, sizeof(*r));
    if (!r) return -FI_ENOMEM;
    pthread_mutex_init(&r->mu, NULL);
    pthread_mutex_init(&r->pool_mu, NULL);
    r->index = e->nrails;
    r->wait_fd = -1;
    r->wake_fd = -1;
    char node[INET6_ADDRSTRLEN + 1] = {0};
    int by_addr = strncmp(map_provider(provider), "tcp", 3) == 0 && nic_address(nic, node, sizeof(node));
    if (by_addr) { /* an interface: watch its link */
        r->ifindex = (int)if_nametoindex(nic);
        atomic_store(&r->link_up, r->ifindex ? iface_up(r->ifindex) : 1);
    } else {
        atomic_store(&r->link_up, 1);
    }
    char service[16] = {0};
    if (by_addr && e->cfg.base_port) {
        int n = 0;
        for (int i = 0; i < e->nrails; i++)
            if (e->rails[i]->ifindex || e->rails[i]->by_addr) n++;
        snprintf(service, sizeof(service), "%u", (unsigned)(e->cfg.base_port + (uint32_t)n));
    }
    r->by_addr = by_addr;
    r->is_shm = strcmp(map_provider(provider), "shm") == 0;
    r->is_tcp = strncmp(map_provider(provider), "tcp", 3) == 0;
    /* device memory (FI_HMEM) first where a provider may have it; Debian's socket-based and
     * shared-memory providers are built without CUDA, so they are not asked (it costs a probe) */
    const char *mp = map_provider(provider);
    int try_hmem = strncmp(mp, "tcp", 3) && strcmp(mp, "shm") && strcmp(mp, "sockets") &&
                   strncmp(mp, "udp", 3) && !getenv("AIOTE_NO_HMEM");
    for (int pass = try_hmem ? 0 : 1; pass < 2; pass++) {
        struct fi_info *hints = make_hints(provider, by_addr ? NULL : nic);
        if (!hints) {
            free(r);
            return -FI_ENOMEM;
        }
        if (pass == 0) {
            hints->caps |= FI_HMEM;
            hints->domain_attr->mr_mode |= FI_MR_HMEM;
        }
        ret = fi_getinfo(FI_VERSION(1, 9), by_addr ? node : NULL, service[0] ? service : NULL,
                         by_addr ? FI_SOURCE : 0, hints, &r->info);
        fi_freeinfo(hints);
        if (ret == 0 && r->info) break;
        if (r->info) {
            fi_freeinfo(r->info);
            r->info = NULL;
        }
    }
    if (ret == 0 && r->info && nic && *nic && !by_addr) {
        /* keep only the entry of the NIC asked for */
        struct fi_info *keep = NULL, **pp = &r->info;
        for (struct fi_info *i = r->info; i; i = i->next)
            if (!keep && i->domain_attr->name && !strcmp(i->domain_attr->name, nic)) keep = i;
        if (!keep) {
            fi_freeinfo(r->info);
            r->info = NULL;
            ret = -FI_ENODATA;
        } else if (keep != r->info) {
            while (*pp != keep) pp = &(*pp)->next;
            *pp = keep->next;
            keep->next = r->info;
            r->info = keep;
        }
    }
    if (ret || !r->info) {
        char nics[512];
        list_nics(provider, nics, sizeof(nics));
        if (nic && *nic && nics[0])
            set_err(err, errlen, "provider '%s' has no NIC named '%s' (it offers: %s)", provider,
                    nic, nics);
        else if (nics[0] == 0)
            set_err(err, errlen,
                    "libfabric offers no provider '%s' with RDM endpoints, RMA and remote CQ data "
                    "on this machine (%s)",
                    provider, fi_strerror(-ret));
        else
            set_err(err, errlen, "provider '%s' could not open '%s': %s", provider,
                    nic ? nic : "(any)", fi_strerror(-ret));
        rail_free(r);
        return ret ? ret : -FI_ENODATA;
    }
    struct fi_info *fi = r->info;
    if (fi->next) {
        fi_freeinfo(fi->next);
        fi->next = NULL;
    }
    r->mr_mode = (uint64_t)fi->domain_attr->mr_mode;
    r->mode = fi->mode;
    r->cq_data_size = (uint32_t)fi->domain_attr->cq_data_size;
    r->tx_op_flags = fi->tx_attr->op_flags & (FI_DELIVERY_COMPLETE | FI_TRANSMIT_COMPLETE);
    r->iov_limit = fi->tx_attr->iov_limit ? fi->tx_attr->iov_limit : 1;
    if (r->iov_limit > AIO_MAX_GATHER) r->iov_limit = AIO_MAX_GATHER;
    if (r->cq_data_size < 4) {
        set_err(err, errlen, "provider '%s' carries no remote CQ data (immediates)", provider);
        rail_free(r);
        return -FI_ENOSYS;
    }
#define CHECK(call, what)                                                                    \
    do {                                                                                     \
        ret = (call);                                                                        \
        if (ret) {                                                                           \
            set_err(err, errlen, "%s on provider '%s': %s", what, provider, fi_strerror(-ret)); \
            rail_free(r);                                                                    \
            return ret;                                                                      \
        }                                                                                    \
    } while (0)
    CHECK(fi_fabric(fi->fabric_attr, &r->fabric, NULL), "fi_fabric");
    CHECK(fi_domain(r->fabric, fi, &r->domain, NULL), "fi_domain");
    struct fi_cq_attr cqa;
    memset(&cqa, 0, sizeof(cqa));
    cqa.format = FI_CQ_FORMAT_DATA;
    cqa.size = 0;
    cqa.wait_obj = FI_WAIT_FD;
    ret = fi_cq_open(r->domain, &cqa, &r->cq, NULL);
    if (ret == 0) {
        int fd = -1;
        if (fi_control(&r->cq->fid, FI_GETWAIT, &fd) == 0 && fd >= 0) r->wait_fd = fd;
        /* over sockets the CQ's wait set holds the connections' sockets; on verbs or efa it
         * is a completion channel, and re-arming it while spinning would cost interrupts */
        const char *pn = fi->fabric_attr->prov_name ? fi->fabric_attr->prov_name : "";
        r->bytes_fd = r->wait_fd >= 0 && (strstr(pn, "tcp") || strstr(pn, "sockets"));
    } else {
        cqa.wait_obj = FI_WAIT_NONE;
        CHECK(fi_cq_open(r->domain, &cqa, &r->cq, NULL), "fi_cq_open");
    }
    struct fi_av_attr ava;
    memset(&ava, 0, sizeof(ava));
    ava.type = FI_AV_TABLE;
    CHECK(fi_av_open(r->domain, &ava, &r->av, NULL), "fi_av_open");
    CHECK(fi_endpoint(r->domain, fi, &r->ep, NULL), "fi_endpoint");
    CHECK(fi_ep_bind(r->ep, &r->av->fid, 0), "fi_ep_bind(av)");
    CHECK(fi_ep_bind(r->ep, &r->cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
    if (r->is_shm) CHECK(shm_own_endpoint(r), "naming the shm endpoint");
    CHECK(fi_enable(r->ep), "fi_enable");
    r->addr_len = sizeof(r->addr);
    CHECK(fi_getname(&r->ep->fid, r->addr, &r->addr_len), "fi_getname");
    if (r->is_tcp && e->sndbuf > 0) tcp_tune(e, r, NULL); /* the listener: accepted sockets inherit */

    /* op pool */
    r->nops = e->cfg.max_ops;
    r->ops = calloc(r->nops, sizeof(aio_op));
    r->nslots = recv_slots;
    r->slot_size = slot_size;
    r->recv_ops = calloc(recv_slots, sizeof(aio_op));
    r->send_free = calloc(recv_slots, sizeof(uint32_t));
    if (posix_memalign((void **)&r->recv_buf, 4096, (size_t)recv_slots * slot_size)) r->recv_buf = NULL;
    if (posix_memalign((void **)&r->send_buf, 4096, (size_t)recv_slots * slot_size)) r->send_buf = NULL;
    if (!r->ops || !r->recv_ops || !r->send_free || !r->recv_buf || !r->send_buf) {
        set_err(err, errlen, "out of memory for %u message slots of %llu bytes", recv_slots,
                (unsigned long long)slot_size);
        rail_free(r);
        return -FI_ENOMEM;
    }
    memset(r->recv_buf, 0, (size_t)recv_slots * slot_size);
    memset(r->send_buf, 0, (size_t)recv_slots * slot_size);
    for (uint32_t i = 0; i < r->nops; i++) r->ops[i].next_free = (i + 1 < r->nops) ? (int32_t)(i + 1) : -1;
    r->free_head = 0;
    for (uint32_t i = 0; i < recv_slots; i++) {
        r->recv_ops[i].kind = OPK_RECV;
        r->recv_ops[i].slot = i;
        r->recv_ops[i].rail = r->index;
        r->recv_ops[i].group = -1;
        r->send_free[i] = i;
    }
    r->send_nfree = recv_slots;
    uint64_t k1 = (r->mr_mode & FI_MR_PROV_KEY) ? 0 : random_key(r);
    uint64_t k2 = (r->mr_mode & FI_MR_PROV_KEY) ? 0 : random_key(r);
    CHECK(reg_local(r, r->recv_buf, (size_t)recv_slots * slot_size, FI_RECV, &r->recv_mr,
                    &r->recv_desc, k1, AIO_HMEM_SYSTEM, 0),
          "registering receive slots");
    CHECK(reg_local(r, r->send_buf, (size_t)recv_slots * slot_size, FI_SEND, &r->send_mr,
                    &r->send_desc, k2, AIO_HMEM_SYSTEM, 0),
          "registering send slots");
    for (uint32_t i = 0; i < recv_slots; i++) CHECK(post_recv_locked(r, i), "posting receives");
#undef CHECK
    aio_poller *q = &e->pollers[qi];
    if (r->wait_fd >= 0) {
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = r->wait_fd};
        if (epoll_ctl(q->epfd, EPOLL_CTL_ADD, r->wait_fd, &ev) != 0) {
            r->wait_fd = -1;
            r->bytes_fd = 0;
        }
    }
    if (r->wake_fd >= 0) { /* peers wake us through it (see "Owned shm names and wake-ups") */
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = r->wake_fd};
        if (epoll_ctl(q->epfd, EPOLL_CTL_ADD, r->wake_fd, &ev) != 0) {
            close(r->wake_fd);
            r->wake_fd = -1;
        }
    }
    r->poller = qi;
    q->rails[q->nrails++] = r;
    e->rails[e->nrails] = r;
    return e->nrails++;
}

/* Stops and joins the running poller threads. */
static void pollers_join(aio_engine *e) {
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

int aio_engine_start(aio_engine *e) {
    if (e->started) return 0;
    if (e->nrails == 0) return -FI_EINVAL;
    if (e->nl_fd < 0) open_netlink(e);
    for (int i = 0; i < e->npollers; i++) {
        aio_poller *q = &e->pollers[i];
        if (!q->nrails) continue; /* its rail failed to open, and no later one came */
        int ret = pthread_create(&q->thread, NULL, poller_main, q);
        if (ret) {
            pollers_join(e);
            atomic_store(&e->stop, 0);
            return -ret;
        }
        q->running = 1;
    }
    e->started = 1;
    return 0;
}

int aio_engine_num_rails(aio_engine *e) { return e->nrails; }

void aio_engine_destroy(aio_engine *e) {
    if (!e) return;
    pollers_join(e);
    /* endpoints first: nothing can touch memory after this */
    for (int i = 0; i < e->nrails; i++) {
        aio_rail *r = e->rails[i];
        if (r->ep) {
            fi_close(&r->ep->fid);
            r->ep = NULL;
        }
    }
    if (e->dtab) atomic_store(&e->dtab->closed, 1);
    pthread_mutex_lock(&e->mr_mu);
    aio_mr *m = e->mrs;
    while (m) {
        aio_mr *nx = m->next;
        /* peers copying now finish first (a live process stopped mid-copy: give up after 2 s) */
        if (m->direct_slot >= 0) direct_retire(e->dtab, m->direct_slot, 2000000000LL);
        for (int i = 0; i < m->nrails; i++)
            if (m->mr[i]) fi_close(&m->mr[i]->fid);
        free(m);
        m = nx;
    }
    e->mrs = NULL;
    pthread_mutex_unlock(&e->mr_mu);
    for (int i = 0; i < e->nrails; i++) rail_free(e->rails[i]);
    direct_destroy(e);
    while (e->ovf_head) {
        overflow_node *x = e->ovf_head;
        e->ovf_head = x->next;
        if (!x->reserve) free(x);
    }
    free(e->ovf_block);
    close(e->efd);
    for (int i = 0; i < e->npollers; i++) {
        close(e->pollers[i].kick_fd);
        close(e->pollers[i].epfd);
        pthread_mutex_destroy(&e->pollers[i].qmu);
        free(e->pollers[i].stash);
    }
    if (e->nl_fd >= 0) close(e->nl_fd);
    free(e->ring);
    free(e->groups);
    free(e->cslots);
    free(e->watches);
    pthread_mutex_destroy(&e->watch_mu);
    pthread_mutex_destroy(&e->ring_mu);
    pthread_mutex_destroy(&e->groups_mu);
    pthread_mutex_destroy(&e->cnt_mu);
    pthread_mutex_destroy(&e->mr_mu);
    pthread_mutex_destroy(&e->dmu);
    free(e);
}

int aio_rail_get_info(aio_engine *e, int rail, aio_rail_info *o) {
    if (rail < 0 || rail >= e->nrails) return -FI_EINVAL;
    aio_rail *r = e->rails[rail];
    struct fi_info *fi = r->info;
    memset(o, 0, sizeof(*o));
    snprintf(o->provider, sizeof(o->provider), "%s", fi->fabric_attr->prov_name);
    snprintf(o->domain, sizeof(o->domain), "%s", fi->domain_attr->name);
    snprintf(o->fabric, sizeof(o->fabric), "%s", fi->fabric_attr->name);
    o->mr_mode = r->mr_mode;
    o->mode = r->mode;
    o->max_msg_size = fi->ep_attr->max_msg_size;
    o->inject_size = fi->tx_attr->inject_size;
    o->mr_key_size = fi->domain_attr->mr_key_size;
    o->cq_data_size = r->cq_data_size;
    o->has_wait_fd = r->wait_fd >= 0;
    o->tx_size = (uint32_t)fi->tx_attr->size;
    o->rx_size = (uint32_t)fi->rx_attr->size;
    o->recv_slots = r->nslots;
    o->slot_size = r->slot_size;
    o->caps = fi->caps;
    o->addr_len = (uint32_t)r->addr_len;
    memcpy(o->addr, r->addr, r->addr_len);
    return 0;
}

/* What the rail keeps per peer address (how to wake it, tuning tries, the hand-over flag):
 * reset when the address is removed or reused. Caller holds r->mu. */
static void addr_forget(aio_rail *r, fi_addr_t fa) {
    if (fa < r->wcap) shm_wpeer_forget(&r->wpeers[fa]);
    if (fa < r->tune_cap) r->tune_tries[fa] = 0;
    defer_set(r, fa, 0);
}

int aio_av_insert(aio_engine *e, int rail, const void *addr, size_t len, uint64_t *fi_addr) {
    if (rail < 0 || rail >= e->nrails || !addr || len == 0) return -FI_EINVAL;
    aio_rail *r = e->rails[rail];
    fi_addr_t fa = FI_ADDR_NOTAVAIL;
    pthread_mutex_lock(&r->mu);
    int ret = fi_av_insert(r->av, addr, 1, &fa, 0, NULL);
    if (ret == 1) addr_forget(r, fa); /* a reused address starts afresh */
    pthread_mutex_unlock(&r->mu);
    if (ret != 1) return ret < 0 ? ret : -FI_EINVAL;
    *fi_addr = fa;
    return 0;
}

int aio_av_remove(aio_engine *e, int rail, uint64_t fi_addr) {
    if (rail < 0 || rail >= e->nrails) return -FI_EINVAL;
    aio_rail *r = e->rails[rail];
    fi_addr_t fa = fi_addr;
    pthread_mutex_lock(&r->mu);
    int ret = fi_av_remove(r->av, &fa, 1, 0);
    addr_forget(r, fa);
    pthread_mutex_unlock(&r->mu);
    return ret;
}

/* ------------------------------------------------------------------ memory */

int aio_mr_register(aio_engine *e, void *buf, uint64_t len, uint32_t access, aio_mr **out,
                    char *err, size_t errlen) {
    return aio_mr_register_dev(e, buf, len, access, AIO_HMEM_SYSTEM, 0, out, err, errlen);
}

int aio_rail_hmem(aio_engine *e, int rail) {
    if (rail < 0 || rail >= e->nrails) return 0;
    return (e->rails[rail]->info->caps & FI_HMEM) ? 1 : 0;
}

int aio_mr_register_dev(aio_engine *e, void *buf, uint64_t len, uint32_t access, int iface,
                        int device, aio_mr **out, char *err, size_t errlen) {
    if (iface != AIO_HMEM_SYSTEM && iface != AIO_HMEM_CUDA) {
        set_err(err, errlen, "unknown memory interface %d", iface);
        return -FI_EINVAL;
    }
    if (iface != AIO_HMEM_SYSTEM)
        for (int i = 0; i < e->nrails; i++)
            if (!aio_rail_hmem(e, i)) {
                set_err(err, errlen, "NIC %d (%s) cannot register device memory (no FI_HMEM)", i,
                        e->rails[i]->info->domain_attr->name);
                return -FI_EOPNOTSUPP;
            }
    if (!buf || len == 0) {
        set_err(err, errlen, "cannot register an empty buffer");
        return -FI_EINVAL;
    }
    aio_mr *m = calloc(1, sizeof(*m));
    if (!m) return -FI_ENOMEM;
    m->buf = buf;
    m->len = len;
    m->access = access;
    m->direct_slot = -1;
    uint64_t acc = FI_READ | FI_WRITE | FI_SEND | FI_RECV;
    if (access & AIO_ACCESS_REMOTE_WRITE) acc |= FI_REMOTE_WRITE;
    if (access & AIO_ACCESS_REMOTE_READ) acc |= FI_REMOTE_READ;
    for (int i = 0; i < e->nrails; i++) {
        aio_rail *r = e->rails[i];
        int ret = -FI_ENOKEY;
        pthread_mutex_lock(&r->mu);
        for (int attempt = 0; attempt < 8 && ret == -FI_ENOKEY; attempt++) {
            uint64_t key = (r->mr_mode & FI_MR_PROV_KEY) ? 0 : random_key(r);
            ret = reg_local(r, buf, len, acc, &m->mr[i], &m->desc[i], key, iface, device);
        }
        pthread_mutex_unlock(&r->mu);
        if (ret) {
            set_err(err, errlen, "registering %llu bytes on NIC %d (%s): %s",
                    (unsigned long long)len, i, r->info->domain_attr->name, fi_strerror(-ret));
            for (int j = 0; j < i; j++) {
                pthread_mutex_lock(&e->rails[j]->mu);
                fi_close(&m->mr[j]->fid);
                pthread_mutex_unlock(&e->rails[j]->mu);
            }
            free(m);
            return ret;
        }
        m->key[i] = fi_mr_key(m->mr[i]);
        m->base[i] = (r->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)buf : 0;
        m->nrails = i + 1;
    }
    pthread_mutex_lock(&e->mr_mu);
    m->next = e->mrs;
    if (e->mrs) e->mrs->prev = m;
    e->mrs = m;
    if (e->dtab && iface == AIO_HMEM_SYSTEM && (access & (AIO_ACCESS_REMOTE_WRITE | AIO_ACCESS_REMOTE_READ)))
        m->direct_slot = direct_publish(e, m);
    pthread_mutex_unlock(&e->mr_mu);
    *out = m;
    return 0;
}

uint64_t aio_mr_key(aio_mr *m, int rail) { return (rail >= 0 && rail < m->nrails) ? m->key[rail] : 0; }
uint64_t aio_mr_remote_base(aio_mr *m, int rail) {
    return (rail >= 0 && rail < m->nrails) ? m->base[rail] : 0;
}
int64_t aio_mr_inflight(aio_mr *m) { return atomic_load(&m->inflight); }

/* A region whose unregister gave up (RegionBusy) stays fully usable: aio_mr_close cleared its
 * slot's key at its first attempt (new direct copies refused, so that the copies in flight
 * drain); this publishes the key again, as direct_publish did. Copies refused meanwhile failed
 * at their initiator (RemoteAccessError), as they would have had the region been retired. */
int aio_mr_reopen(aio_engine *e, aio_mr *m) {
    if (m->direct_slot < 0) return 0;
    int first = -1;
    for (int i = 0; i < m->nrails && first < 0; i++)
        if (e->rails[i]->is_shm) first = i;
    if (first < 0) return -FI_EINVAL;
    direct_slot *s = &e->dtab->slots[m->direct_slot];
    atomic_store(&s->key, m->key[first]); /* base, len, access are unchanged since publish */
    return 0;
}

int aio_mr_close(aio_engine *e, aio_mr *m) {
    if (atomic_load(&m->inflight) > 0) return -FI_EBUSY;
    if (m->direct_slot >= 0) {
        int rc = direct_retire(e->dtab, m->direct_slot, 200000);
        if (rc) return rc;
        direct_unpublish(e, m);
    }
    pthread_mutex_lock(&e->mr_mu);
    if (m->prev) m->prev->next = m->next; else e->mrs = m->next;
    if (m->next) m->next->prev = m->prev;
    pthread_mutex_unlock(&e->mr_mu);
    for (int i = 0; i < m->nrails; i++) {
        pthread_mutex_lock(&e->rails[i]->mu);
        fi_close(&m->mr[i]->fid);
        pthread_mutex_unlock(&e->rails[i]->mu);
    }
    free(m);
    return 0;
}

/* ------------------------------------------------------------------ posting */

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
    if (r->is_shm) shm_wake(r, it->peer);
    return ret;
}

static ssize_t post_one(aio_rail *r, const aio_op_desc *it, aio_op *op) {
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
    if (r->is_shm) shm_wake(r, it->peer);
    return ret;
}

/* While a post waits for room (queue full): drives the rail once. 0 when the caller should
 * give up for now: the deadline passed, or no completion came back for POST_IDLE_NS (the
 * queue frees only as completions return; spinning longer burns the CPU the peer and the
 * kernel need, and the loop waits for room cheaply with aio_want_space). Caller holds r->mu. */
static int post_progress(aio_engine *e, aio_rail *r, int64_t deadline, int64_t *idle) {
    int got = progress_locked(e, r);
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
    aio_rail *r; /* the rail whose lock is held, or NULL */
    int posts;   /* requests posted under this hold */
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
    return 1;
}

/* A request to `peer` went to the rail's provider (caller holds the rail's lock): its tcp
 * connection's send buffer is set (at the first posts), and requests to it may be handed to
 * the poller again. */
static void posted_to(aio_engine *e, aio_rail *r, uint64_t peer) {
    if (r->is_tcp && e->sndbuf > 0) tcp_tune_peer(e, r, peer);
    defer_set(r, peer, 1);
}

/* Takes an op for `it` and counts it in flight (group, region, engine). */
static aio_op *op_start(aio_engine *e, aio_rail *r, int64_t g, aio_mr *m, const aio_op_desc *it) {
    aio_op *op = op_get(r);
    if (!op) return NULL;
    op->kind = it->op == AIO_OP_READ ? OPK_READ : OPK_WRITE;
    op->rail = it->rail;
    op->group = g;
    op->mr = m;
    op->peer = it->peer;
    aio_group *gr = &e->groups[g];
    atomic_fetch_add(&m->inflight, 1);
    atomic_fetch_add(&gr->posted, 1);
    atomic_fetch_add(&gr->outstanding, 1);
    inflight_add(e, r, 1);
    return op;
}

/* Posts one request into group g: 1 posted, 0 no room before the deadline (nothing
 * posted), negative: an error for this request (nothing posted). Takes the rail's lock into
 * `h` (kept for the caller's next request; the caller releases it). */
static int post_item_g(aio_engine *e, int64_t g, const aio_op_desc *it, const uint64_t *gather,
                       int ngather, int64_t deadline, rail_hold *h) {
    if (it->rail < 0 || it->rail >= e->nrails || !it->mr ||
        (it->op != AIO_OP_WRITE && it->op != AIO_OP_READ))
        return -FI_EINVAL;
    aio_mr *m = it->mr;
    if (it->offset > m->len || it->length > m->len - it->offset) return -FI_EINVAL;
    /* a direct copy: one local piece, at least one byte (a bare immediate goes the provider's way) */
    int direct = it->direct != 0 && ngather <= 1 && it->length > 0;
    if (it->direct != 0 && ((it->direct >> 16) < 1 || (it->direct >> 16) > atomic_load(&e->ndpeers) ||
                            (it->direct & 0xffff) >= AIO_DIRECT_SLOTS ||
                            !e->dpeers[(it->direct >> 16) - 1].t))
        return -FI_EINVAL;
    if (it->direct != 0 && !direct) {
        /* a request to a same-host peer that is no copy: several gathered pieces (never formed
         * for a direct route, see aio_post_paged) or a bare immediate: the slot's checks here */
        int rc = direct_check(e, it);
        if (rc) return rc;
    }
    aio_group *gr = &e->groups[g];
    aio_rail *r = e->rails[it->rail];
    aio_op *op;
    /* by default only on tcp, whose poller pushes bytes into sockets under the rail's lock: on
     * shm, handing 64 KiB writes to the poller cut them to a third (the poller then queues every
     * write into the target's shm queue itself, against the target's lock). On tcp a write of
     * HAND_MIN_BYTES or more is always handed: copied in the posting thread, a batch of 16 writes
     * of 1 MiB held the posting call for 75 us on average and up to 430 us (a Python event
     * loop), and that thread became the bottleneck at 64 KiB and 16 MiB (aiote bench, 2 vCPUs) */
    int hand = atomic_load_explicit(&e->hand_posts, memory_order_relaxed);
    int how = HOLD_WAIT;
    if (hand >= 0 && !direct && ngather <= 1 && defer_get(r, it->peer)) {
        if (hand > 0)
            how = HOLD_NONE;
        else if (r->is_tcp)
            how = it->op == AIO_OP_WRITE && it->length >= HAND_MIN_BYTES ? HOLD_HAND : HOLD_TRY;
    }
    if (!hold_rail(h, r, how)) {
        /* the poller holds the rail (it is moving data): it posts this request when it is done */
        if ((op = op_start(e, r, g, m, it))) {
            direct_enqueue(e, op, it, 1);
            return 1;
        }
        hold_rail(h, r, HOLD_WAIT); /* no op free: wait for the lock, and drive completions, as below */
    }
    int64_t idle = 0; /* when the self-driven progress found nothing for POST_IDLE_NS: give up */
    while (!(op = op_start(e, r, g, m, it))) {
        if (!post_progress(e, r, deadline, &idle)) break;
    }
    if (!op) return 0;
    h->posts++;
    ssize_t ret = 0;
    if (direct) {
        direct_enqueue(e, op, it, 0); /* the poller copies (aio_post kicks it) */
    } else {
        for (;;) {
            ret = ngather > 1 ? post_gather(r, it, gather, ngather, op) : post_one(r, it, op);
            if (ret != -FI_EAGAIN) break;
            if (!post_progress(e, r, deadline, &idle)) break;
        }
        if (!ret) posted_to(e, r, it->peer);
    }
    if (ret) {
        atomic_fetch_sub(&m->inflight, 1);
        atomic_fetch_sub(&gr->posted, 1);
        atomic_fetch_sub(&gr->outstanding, 1);
        inflight_add(e, r, -1);
        op_put(r, op);
    }
    if (ret == -FI_EAGAIN) return 0;
    return ret ? (int)ret : 1;
}

static int group_postable(aio_engine *e, int64_t g) {
    return g >= 0 && (uint32_t)g < e->cfg.max_groups && e->groups[g].in_use &&
           !atomic_load(&e->groups[g].sealed);
}

int64_t aio_post(aio_engine *e, int64_t g, const aio_op_desc *items, int64_t n, int64_t budget_ns) {
    if (!group_postable(e, g)) return -FI_EINVAL;
    int64_t deadline = now_ns() + budget_ns;
    int64_t i = 0;
    int rc = 0;
    rail_hold h = {0};
    uint32_t mask = 0; /* the rails posted to: their pollers are kicked */
    for (; i < n; i++) {
        rc = post_item_g(e, g, &items[i], NULL, 1, deadline, &h);
        if (rc <= 0) break;
        mask |= 1u << items[i].rail;
        if (items[i].direct) mask |= 1u; /* a direct copy may be queued for poller 0 (rail 0's) */
    }
    release_rail(&h);
    if (i > 0) kick_rails(e, mask);
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

int aio_group_quiet(aio_engine *e, int64_t g, int quiet) {
    if (g < 0 || (uint32_t)g >= e->cfg.max_groups || !e->groups[g].in_use || atomic_load(&e->groups[g].sealed))
        return -FI_EINVAL;
    e->groups[g].quiet = quiet ? 1 : 0;
    return 0;
}

int64_t aio_submit_quiet(aio_engine *e, uint64_t token, const aio_op_desc *items, int64_t n,
                         int64_t budget_ns, int64_t *group) {
    return submit(e, token, items, n, budget_ns, group, 1);
}

/* a*b+c <= limit without overflow */
static int fits(uint64_t a, uint64_t b, uint64_t c, uint64_t limit) {
    if (b && a > (UINT64_MAX - c) / b) return 0;
    return a * b + c <= limit;
}

int64_t aio_post_paged(aio_engine *e, int64_t g, const aio_paged_desc *d, int64_t start, int64_t n,
                       int64_t budget_ns) {
    if (!group_postable(e, g) || !d || !d->mr || d->nroutes < 1 || d->nroutes > AIO_MAX_RAILS ||
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
     * pages as one weight, so it is only formed when the weight can travel */
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
        if (r && d->gather && !rt->direct) {
            limit = (int)r->iov_limit;
            if ((d->flags & AIO_F_DATA) && r->cq_data_size < 8) limit = 1;
        }
        int cnt = 0;
        uint64_t dst0 = 0;
        for (; cnt < limit && k + cnt < n; cnt++) {
            int64_t si = d->src_pages[k + cnt], di = d->dst_pages[k + cnt];
            if (si < 0 || di < 0 ||
                !fits((uint64_t)si, d->src_stride, d->src_offset + d->page_size, m->len) ||
                !fits((uint64_t)di, d->dst_stride, d->dst_offset + d->page_size, d->remote_len)) {
                if (cnt == 0) rc = -FI_EINVAL;
                break;
            }
            uint64_t dst = d->dst_offset + (uint64_t)di * d->dst_stride;
            if (cnt == 0) dst0 = dst;
            else if (dst != dst0 + (uint64_t)cnt * d->page_size) break;
            gather[cnt] = d->src_offset + (uint64_t)si * d->src_stride;
        }
        if (cnt == 0) break;
        it.offset = gather[0];
        it.rail = rt->rail;
        it.peer = rt->peer;
        it.rkey = rt->rkey;
        it.direct = rt->direct;
        it.raddr = rt->rbase + dst0;
        it.data = d->data;
        if ((d->flags & AIO_F_DATA) && cnt > 1) it.data = (d->data & 0xffffffffULL) | (((uint64_t)cnt * AIO_CREDIT_UNIT) << 32);
        rc = post_item_g(e, g, &it, gather, cnt, deadline, &h);
        if (rc <= 0) break;
        mask |= 1u << it.rail;
        k += cnt;
        req++;
    }
    release_rail(&h);
    if (k > start) kick_rails(e, mask);
    if (k == start && rc < 0) return rc;
    return k - start;
}

int aio_post_sendv(aio_engine *e, int64_t g, int rail, uint64_t peer, const void *head, uint64_t hlen,
                   const void *body, uint64_t blen, int64_t budget_ns) {
    if (rail < 0 || rail >= e->nrails || !group_postable(e, g)) return -FI_EINVAL;
    aio_rail *r = e->rails[rail];
    uint64_t len = hlen + blen;
    if (hlen > r->slot_size || blen > r->slot_size || len > r->slot_size) return -FI_EMSGSIZE;
    int64_t deadline = now_ns() + budget_ns;
    pthread_mutex_lock(&r->mu);
    aio_op *op = NULL;
    for (;;) {
        if (r->send_nfree > 0 && (op = op_get(r))) break;
        progress_locked(e, r);
        if (now_ns() >= deadline) break;
    }
    if (!op) {
        pthread_mutex_unlock(&r->mu);
        kick_rails(e, 1u << rail);
        return 0;
    }
    uint32_t slot = r->send_free[--r->send_nfree];
    char *sbuf = r->send_buf + (uint64_t)slot * r->slot_size;
    /* the slot and the op are ours alone now: copy without the rail's lock, so the poller
     * drives the rail meanwhile (a large message is a long copy) */
    pthread_mutex_unlock(&r->mu);
    if (hlen) memcpy(sbuf, head, hlen);
    if (blen) memcpy(sbuf + hlen, body, blen);
    op->kind = OPK_SEND;
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
        ret = fi_send(r->ep, sbuf, len, r->send_desc, peer, &op->ctx);
        if (r->is_shm) shm_wake(r, peer);
        if (ret != -FI_EAGAIN) break;
        progress_locked(e, r);
        if (now_ns() >= deadline) break;
    }
    if (!ret) posted_to(e, r, peer);
    if (ret) {
        atomic_fetch_sub(&e->groups[g].posted, 1);
        atomic_fetch_sub(&e->groups[g].outstanding, 1);
        inflight_add(e, r, -1);
        r->send_free[r->send_nfree++] = slot;
        op_put(r, op);
        pthread_mutex_unlock(&r->mu);
        kick_rails(e, 1u << rail);
        return ret == -FI_EAGAIN ? 0 : (int)ret;
    }
    pthread_mutex_unlock(&r->mu);
    kick_rails(e, 1u << rail);
    return 1;
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
    int ret = post_recv_locked(r, slot);
    pthread_mutex_unlock(&r->mu);
    kick_rails(e, 1u << rail);
    return ret;
}

uint64_t aio_loop_polls(aio_engine *e) { return atomic_load(&e->st_loop_polls); }

void aio_get_stats(aio_engine *e, aio_stats *o) {
    o->polls = atomic_load(&e->st_polls);
    o->sleeps = atomic_load(&e->st_sleeps);
    o->wakeups_sent = atomic_load(&e->st_wakeups);
    o->completions = atomic_load(&e->st_completions);
    o->remote_data = atomic_load(&e->st_remote);
    o->errors = atomic_load(&e->st_errors);
    o->spin_window_ns = (uint64_t)atomic_load(&e->st_adapt);
    o->direct_ops = atomic_load(&e->st_direct);
    o->direct_mapped = atomic_load(&e->st_mapped);
    o->tcp_tuned = atomic_load(&e->st_tuned);
    o->posts_handed = atomic_load(&e->st_handed);
    o->posts_handed_waited = atomic_load(&e->st_handed_waited);
}

int aio_engine_set_hand_posts(aio_engine *e, int mode) {
    if (mode < -1 || mode > 1) return -FI_EINVAL;
    atomic_store(&e->hand_posts, mode);
    return 0;
}
