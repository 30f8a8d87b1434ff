/* aiote C core, internal: the structs its parts share, the constants that size them, and a
 * few inline helpers. None of it is API: aiote_core.h is, and it is all the cffi binding sees.
 *
 * The core is cut by concern, one file each; each opens with its theory of operation, and
 * declares what it offers the other files in a header of the same name (core/ring.h for
 * core/ring.c, ...): functions named aio__*, of hidden visibility (AIO_INTERNAL), so that the
 * extension exports the API alone and calls between the files stay direct calls.
 *
 *   engine.c        the engine's life (create, start, destroy), errors; the threads and locks
 *   fabric.c        libfabric's first call (FI_PROVIDER), hints, probing, NIC addresses
 *   rail.c          one rail: fabric, domain, CQ, address vector, endpoint, message slots
 *   memory.c        regions registered on every rail, their keys
 *   poller.c        the poller threads: adaptive spin, sleep on wait objects, kicks
 *   completion.c    reading a rail's CQ: the op pool, completed ops, receives, immediates
 *   ring.c          the completion ring and its eventfd; the loop thread's low-latency wait
 *   groups.c        groups: requests that finish as one record
 *   post.c          posting: aio_post, aio_submit, paged writes, messages; rail holds
 *   handoff.c       the poller's queue: requests handed over by posters, queued direct copies
 *   direct_table.c  same-host direct copies: region tables, attach and detach, arenas
 *   direct_copy.c   same-host direct copies: the copies themselves (poller 0)
 *   copier.c        large copies in parts: poller 0 and the engine's helper threads
 *   counters.c      immediate counters: credits, takes, watches
 *   watch.c         watched 64-bit words (GPU completion flags, UVM watcher slots)
 *   link.c          the link state of tcp rails' interfaces (netlink)
 *   tcp_tune.c      the send buffers of the tcp provider's own sockets
 *   shm_wake.c      shm endpoints' owned names, the stale-file sweep, peers' wake-ups
 *   stats.c         aio_get_stats
 * (engine.c, counters.c and stats.c offer the others nothing beyond the API: no header.)
 *
 * Threads. Posting threads (an event loop's, or any the application posts from), the loop's
 * drain (aio_drain, aio_arm, aio_poll_ring), and the engine's poller threads (poller.c). No
 * thread here ever takes the Python GIL.
 *
 * Locks, and what may be taken while one is held (nothing else is):
 *   a rail's mu (every libfabric call on that rail: FI_THREAD_DOMAIN, we serialize)
 *       -> the rail's pool_mu, a poller's qmu, groups_mu, cnt_mu, ring_mu
 *   watch_mu -> cnt_mu, ring_mu (a credit lane's entries are credited under watch_mu)
 *   pool_mu, qmu, groups_mu, cnt_mu, ring_mu, mr_mu, dmu, fine_mu, shm_wake.c's own_mu -> nothing
 *   (groups_mu and cnt_mu are let go before a record is pushed).
 * No thread holds two rails' locks at once (a rail hold is let go before another is taken). */
#ifndef AIOTE_CORE_INTERNAL_H
#define AIOTE_CORE_INTERNAL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "../aiote_core.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

/* Functions one file of the core offers the others: not exported by the extension, and called
 * directly (no PLT) from the other files. */
#define AIO_INTERNAL __attribute__((visibility("hidden")))

#define OPK_WRITE 1
#define OPK_READ 2
#define OPK_SEND 3
#define OPK_RECV 4

typedef struct aio_op {
    struct fi_context2 ctx; /* first: FI_CONTEXT / FI_CONTEXT2 mode */
    int32_t kind;
    int32_t rail;
    int64_t group;
    aio_mr *mr;
    uint32_t slot;
    int32_t next_free;
    /* a direct same-host copy, queued for the poller (see aio__direct_run) */
    struct aio_op *dnext;
    aio_op_desc d;
    int32_t dstatus; /* the copy's result, once made */
    int32_t dcopied;
    int32_t dpost; /* not a copy: a request the poller posts to the rail's provider (see post.c) */
    int32_t dmerged; /* a copied write whose immediate a later op of its run carries (aio__direct_batch) */
    int64_t dsince; /* dpost: when the provider first refused it for room (0: not yet) */
    /* a strided copy (aio_post_paged's pages to a direct route): dpieces > 1 pieces of
     * d.length / dpieces bytes, the i-th at d.offset + i * dstride of the local region, into
     * d.length contiguous remote bytes. 0 or 1: one contiguous piece */
    uint32_t dpieces;
    uint64_t dstride;
    uint64_t peer;  /* a write's or read's peer (aio__complete_op: a failure stops deferrals to it) */
    uint64_t bytes; /* a write's or read's bytes, counted in its rail's bytes_inflight (0: none) */
} aio_op;

/* The direct-copy table (see aiote_core.h, "Direct same-host copies", and direct_table.c).
 * Shared by processes: fixed layout. */
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
    uint64_t checked;    /* poller 0's aio__direct_run pass that last checked it is alive */
    char *amap;          /* its arena, mapped here (NULL: none), ... */
    uint64_t abase;      /* ... which is at abase in its process, */
    uint64_t alen;       /* alen bytes long */
} direct_peer;

/* The hand-over flags of a rail's peers (see handoff.h): in chunks of DEFER_CHUNK addresses,
 * for addresses below DEFER_PEERS. */
