/* aiote_cbench, internal: what the bench's files share. Not part of the core, and none of it
 * is API: the constants of a run, the options (opts_t), one process's side of a run (side_t)
 * and the region descriptors the two sides exchange (peer_info), and the functions one file
 * offers the others. Everything else stays static in its file.
 *
 *   aiote_cbench.c  the command line and main: fork or connect, then one run
 *   cb_util.c       die, CPU time, the control channel's whole reads and writes, the peer's exit
 *   cb_side.c       one side on the core: engine, region, descriptor exchange, drain and wait,
 *                   requests, posting, messages
 *   cb_modes.c      the throughput runs: write, read, paged, sendrecv
 *   cb_pingpong.c   the latency runs: pingpong, msgpingpong
 *   cb_fan.c        the fan run: several senders each writing to several receivers at once
 *   cb_sockets.c    the bare-sockets baseline; --listen and --connect's control socket */
#ifndef AIOTE_CBENCH_H
#define AIOTE_CBENCH_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "../aiote_core.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define U AIO_CREDIT_UNIT
#define IMM_WARM 0xA0
#define IMM_MAIN 0xB0
#define IMM_PING 0xC0
#define IMM_PONG 0xC1
#define MSG_SLOTS 16 /* the engine's default message_slots */
#define PAGED_BUDGET_NS 200000 /* as the engine's post_budget_us default */
#define NREC 256
#define MAX_BATCH 1024 /* --batch */
#define MAX_STREAMS 8  /* --streams */

typedef struct opts {
    const char *mode;
    const char *provider;
    const char *nic;
    int64_t spin_ns;
    int64_t busy_spin_ns;
    int busy;
    uint64_t size, window, total, slots;
    uint64_t batch; /* write, read: requests per group, posted in one aio_post call (--batch) */
    int small_pages; /* --small-pages: no transparent huge pages for the region */
    int arena;       /* --arena: the region in a published arena (aiote's Engine.alloc_host) */
    int no_direct;   /* --no-direct: shm READs through the provider (aiote: same_host_direct=False) */
    int hand;        /* --hand N: aio_engine_set_hand_posts (0: the core's default) */
    int streams;     /* --streams N: rails on the NIC (write, read: request k on rail k % N) */
    int pollers;     /* --pollers N: aio_engine_set_pollers (0: the core's default, one) */
    int copy_threads; /* --copy-threads N: aio_engine_set_copy_threads (0: the core's default) */
    int64_t sndbuf;  /* --sndbuf N: tcp send buffers (aio_engine_set_tcp_sndbuf; -1: the core's default) */
    uint64_t iters, warmup;
    uint64_t page_size, npages, calls;
    int no_gather; /* paged: post page by page, in the given order */
    uint64_t msg_slots;  /* sendrecv / msgpingpong: message slots per side */
    int copy_out;        /* --copy-out: each message copied out of its slot before the repost */
    int in_place;        /* --in-place: each message over 16 KiB sent from its buffer (aio_post_sendv_ref) */
    int listen_port;     /* -1: fork the peer; else serve as the peer on this port */
    const char *connect; /* HOST:PORT of a --listen peer, or NULL */
    int await_write; /* pingpong: each side waits for its write's completion before going on */
    int64_t loop_poll_ns; /* --loop-poll-ns N: wait as aiote's low-latency setting does */
    int64_t think_ns;     /* --think-ns N: pingpong: busy work after each wait (an application's) */
    int64_t start_at_ns;  /* --start-at NS: write: the timed part starts at this CLOCK_REALTIME time */
    int senders, receivers; /* fan: --senders S --receivers R processes */
} opts_t;

typedef struct peer_rail {
    uint32_t addr_len;
    uint8_t addr[AIO_MAX_ADDR];
    uint64_t base, key;
} peer_rail;

typedef struct peer_info {
    int32_t nrails; /* --streams: both sides open the same number */
    peer_rail rail[MAX_STREAMS];
    uint64_t len;
    aio_direct_info direct; /* the region table, where direct same-host copies are on */
    int32_t direct_slot;    /* -1: none */
    int32_t pad;
} peer_info;