#define DEFER_CHUNK 256
#define DEFER_PEERS 65536

typedef struct aio_rail {
    pthread_mutex_t mu;
    pthread_mutex_t pool_mu;      /* the op pool only (aio__op_get, aio__op_put): innermost, held briefly */
    _Atomic int32_t ndeferred;    /* requests queued for the poller to post (post.c) */
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
    int is_tcp;           /* the tcp provider: its sockets' send buffers are set (aio__tcp_tune) */
    /* shm wake-ups (see shm_wake.c): ours, and our peers' (per fi_addr) */
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
    _Atomic uint64_t bytes_inflight; /* bytes of our writes and reads posted on it, not completed */
} aio_rail;

/* How to wake one peer of an shm rail (shm_wake.c). */
typedef struct shm_wpeer {
    int state; /* 0: not looked up, 1: fd and word valid, -1: cannot be woken (not aiote's) */
    int fd;
    _Atomic uint32_t *word;
    int lockfd; /* looked up (state != 0): the owner's aiote-<token>.lock, or -1 (not aiote's) */
    int dead;   /* its owner's process was found gone (shm_wake.c, aio__shm_peer_gone) */
} shm_wpeer;

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
    volatile uint64_t *lane; /* a credit lane (watch.c): word is its head; NULL: a plain word */
    uint32_t entries;        /* the lane's entries */
} watch_slot;

typedef struct overflow_node {
    aio_record rec;
    struct overflow_node *next;
    int reserve; /* from the engine's reserve block (ovf_block): goes back there, not to free() */
} overflow_node;

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
    uint64_t drun;              /* aio__direct_run passes (poller 0's tell aio__direct_copy its pass) */
    aio_record *stash;          /* records the ring could not take (see RING_STASH); poller only */
    int nstash;
    int signal_due;             /* a record of this poller's awaits its eventfd signal (ring.c) */
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
    /* the loop thread's CPU at its last aio_drain and when (follow_loop: poller.c) */
    _Atomic int32_t loop_cpu;
    _Atomic int64_t loop_seen;
    _Atomic int32_t st_follow_cpu;
    _Atomic uint64_t st_follow_moves;

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
    _Atomic int32_t nwant;      /* counters with an armed watch (a task awaits an immediate), plus
                                 * tasks awaiting a message (aio_waiters_add) */
    _Atomic int32_t ncwant;     /* counters with an armed watch alone (credit lanes: poller.c) */
    _Atomic int32_t msg_rail;   /* the rail the last message came in on (aio_waiters_add kicks its poller) */
    _Atomic int32_t quiet_waiters; /* tasks awaiting a quiet group's record (aio_quiet_waiters) */
    /* low-latency waits (aio_poll_ring) made by the loop thread */
    _Atomic uint64_t st_loop_polls;

    /* watched words */
    pthread_mutex_t watch_mu;
    watch_slot *watches;     /* AIO_MAX_WATCHES, allocated on first use */
    int32_t watch_hi;        /* slots [0, watch_hi) may be in use */
    _Atomic int32_t nwatch;
    _Atomic int32_t nlane;   /* of them, credit lanes */
    /* a watched word is expected to change in [fine_from, fine_until) (CLOCK_MONOTONIC ns):
     * poller 0 reads the words every WATCH_FINE_US then (aio_watch_soon) */
    _Atomic int64_t fine_from;
    _Atomic int64_t fine_until;
    pthread_mutex_t fine_mu; /* aio_watch_soon's writers, one at a time (the poller reads without it) */

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
    _Atomic uint64_t st_split; /* arena copies made in parts (copier.c) */
    _Atomic uint64_t st_in_place; /* messages sent from the caller's buffer (post.c) */
    struct aio_copier *copier; /* the helpers of large copies, started by poller 0 (copier.c) */
    int copier_failed;
    int copy_threads; /* threads that make one large copy: poller 0 and copy_threads - 1 helpers */
    int afd; /* the arena's memfd (aio_engine_set_arena), -1: none */

    /* tcp send buffers (aio_engine_set_tcp_sndbuf) */
    int32_t sndbuf;
    int sndbuf_all;
    _Atomic int sndbuf_got; /* SO_SNDBUF as the kernel reported it after the last setting */
    _Atomic uint64_t st_tuned;
    _Atomic uint64_t st_handed;  /* requests handed to the poller to post (post.c) */
    _Atomic uint64_t st_handed_waited; /* ... of which the provider refused for room at first */
    _Atomic uint64_t st_gone;    /* requests not posted: their shm peer's process is gone */
    _Atomic int32_t hand_posts;  /* aio_engine_set_hand_posts */

    /* stats */
    _Atomic uint64_t st_polls, st_sleeps, st_wakeups, st_completions, st_remote, st_errors;
    _Atomic int64_t st_adapt; /* the poller's adaptive spin window (0: the base) */
};

AIO_INTERNAL void aio__set_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

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

/* Counts d ops in flight on rail r: in the engine, and for the rail's poller (its spin). */
static inline void inflight_add(aio_engine *e, aio_rail *r, int64_t d) {
    atomic_fetch_add(&e->ops_in_flight, d);
    atomic_fetch_add(&e->pollers[r->poller].inflight, d);
}

#endif