typedef struct side {
    aio_engine *e;
    int rail;   /* the first rail (paged, sends, ping-pong) */
    int nrails; /* --streams */
    int efd;
    uint64_t peer; /* the peer on the first rail */
    uint64_t peers[MAX_STREAMS];
    uint8_t *buf;
    uint64_t len;
    aio_mr *mr;
    peer_info remote;
    int rfd, wfd;
    int busy;
    int64_t loop_poll_ns; /* > 0: wait with aio_poll_ring (the loop thread drives the CQs) */
    uint64_t arena_len; /* buf is an arena mapping of this length (munmap, not free); 0: not */
    int32_t direct; /* aio_op_desc.direct of our READs and writes (0: through the provider; the
                       core makes writes directly only into the peer's arena) */
    uint64_t groups_done;
    uint64_t wakeups; /* eventfd polls that returned readable */
    uint64_t polls;   /* eventfd polls */
    int64_t post_ns, post_max_ns; /* time spent inside aio_post */
    uint64_t post_calls;
    uint64_t msgs, msg_bytes; /* messages received (AIO_REC_RECV), their bytes */
    int copy_out;             /* copy each message into a fresh allocation, as Engine.recv does */
    int in_place;             /* send each message from s->buf, not copied into a send slot */
    uint64_t copy_sum;        /* a byte of each copy (the copies cannot be optimized away) */
    uint64_t copied;          /* bytes copied out */
} side_t;

/* cb_util.c */
extern const char *g_role; /* "writer" or "peer": the prefix of die's message */
void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
double cpu_s(void);
double thread_cpu_s(void);
void write_full(int fd, const void *p, size_t n);
void read_full(int fd, void *p, size_t n);
int cmp_i64(const void *a, const void *b);
int wait_peer(pid_t pid);

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline int64_t realtime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline const char *wait_name(const opts_t *o) { return o->busy ? "busy" : "eventfd"; }

/* cb_side.c */
uint8_t *region_alloc(uint64_t region, int small_pages);
void region_touch(uint8_t *b, uint64_t region);
void side_init(side_t *s, const opts_t *o, uint64_t region);
peer_info side_info(side_t *s);
int32_t side_attach(side_t *s, const peer_info *p, uint64_t *fa, int direct_here);
void side_exchange(side_t *s);
void side_free(side_t *s);
int side_drain(side_t *s, uint32_t imm, int *hit);
void side_idle(side_t *s);
void side_wait_groups(side_t *s, uint64_t n);
void side_wait_credit(side_t *s, uint32_t imm, uint64_t units);
aio_op_desc side_read(side_t *s, uint64_t k, uint64_t loff, uint64_t roff, uint64_t len);
aio_op_desc side_write(side_t *s, uint64_t k, uint64_t loff, uint64_t roff, uint64_t len, uint32_t imm);
aio_op_desc side_req_to(side_t *s, const peer_info *p, const uint64_t *fa, int32_t direct, int rail,
                        uint64_t loff, uint64_t roff, uint64_t len);
aio_op_desc as_write(aio_op_desc d, uint32_t imm);
void side_reset_counts(side_t *s);
int side_post_n(side_t *s, int64_t *g, uint64_t *in_group, uint64_t total, uint64_t token,
                const aio_op_desc *d, int64_t budget_ns);
void side_post_blocking(side_t *s, uint64_t token, const aio_op_desc *d);
int side_send_one(side_t *s, int64_t *g, uint64_t token, uint64_t len, int64_t budget_ns);
void side_send_blocking(side_t *s, uint64_t token, uint64_t len);
void side_wait_msgs(side_t *s, uint64_t n);

/* cb_modes.c */
typedef aio_op_desc (*req_fn)(side_t *s, const void *ctx, uint64_t req, uint64_t off);
uint64_t transfer_count(const opts_t *o);
void run_requests(side_t *s, const opts_t *o, uint64_t n, req_fn make, const void *ctx);
int64_t start_at(int64_t at_ns);
void run_write(side_t *s, const opts_t *o, int rank);
void run_read(side_t *s, const opts_t *o, int rank);
void run_paged(side_t *s, const opts_t *o, int rank);
void run_sendrecv(side_t *s, const opts_t *o, int rank);

/* cb_pingpong.c */
void run_pingpong(side_t *s, const opts_t *o, int rank);
void run_msgpingpong(side_t *s, const opts_t *o, int rank);

/* cb_fan.c */
int run_fan(const opts_t *o);

/* cb_sockets.c */
void run_sockets(const opts_t *o, int rank, int fd);
int sockets_forked(const opts_t *o);
int sock_listen(int port);
int sock_connect(const char *spec);

#endif
