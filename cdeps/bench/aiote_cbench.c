/* aiote_cbench: the C baseline of the aiote core, without Python.
 *
 * Forks a peer process; the two exchange their rail addresses and region
 * descriptors over pipes, then:
 *
 *   write SIZE WINDOW TOTAL_BYTES
 *       one-sided writes with immediate data from the parent to the child, WINDOW in
 *       flight, each write its own group (--batch N: groups of N writes, each group posted
 *       with one aio_post call and posted again when it completes, as aiote bench drives
 *       its batches). The child counts credits (one counter watch
 *       for all of them). Reports GB/s (1e9 B/s) at the writer, from the first post
 *       to the last completion, and the time until the receiver saw every credit
 *       (both processes read CLOCK_MONOTONIC, which is system-wide).
 *   pingpong ITERS
 *       8-byte write-with-imm ping-pong; each side waits for its counter. One-way
 *       latency = RTT / 2, p50 / p99 in microseconds.
 *   paged PAGE_SIZE NPAGES CALLS
 *       paged writes (aio_post_paged) from the parent to the child: both register
 *       PAGE_SIZE*NPAGES bytes; each of CALLS calls opens one group, posts the NPAGES pages
 *       into it (identity source pages, a random permutation of destination pages, strides
 *       = PAGE_SIZE, each page carrying an imm), seals it and waits for its group record
 *       (one call in flight, as an awaited engine.write_paged). The child waits for
 *       NPAGES*CALLS credits. One untimed warm-up call first. When the queue is full the
 *       writer backs off as the engine does (50 us after progress, doubling while stalled,
 *       at most 10 ms). Reports GB/s (1e9 B/s) and pages/s at the writer, from the first
 *       post to the last group record, and the median time per call (call_us_p50).
 *       As the engine does, the pages are ordered by destination (once, untimed) and the
 *       core gathers adjacent destinations into one request; --no-gather posts page by
 *       page in the permuted order.
 *
 *   read SIZE WINDOW TOTAL_BYTES
 *       one-sided READs by the parent from the child's region, WINDOW in flight, each read
 *       its own group (--batch N: as for write; the child takes no part). Reports GB/s at
 *       the reader, from the first post to the last completion.
 *   sendrecv SIZE WINDOW TOTAL_BYTES
 *       two-sided messages of SIZE bytes (aio_post_send into the core's registered send
 *       slots; the receiver counts AIO_REC_RECV records and reposts each slot at once),
 *       WINDOW sends in flight (at most --msg-slots, 16 like the engine's default). Reports
 *       GB/s from the first send to the receiver's report that every message arrived (read
 *       over the pipe/socket, so it holds across hosts too).
 *   msgpingpong ITERS
 *       8-byte send/recv ping-pong; one-way = RTT / 2, p50 / p99 in microseconds.
 *   sockets SIZE WINDOW TOTAL_BYTES
 *       no libfabric at all: the same SIZE-byte messages from the same --slots buffers
 *       (WINDOW by default, the same memory as write's), sent over one bare TCP connection
 *       (TCP_NODELAY) by a nonblocking send loop and taken by a nonblocking recv loop, both
 *       spinning as the pollers do. The kernel's ceiling for one connection, beside which
 *       the core's and the peers' tcp figures can be read. The sender's send buffer is
 *       --sndbuf (default: what the core sets on same-host connections, AIO_TCP_SNDBUF_AUTO;
 *       across hosts the kernel's autotuning). --nic NAME: the connection goes to that
 *       interface's IPv4 address (lo: 127.0.0.1). Reports GB/s at the sender, from the first
 *       send to the receiver's report that every byte arrived; --listen / --connect run it
 *       across hosts over the control connection itself.
 *
 * Options: --provider tcp|shm (tcp), --nic NAME (lo for tcp, none for shm),
 *          --spin-ns N (poller spin after activity, 50000), --busy-spin-ns N (poller
 *          spin while our work is in flight, 0 = core default), --busy (spin on
 *          aio_drain / aio_counter_take instead of aio_arm + poll on the eventfd),
 *          --small-pages (the region in 4 KiB pages; by default a region of 4 MiB or more
 *          asks for transparent huge pages, as NumPy does for the arrays aiote registers),
 *          --no-direct (shm: READs through the provider; by default they are direct
 *          same-host copies made by the reading side, as aiote makes them),
 *          --arena (shm: the region lies in an arena the side publishes, as aiote's
 *          Engine.alloc_host arrays do: the peer's writes and reads are a memcpy),
 *          --sndbuf N (tcp: the send buffer the core sets on same-host connections,
 *          aio_engine_set_tcp_sndbuf; 0 = the kernel's autotuning; default: the core's),
 *          --hand N (aio_engine_set_hand_posts: 0 the core's default, 1 always, -1 never),
 *          --streams N (write, read: N rails on the NIC, request k on rail k % N; the peer
 *          opens as many), --pollers N (aio_engine_set_pollers: rail i on poller thread
 *          i % N; default one thread),
 *          --slots N (buffer slots the writes cycle through; WINDOW by default,
 *          1 = one cache-hot slot), --warmup N (pingpong warm-up round trips, 1000),
 *          --msg-slots N (message slots per side: sendrecv, msgpingpong; 16),
 *          --listen PORT (no fork: serve as the peer of one run on this TCP port, 0 = any;
 *          prints {"listening":PORT} first), --connect HOST:PORT (no fork: run against a
 *          --listen peer, possibly on another host; the addresses and region descriptors
 *          are exchanged over that socket, the transfers go over libfabric).
 *
 * Output: one JSON object per line on stdout; diagnostics on stderr. */
#define _GNU_SOURCE
#include "../aiote_core.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <sys/mman.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <ifaddrs.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fi_errno.h>

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
    int64_t sndbuf;  /* --sndbuf N: tcp send buffers (aio_engine_set_tcp_sndbuf; -1: the core's default) */
    uint64_t iters, warmup;
    uint64_t page_size, npages, calls;
    int no_gather; /* paged: post page by page, in the given order */
    uint64_t msg_slots;  /* sendrecv / msgpingpong: message slots per side */
    int listen_port;     /* -1: fork the peer; else serve as the peer on this port */
    const char *connect; /* HOST:PORT of a --listen peer, or NULL */
    int await_write; /* pingpong: each side waits for its write's completion before going on */
    int64_t loop_poll_ns; /* --loop-poll-ns N: wait as aiote's low-latency setting does */
    int64_t think_ns;     /* --think-ns N: pingpong: busy work after each wait (an application's) */
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
} side_t;

static const char *g_role = "writer";

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "aiote_cbench (%s): ", g_role);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static double cpu_s(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

/* CPU seconds of the calling thread (the writer's own posting and draining, without its pollers). */
static double thread_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void write_full(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) die("control write: %s", strerror(errno));
        c += w;
        n -= (size_t)w;
    }
}

static void read_full(int fd, void *p, size_t n) {
    char *c = p;
    while (n) {
        ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) die("control read: %s", r == 0 ? "the peer closed its end" : strerror(errno));
        c += r;
        n -= (size_t)r;
    }
}

/* ------------------------------------------------------------------ engine side */

/* A benchmark region as NumPy allocates the arrays aiote's benches register: 4 MiB or more
 * asks for transparent huge pages (MADV_HUGEPAGE; granted where THP is "madvise" or
 * "always"), unless small_pages. */
static uint8_t *region_alloc(uint64_t region, int small_pages) {
    int huge = region >= (4ULL << 20) && !small_pages;
    void *b = NULL;
    if (posix_memalign(&b, huge ? (2ULL << 20) : 4096, region))
        die("out of memory for %llu bytes", (unsigned long long)region);
    if (huge) (void)madvise(b, region, MADV_HUGEPAGE); /* a hint: refused is fine */
    return b;
}

/* Writes every 64th byte: first touch, before timing. */
static void region_touch(uint8_t *b, uint64_t region) {
    for (uint64_t i = 0; i < region; i += 64) b[i] = (uint8_t)(i >> 6);
}

static void side_init(side_t *s, const opts_t *o, uint64_t region) {
    char err[512] = "";
    aio_engine_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.ring_capacity = 8192;
    cfg.spin_ns = o->spin_ns;
    cfg.busy_spin_ns = o->busy_spin_ns;
    cfg.sleep_ms = 100;
    int ret = aio_engine_create(&cfg, &s->e, err, sizeof(err));
    if (ret) die("aio_engine_create: %s %s", aio_strerror(ret), err);
    if (o->hand && (ret = aio_engine_set_hand_posts(s->e, o->hand)))
        die("--hand %d: %s", o->hand, aio_strerror(ret));
    if (o->sndbuf >= 0 && (ret = aio_engine_set_tcp_sndbuf(s->e, (int32_t)o->sndbuf, 0)))
        die("aio_engine_set_tcp_sndbuf: %s", aio_strerror(ret));
    if (o->pollers && (ret = aio_engine_set_pollers(s->e, o->pollers)))
        die("--pollers %d: %s", o->pollers, aio_strerror(ret));
    uint64_t slot_size = 4096;
    uint32_t nslots = 16;
    if (!strcmp(o->mode, "sendrecv") || !strcmp(o->mode, "msgpingpong")) {
        nslots = (uint32_t)o->msg_slots;
        if (o->size > slot_size) slot_size = o->size;
    }
    s->nrails = o->streams;
    for (int i = 0; i < s->nrails; i++) {
        ret = aio_engine_add_rail(s->e, o->provider, o->nic, nslots, slot_size, err, sizeof(err));
        if (ret < 0) die("aio_engine_add_rail: %s %s", aio_strerror(ret), err);
        if (ret != i) die("aio_engine_add_rail: rail %d, expected %d", ret, i);
    }
    s->rail = 0;
    if (!strcmp(o->provider, "shm") && !o->no_direct &&
        (ret = aio_engine_enable_direct(s->e, err, sizeof(err))))
        die("aio_engine_enable_direct: %s %s", aio_strerror(ret), err);
    if ((ret = aio_engine_start(s->e))) die("aio_engine_start: %s", aio_strerror(ret));
    s->efd = aio_engine_eventfd(s->e);
    s->busy = o->busy;
    s->loop_poll_ns = o->loop_poll_ns;
    /* region_alloc: huge pages as NumPy's arrays get them. The page size weighs on shm, whose
     * CMA copies pin the pages they touch one by one: with 4 KiB pages this core measured
     * about half of what the same code does on NumPy arrays. --small-pages: 4 KiB pages. */
    void *b = NULL;
    uint64_t alen = o->arena ? (region + 4095) & ~4095ULL : 0;
    if (alen) { /* as Engine.alloc_host: a memfd this process maps and publishes */
        int afd = memfd_create("aiote-arena", MFD_CLOEXEC);
        if (afd < 0 || ftruncate(afd, (off_t)alen) != 0) die("arena memfd: %s", strerror(errno));
        b = mmap(NULL, alen, PROT_READ | PROT_WRITE, MAP_SHARED, afd, 0);
        if (b == MAP_FAILED) die("arena mmap: %s", strerror(errno));
        if (!strcmp(o->provider, "shm") && !o->no_direct &&
            (ret = aio_engine_set_arena(s->e, afd, b, alen, err, sizeof(err))))
            die("aio_engine_set_arena: %s %s", aio_strerror(ret), err);
        close(afd); /* the core keeps its own; the mapping stays for the run */
    } else {
        b = region_alloc(region, o->small_pages);
    }
    s->buf = b;
    s->len = region;
    s->arena_len = alen;
    region_touch(s->buf, region);
    ret = aio_mr_register(s->e, s->buf, region, AIO_ACCESS_REMOTE_WRITE | AIO_ACCESS_REMOTE_READ,
                          &s->mr, err, sizeof(err));
    if (ret) die("aio_mr_register: %s %s", aio_strerror(ret), err);
}

/* both sides write first, then read: a pipe holds far more than one peer_info */
static void side_exchange(side_t *s) {
    peer_info mine;
    memset(&mine, 0, sizeof(mine));
    mine.nrails = s->nrails;
    for (int i = 0; i < s->nrails; i++) {
        aio_rail_info ri;
        aio_rail_get_info(s->e, i, &ri);
        mine.rail[i].addr_len = ri.addr_len;
        memcpy(mine.rail[i].addr, ri.addr, ri.addr_len);
        mine.rail[i].base = aio_mr_remote_base(s->mr, i);
        mine.rail[i].key = aio_mr_key(s->mr, i);
    }
    mine.len = s->len;
    mine.direct_slot = -1;
    if (aio_direct_info_get(s->e, &mine.direct) == 0) mine.direct_slot = aio_mr_direct_slot(s->mr);
    write_full(s->wfd, &mine, sizeof(mine));
    read_full(s->rfd, &s->remote, sizeof(s->remote));
    if (s->remote.nrails != s->nrails) die("--streams: %d here, %d at the peer", s->nrails, s->remote.nrails);
    for (int i = 0; i < s->nrails; i++) {
        peer_rail *pr = &s->remote.rail[i];
        int ret = aio_av_insert(s->e, i, pr->addr, pr->addr_len, &s->peers[i]);
        if (ret) die("aio_av_insert: %s", aio_strerror(ret));
    }
    s->peer = s->peers[0];
    if (mine.direct_slot >= 0 && s->remote.direct_slot >= 0) { /* both sides take direct copies */
        char err[512] = "";
        int at = aio_direct_attach(s->e, &s->remote.direct, err, sizeof(err));
        if (at >= 0) s->direct = AIO_DIRECT(at, s->remote.direct_slot);
        else fprintf(stderr, "direct copies unavailable (%s %s): READs go through the provider\n",
                     aio_strerror(at), err);
    }
}

static void side_free(side_t *s) {
    int ret;
    int64_t t0 = now_ns();
    while ((ret = aio_mr_close(s->e, s->mr)) == -FI_EBUSY) {
        if (now_ns() - t0 > 10000000000LL) break;
        usleep(100);
    }
    aio_engine_destroy(s->e);
    if (s->arena_len) munmap(s->buf, s->arena_len);
    else free(s->buf);
}

/* Handles the records of one drain; returns how many there were. A counter record
 * for `imm` sets *hit. */
static int side_drain(side_t *s, uint32_t imm, int *hit) {
    aio_record rec[NREC];
    int n = aio_drain(s->e, rec, NREC);
    for (int i = 0; i < n; i++) {
        if (rec[i].kind == AIO_REC_GROUP) {
            if (rec[i].status)
                die("a group failed: %s (prov_errno %d)", aio_strerror(rec[i].status),
                    rec[i].prov_errno);
            s->groups_done++;
        } else if (rec[i].kind == AIO_REC_COUNTER) {
            if (hit && rec[i].token == imm) *hit = 1;
        } else if (rec[i].kind == AIO_REC_RECV) {
            if (rec[i].status)
                die("a receive failed: %s (prov_errno %d)", aio_strerror(rec[i].status),
                    rec[i].prov_errno);
            s->msgs++;
            s->msg_bytes += rec[i].b;
            int r = aio_recv_repost(s->e, rec[i].rail, (uint32_t)rec[i].a);
            if (r) die("aio_recv_repost: %s", aio_strerror(r));
        }
    }
    return n;
}

/* Nothing was ready: sleep on the eventfd (the event-loop protocol) or spin. */
static void side_idle(side_t *s) {
    if (s->busy) return;
    if (s->loop_poll_ns > 0 && aio_poll_ring(s->e, s->loop_poll_ns)) return;
    if (aio_arm(s->e)) return; /* records arrived meanwhile: drain again */
    struct pollfd p = {.fd = s->efd, .events = POLLIN};
    s->polls++;
    int r = poll(&p, 1, 1000);
    if (r > 0) {
        s->wakeups++;
        aio_clear_eventfd(s->e);
    }
}

/* Waits until `n` groups of this side have completed. */
static void side_wait_groups(side_t *s, uint64_t n) {
    while (s->groups_done < n)
        if (side_drain(s, 0, NULL) == 0) side_idle(s);
}

/* Waits until `units` of counter `imm` can be taken, and takes them. */
static void side_wait_credit(side_t *s, uint32_t imm, uint64_t units) {
    if (aio_counter_take(s->e, imm, units)) return;
    if (s->busy) {
        while (!aio_counter_take(s->e, imm, units)) side_drain(s, 0, NULL);
        return;
    }
    int r = aio_counter_watch(s->e, imm, units);
    if (r < 0) die("aio_counter_watch: %s", aio_strerror(r));
    int hit = r == 1;
    while (!hit)
        if (side_drain(s, imm, &hit) == 0 && !hit) side_idle(s);
    if (!aio_counter_take(s->e, imm, units)) die("counter watch fired but take failed");
}

/* Request k's rail (--streams: k % N) into d: its peer, and the target's base and key there. */
static void side_route(side_t *s, uint64_t k, aio_op_desc *d, uint64_t roff) {
    int i = (int)(k % (uint64_t)s->nrails);
    d->rail = i;
    d->peer = s->peers[i];
    d->raddr = s->remote.rail[i].base + roff;
    d->rkey = s->remote.rail[i].key;
}

/* Request k, a READ of len bytes at roff into loff, on request k's rail. */
static aio_op_desc side_read(side_t *s, uint64_t k, uint64_t loff, uint64_t roff, uint64_t len) {
    aio_op_desc d;
    memset(&d, 0, sizeof(d));
    d.mr = s->mr;
    d.offset = loff;
    d.length = len;
    side_route(s, k, &d, roff);
    d.op = AIO_OP_READ;
    d.direct = s->direct;
    return d;
}

/* Request k, a write of len bytes from loff to roff carrying imm, on request k's rail. */
static aio_op_desc side_write(side_t *s, uint64_t k, uint64_t loff, uint64_t roff, uint64_t len, uint32_t imm) {
    aio_op_desc d;
    memset(&d, 0, sizeof(d));
    d.mr = s->mr;
    d.offset = loff;
    d.length = len;
    side_route(s, k, &d, roff);
    d.data = imm;
    d.op = AIO_OP_WRITE;
    d.flags = AIO_F_DATA;
    d.direct = s->direct;
    return d;
}

/* Posts requests `d[0..n)` into the open group *g (opened first if none), the rest of a group
 * of `total` requests of which `*in_group` are in already; seals the group once all `total`
 * are in (then *g = -1, *in_group = 0). Returns 1 when the group was sealed, 0 when it is not
 * complete yet (no group free, or no room now). */
static int side_post_n(side_t *s, int64_t *g, uint64_t *in_group, uint64_t total, uint64_t token,
                       const aio_op_desc *d, int64_t budget_ns) {
    if (*g < 0) {
        *g = aio_group_open(s->e, token);
        if (*g < 0) return 0; /* all groups in flight */
        *in_group = 0;
    }
    int64_t t0 = now_ns();
    int64_t r = aio_post(s->e, *g, d, (int64_t)(total - *in_group), budget_ns);
    int64_t dt = now_ns() - t0;
    s->post_ns += dt;
    s->post_calls++;
    if (dt > s->post_max_ns) s->post_max_ns = dt;
    if (r < 0) die("aio_post: %s", aio_strerror((int)r));
    *in_group += (uint64_t)r;
    if (*in_group < total) return 0;
    int ret = aio_group_seal(s->e, *g);
    if (ret) die("aio_group_seal: %s", aio_strerror(ret));
    *g = -1;
    *in_group = 0;
    return 1;
}

/* One request in a group of its own. Returns 1 posted, 0 not now (queue full,
 * connecting): the group stays open in *g for the retry. */
static int side_post_one(side_t *s, int64_t *g, uint64_t token, const aio_op_desc *d,
                         int64_t budget_ns) {
    uint64_t in_group = 0;
    return side_post_n(s, g, &in_group, 1, token, d, budget_ns);
}

/* Posts one write, retrying (connection setup) until it is in. */
static void side_post_blocking(side_t *s, uint64_t token, const aio_op_desc *d) {
    int64_t g = -1, t0 = now_ns();
    while (!side_post_one(s, &g, token, d, 1000000)) {
        side_drain(s, 0, NULL);
        if (now_ns() - t0 > 30000000000LL) die("a write could not be posted for 30 s");
        usleep(20);
    }
}

/* ------------------------------------------------------------------ modes */

static const char *wait_name(const opts_t *o) { return o->busy ? "busy" : "eventfd"; }

/* The receiving side of a throughput run: waits for `units` credits of IMM_MAIN, reports
 * when they were complete, its CPU time and the warm-up credits, then waits for the bye. */
static void receive_all(side_t *s, uint64_t units) {
    double c0 = cpu_s();
    side_wait_credit(s, IMM_MAIN, units);
    int64_t t_recv = now_ns();
    double cpu = cpu_s() - c0;
    write_full(s->wfd, &t_recv, sizeof(t_recv));
    write_full(s->wfd, &cpu, sizeof(cpu));
    uint64_t warm_total = aio_counter_total(s->e, IMM_WARM);
    write_full(s->wfd, &warm_total, sizeof(warm_total));
    char bye;
    read_full(s->rfd, &bye, 1);
}

/* The writer's side of receive_all: reads the receiver's report and says bye. */
static void receiver_report(side_t *s, int64_t *t_recv, double *rcpu, uint64_t *warm_total) {
    read_full(s->rfd, t_recv, sizeof(*t_recv));
    read_full(s->rfd, rcpu, sizeof(*rcpu));
    read_full(s->rfd, warm_total, sizeof(*warm_total));
    char bye = 'x';
    write_full(s->wfd, &bye, 1);
}

/* write, read: how many requests a run makes (TOTAL / SIZE, at least one, rounded down to
 * whole groups of --batch); the same on both sides. */
static uint64_t transfer_count(const opts_t *o) {
    uint64_t n = o->total / o->size;
    n -= n % o->batch;
    return n ? n : o->batch;
}

/* The timed part of write and read: `n` requests (whole groups of --batch), at most WINDOW in
 * flight, in groups of --batch requests, each group posted with one aio_post call (as
 * aiote's TransferBatch.submit posts a batch); a group goes out again as soon as one completes.
 * --batch 1: a request per group, re-posted as each completes. */
static void run_window(side_t *s, const opts_t *o, uint64_t n, int is_write) {
    uint64_t b = o->batch, ngroups = n / b, gmax = o->window / b;
    aio_op_desc d[MAX_BATCH];
    uint64_t posted = 0, in_group = 0; /* groups sealed; requests in of the open one */
    int64_t g = -1;
    while (s->groups_done < ngroups) {
        int progressed = 0;
        while (posted < ngroups && posted - s->groups_done < gmax) {
            for (uint64_t k = in_group; k < b; k++) {
                uint64_t off = ((posted * b + k) % o->slots) * o->size;
                uint64_t req = posted * b + k;
                d[k] = is_write ? side_write(s, req, off, off, o->size, IMM_MAIN)
                                : side_read(s, req, off, off, o->size);
            }
            uint64_t before = in_group;
            int sealed = side_post_n(s, &g, &in_group, b, posted, d + in_group, 0);
            if (sealed || in_group != before) progressed = 1;
            if (!sealed) break;
            posted++;
        }
        if (side_drain(s, 0, NULL) == 0 && !progressed) side_idle(s);
    }
}

static void run_write(side_t *s, const opts_t *o, int rank) {
    uint64_t n = transfer_count(o);
    uint64_t slots = o->slots;
    uint64_t warm = n < o->window ? n : o->window;
    if (rank == 1) {
        /* receiver: one watch for every credit of the run */
        receive_all(s, n * U);
        return;
    }
    /* warm-up: connection set-up and first-touch, not timed */
    for (uint64_t i = 0; i < warm; i++) {
        aio_op_desc d = side_write(s, i, (i % slots) * o->size, (i % slots) * o->size, o->size, IMM_WARM);
        side_post_blocking(s, 1ULL << 40 | i, &d);
    }
    side_wait_groups(s, warm);
    s->groups_done = 0;
    s->polls = s->wakeups = 0;
    s->post_ns = s->post_max_ns = 0;
    s->post_calls = 0;
    aio_stats st0, st1;
    aio_get_stats(s->e, &st0);

    double c0 = cpu_s(), m0 = thread_cpu_s();
    int64_t t0 = now_ns();
    run_window(s, o, n, 1);
    int64_t t1 = now_ns();
    double cpu = cpu_s() - c0, main_cpu = thread_cpu_s() - m0;
    aio_get_stats(s->e, &st1);
    int64_t t_recv;
    double rcpu;
    uint64_t warm_total;
    receiver_report(s, &t_recv, &rcpu, &warm_total);
    double secs = (double)(t1 - t0) * 1e-9, rsecs = (double)(t_recv - t0) * 1e-9;
    double bytes = (double)n * (double)o->size;
    printf("{\"mode\":\"write\",\"provider\":\"%s\",\"nic\":\"%s\",\"size\":%llu,\"window\":%llu,"
           "\"batch\":%llu,\"slots\":%llu,\"writes\":%llu,\"total_bytes\":%.0f,\"gbps\":%.3f,\"seconds\":%.6f,"
           "\"recv_gbps\":%.3f,\"recv_seconds\":%.6f,\"wait\":\"%s\",\"spin_ns\":%lld,"
           "\"writer_cpu_s\":%.6f,\"writer_main_cpu_s\":%.6f,\"receiver_cpu_s\":%.6f,\"eventfd_polls\":%llu,"
           "\"eventfd_wakeups\":%llu,\"poller_sleeps\":%llu,\"poller_polls\":%llu,"
           "\"posts_handed\":%llu,\"post_calls\":%llu,\"post_us_mean\":%.2f,\"post_us_max\":%.1f,"
           "\"streams\":%d,\"pollers\":%d}\n",
           o->provider, o->nic ? o->nic : "", (unsigned long long)o->size,
           (unsigned long long)o->window, (unsigned long long)o->batch, (unsigned long long)slots,
           (unsigned long long)n, bytes,
           bytes / secs / 1e9, secs, bytes / rsecs / 1e9, rsecs, wait_name(o), (long long)o->spin_ns,
           cpu, main_cpu, rcpu, (unsigned long long)s->polls, (unsigned long long)s->wakeups,
           (unsigned long long)(st1.sleeps - st0.sleeps), (unsigned long long)(st1.polls - st0.polls),
           (unsigned long long)(st1.posts_handed - st0.posts_handed), (unsigned long long)s->post_calls,
           s->post_calls ? (double)s->post_ns / (double)s->post_calls / 1e3 : 0.0,
           (double)s->post_max_ns / 1e3, s->nrails, aio_engine_num_pollers(s->e));
    if (warm_total != warm * U) fprintf(stderr, "warning: warm-up credits %llu, want %llu\n",
                                        (unsigned long long)(warm_total / U), (unsigned long long)warm);
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* The pinger's end of a ping-pong (both kinds): waits for its own sends, lets the
 * answering side go, and prints the one-way (RTT / 2) percentiles as one JSON line. */
static void pingpong_report(side_t *s, const opts_t *o, const char *mode, int64_t *rtt,
                            uint64_t total, double cpu) {
    side_wait_groups(s, total);
    char bye = 'x';
    write_full(s->wfd, &bye, 1);
    uint64_t m = o->iters;
    qsort(rtt, m, sizeof(int64_t), cmp_i64);
    double sum = 0;
    for (uint64_t i = 0; i < m; i++) sum += (double)rtt[i];
    uint64_t i50 = m / 2, i99 = (m * 99) / 100;
    if (i99 >= m) i99 = m - 1;
#define OW(ns) ((double)(ns) / 2e3)
    printf("{\"mode\":\"%s\",\"provider\":\"%s\",\"nic\":\"%s\",\"iters\":%llu,\"p50_us\":%.2f,"
           "\"p99_us\":%.2f,\"mean_us\":%.2f,\"min_us\":%.2f,\"max_us\":%.2f,\"rtt_p50_us\":%.2f,"
           "\"rtt_p99_us\":%.2f,\"wait\":\"%s\",\"spin_ns\":%lld,\"pinger_cpu_s\":%.3f,"
           "\"seconds\":%.3f,\"post_us_mean\":%.2f}\n",
           mode, o->provider, o->nic ? o->nic : "", (unsigned long long)m, OW(rtt[i50]), OW(rtt[i99]),
           sum / (double)m / 2e3, OW(rtt[0]), OW(rtt[m - 1]), (double)rtt[i50] / 1e3,
           (double)rtt[i99] / 1e3, wait_name(o), (long long)o->spin_ns, cpu, sum * 1e-9,
           s->post_calls ? (double)s->post_ns / (double)s->post_calls / 1e3 : 0.0);
#undef OW
    free(rtt);
}

static void run_pingpong(side_t *s, const opts_t *o, int rank) {
    uint64_t total = o->warmup + o->iters;
    if (rank == 1) {
        for (uint64_t i = 0; i < total; i++) {
            side_wait_credit(s, IMM_PING, U);
            for (int64_t t0 = now_ns(); now_ns() - t0 < o->think_ns;) {
            }
            aio_op_desc d = side_write(s, 0, 8, 8, 8, IMM_PONG);
            side_post_blocking(s, i, &d);
            if (o->await_write)
                side_wait_groups(s, i + 1);
        }
        side_wait_groups(s, total);
        char bye;
        read_full(s->rfd, &bye, 1);
        return;
    }
    int64_t *rtt = calloc(o->iters ? o->iters : 1, sizeof(int64_t));
    if (!rtt) die("out of memory");
    double c0 = 0;
    for (uint64_t i = 0; i < total; i++) {
        if (i == o->warmup) c0 = cpu_s();
        *(uint64_t *)s->buf = i;
        aio_op_desc d = side_write(s, 0, 0, 0, 8, IMM_PING);
        int64_t t = now_ns();
        side_post_blocking(s, i, &d);
        if (o->await_write) /* as `await engine.write(...)` does */
            side_wait_groups(s, i + 1);
        side_wait_credit(s, IMM_PONG, U);
        for (int64_t t0 = now_ns(); now_ns() - t0 < o->think_ns;) {
        }
        int64_t dt = now_ns() - t;
        if (i >= o->warmup) rtt[i - o->warmup] = dt;
    }
    pingpong_report(s, o, "pingpong", rtt, total, cpu_s() - c0);
}

/* One paged call: a group of every page, posted from `start` until all are in, sealed,
 * and waited for. Returns the number of aio_post_paged calls that posted nothing. */
static uint64_t paged_call(side_t *s, const aio_paged_desc *d, int64_t npages, uint64_t token) {
    int64_t g;
    while ((g = aio_group_open(s->e, token)) < 0) /* every group slot in flight */
        if (side_drain(s, 0, NULL) == 0) side_idle(s);
    uint64_t done0 = s->groups_done, stalls = 0;
    int64_t posted = 0;
    int attempt = 0;
    while (posted < npages) {
        int64_t t0 = now_ns();
        int64_t r = aio_post_paged(s->e, g, d, posted, npages, PAGED_BUDGET_NS);
        int64_t dt = now_ns() - t0;
        s->post_ns += dt;
        s->post_calls++;
        if (dt > s->post_max_ns) s->post_max_ns = dt;
        if (r < 0) die("aio_post_paged (page %lld): %s", (long long)posted, aio_strerror((int)r));
        posted += r;
        if (posted < npages) {
            /* queue full (or still connecting): back off while the poller progresses, with
             * the engine's schedule (50 us after progress, doubling while stalled, <= 10 ms) */
            attempt = r == 0 ? attempt + 1 : 0;
            stalls += r == 0;
            side_drain(s, 0, NULL);
            int sh = attempt < 8 ? attempt : 8;
            int64_t us = 50LL << sh;
            usleep((useconds_t)(us < 10000 ? us : 10000));
        }
    }
    int ret = aio_group_seal(s->e, g);
    if (ret) die("aio_group_seal: %s", aio_strerror(ret));
    while (s->groups_done == done0)
        if (side_drain(s, 0, NULL) == 0) side_idle(s);
    return stalls;
}

static void run_paged(side_t *s, const opts_t *o, int rank) {
    int64_t np = (int64_t)o->npages;
    uint64_t credits = o->npages * o->calls;
    if (rank == 1) {
        receive_all(s, credits * U);
        return;
    }
    int64_t *src = malloc((size_t)np * sizeof(int64_t)), *dst = malloc((size_t)np * sizeof(int64_t));
    if (!src || !dst) die("out of memory");
    for (int64_t k = 0; k < np; k++) src[k] = dst[k] = k;
    uint64_t x = 0x9E3779B97F4A7C15ULL; /* xorshift64, fixed seed: Fisher-Yates of dst */
    for (int64_t k = np - 1; k > 0; k--) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        int64_t j = (int64_t)(x % (uint64_t)(k + 1)), t = dst[k];
        dst[k] = dst[j];
        dst[j] = t;
    }
    if (!o->no_gather) {
        /* what the engine does for a call: order the pages by destination (dst is a
         * permutation here, so that is a placement) and let the core gather runs of
         * adjacent destinations into one request. Done once, outside the timed calls. */
        int64_t *s2 = malloc((size_t)np * sizeof(int64_t));
        if (!s2) die("out of memory");
        for (int64_t k = 0; k < np; k++) s2[dst[k]] = src[k];
        for (int64_t k = 0; k < np; k++) {
            src[k] = s2[k];
            dst[k] = k;
        }
        free(s2);
    }
    aio_paged_desc d;
    memset(&d, 0, sizeof(d));
    d.gather = !o->no_gather;
    d.mr = s->mr;
    d.src_pages = src;
    d.dst_pages = dst;
    d.page_size = d.src_stride = d.dst_stride = o->page_size;
    d.remote_len = s->remote.len;
    d.flags = AIO_F_DATA;
    d.nroutes = 1;
    d.routes[0].rail = s->rail;
    d.routes[0].peer = s->peer;
    d.routes[0].rbase = s->remote.rail[0].base;
    d.routes[0].rkey = s->remote.rail[0].key;
    /* warm-up: connection set-up and first touch, not timed */
    d.data = IMM_WARM;
    paged_call(s, &d, np, 1ULL << 40);
    s->groups_done = 0;
    s->polls = s->wakeups = 0;
    s->post_ns = s->post_max_ns = 0;
    s->post_calls = 0;
    d.data = IMM_MAIN;
    uint64_t stalls = 0;
    int64_t *call_ns = calloc(o->calls, sizeof(int64_t));
    if (!call_ns) die("out of memory");
    double c0 = cpu_s();
    int64_t t0 = now_ns(), tc = t0;
    for (uint64_t c = 0; c < o->calls; c++) {
        stalls += paged_call(s, &d, np, c);
        int64_t t = now_ns();
        call_ns[c] = t - tc;
        tc = t;
    }
    int64_t t1 = tc;
    double cpu = cpu_s() - c0;
    int64_t t_recv;
    double rcpu;
    uint64_t warm_total;
    receiver_report(s, &t_recv, &rcpu, &warm_total);
    double secs = (double)(t1 - t0) * 1e-9, rsecs = (double)(t_recv - t0) * 1e-9;
    double pages = (double)credits, bytes = pages * (double)o->page_size;
    qsort(call_ns, o->calls, sizeof(int64_t), cmp_i64);
    printf("{\"mode\":\"paged\",\"provider\":\"%s\",\"nic\":\"%s\",\"page_size\":%llu,\"pages\":%llu,"
           "\"calls\":%llu,\"total_bytes\":%.0f,\"gbps\":%.3f,\"pages_per_s\":%.0f,\"seconds\":%.6f,"
           "\"call_us_mean\":%.1f,\"call_us_p50\":%.1f,\"call_us_min\":%.1f,\"recv_gbps\":%.3f,\"recv_seconds\":%.6f,\"wait\":\"%s\","
           "\"spin_ns\":%lld,\"writer_cpu_s\":%.3f,\"receiver_cpu_s\":%.3f,\"eventfd_polls\":%llu,"
           "\"eventfd_wakeups\":%llu,\"post_calls\":%llu,\"post_stalls\":%llu,"
           "\"post_us_mean\":%.2f,\"post_us_max\":%.1f}\n",
           o->provider, o->nic ? o->nic : "", (unsigned long long)o->page_size,
           (unsigned long long)o->npages, (unsigned long long)o->calls, bytes, bytes / secs / 1e9,
           pages / secs, secs, secs * 1e6 / (double)o->calls, (double)call_ns[o->calls / 2] / 1e3,
           (double)call_ns[0] / 1e3, bytes / rsecs / 1e9, rsecs,
           wait_name(o), (long long)o->spin_ns, cpu, rcpu, (unsigned long long)s->polls,
           (unsigned long long)s->wakeups, (unsigned long long)s->post_calls,
           (unsigned long long)stalls,
           s->post_calls ? (double)s->post_ns / (double)s->post_calls / 1e3 : 0.0,
           (double)s->post_max_ns / 1e3);
    if (warm_total != o->npages * U)
        fprintf(stderr, "warning: warm-up credits %llu, want %llu\n",
                (unsigned long long)(warm_total / U), (unsigned long long)o->npages);
    free(call_ns);
    free(src);
    free(dst);
}

/* Runs READs of `size` bytes, `window` in flight, from the remote region; rank 1 only waits. */
static void run_read(side_t *s, const opts_t *o, int rank) {
    uint64_t n = transfer_count(o);
    uint64_t slots = o->slots;
    char bye = 'x';
    if (rank == 1) {
        read_full(s->rfd, &bye, 1);
        return;
    }
    uint64_t warm = n < o->window ? n : o->window;
    for (uint64_t i = 0; i < warm; i++) {
        aio_op_desc d = side_read(s, i, (i % slots) * o->size, (i % slots) * o->size, o->size);
        side_post_blocking(s, 1ULL << 40 | i, &d);
    }
    side_wait_groups(s, warm);
    s->groups_done = 0;
    s->polls = s->wakeups = 0;
    s->post_ns = s->post_max_ns = 0;
    s->post_calls = 0;
    double c0 = cpu_s();
    int64_t t0 = now_ns();
    run_window(s, o, n, 0);
    int64_t t1 = now_ns();
    double cpu = cpu_s() - c0;
    write_full(s->wfd, &bye, 1);
    double secs = (double)(t1 - t0) * 1e-9, bytes = (double)n * (double)o->size;
    printf("{\"mode\":\"read\",\"provider\":\"%s\",\"nic\":\"%s\",\"size\":%llu,\"window\":%llu,"
           "\"batch\":%llu,\"slots\":%llu,\"reads\":%llu,\"total_bytes\":%.0f,\"gbps\":%.3f,\"seconds\":%.6f,"
           "\"wait\":\"%s\",\"spin_ns\":%lld,\"reader_cpu_s\":%.3f,\"eventfd_polls\":%llu,"
           "\"eventfd_wakeups\":%llu,\"post_calls\":%llu,\"post_us_mean\":%.2f}\n",
           o->provider, o->nic ? o->nic : "", (unsigned long long)o->size,
           (unsigned long long)o->window, (unsigned long long)o->batch, (unsigned long long)slots,
           (unsigned long long)n, bytes,
           bytes / secs / 1e9, secs, wait_name(o), (long long)o->spin_ns, cpu,
           (unsigned long long)s->polls, (unsigned long long)s->wakeups,
           (unsigned long long)s->post_calls,
           s->post_calls ? (double)s->post_ns / (double)s->post_calls / 1e3 : 0.0);
}

/* One message in a group of its own: 1 posted, 0 not now (no free send slot, connecting). */
static int side_send_one(side_t *s, int64_t *g, uint64_t token, uint64_t len, int64_t budget_ns) {
    if (*g < 0) {
        *g = aio_group_open(s->e, token);
        if (*g < 0) return 0;
    }
    int r = aio_post_send(s->e, *g, s->rail, s->peer, s->buf, len, budget_ns);
    s->post_calls++;
    if (r < 0) die("aio_post_send: %s", aio_strerror(r));
    if (r == 0) return 0;
    int ret = aio_group_seal(s->e, *g);
    if (ret) die("aio_group_seal: %s", aio_strerror(ret));
    *g = -1;
    return 1;
}

static void side_send_blocking(side_t *s, uint64_t token, uint64_t len) {
    int64_t g = -1, t0 = now_ns();
    while (!side_send_one(s, &g, token, len, 1000000)) {
        if (side_drain(s, 0, NULL) == 0) usleep(20);
        if (now_ns() - t0 > 30000000000LL) die("a message could not be sent for 30 s");
    }
}

static void side_wait_msgs(side_t *s, uint64_t n) {
    while (s->msgs < n)
        if (side_drain(s, 0, NULL) == 0 && s->msgs < n) side_idle(s);
}

/* Two-sided throughput: rank 0 sends, rank 1 counts messages and reposts its slots. */
static void run_sendrecv(side_t *s, const opts_t *o, int rank) {
    uint64_t n = o->total / o->size;
    if (n == 0) n = 1;
    uint64_t window = o->window < o->msg_slots ? o->window : o->msg_slots;
    uint64_t warm = n < window ? n : window;
    if (rank == 1) {
        side_wait_msgs(s, warm);
        double c0 = cpu_s();
        side_wait_msgs(s, warm + n);
        double cpu = cpu_s() - c0;
        write_full(s->wfd, &cpu, sizeof(cpu));
        uint64_t bytes = s->msg_bytes;
        write_full(s->wfd, &bytes, sizeof(bytes));
        char bye;
        read_full(s->rfd, &bye, 1);
        return;
    }
    for (uint64_t i = 0; i < warm; i++) side_send_blocking(s, 1ULL << 40 | i, o->size);
    side_wait_groups(s, warm);
    s->groups_done = 0;
    s->polls = s->wakeups = 0;
    s->post_calls = 0;
    double c0 = cpu_s();
    int64_t t0 = now_ns();
    uint64_t posted = 0;
    int64_t g = -1;
    while (s->groups_done < n) {
        int progressed = 0;
        while (posted < n && posted - s->groups_done < window) {
            if (!side_send_one(s, &g, posted, o->size, 0)) break;
            posted++;
            progressed = 1;
        }
        if (side_drain(s, 0, NULL) == 0 && !progressed) side_idle(s);
    }
    int64_t t_sent = now_ns();
    double cpu = cpu_s() - c0, rcpu;
    uint64_t rbytes;
    read_full(s->rfd, &rcpu, sizeof(rcpu)); /* the receiver saw every message */
    int64_t t1 = now_ns();
    read_full(s->rfd, &rbytes, sizeof(rbytes));
    char bye = 'x';
    write_full(s->wfd, &bye, 1);
    double secs = (double)(t1 - t0) * 1e-9, bytes = (double)n * (double)o->size;
    if (rbytes != (warm + n) * o->size)
        die("the receiver got %llu bytes, want %llu", (unsigned long long)rbytes,
            (unsigned long long)((warm + n) * o->size));
    printf("{\"mode\":\"sendrecv\",\"provider\":\"%s\",\"nic\":\"%s\",\"size\":%llu,\"window\":%llu,"
           "\"msg_slots\":%llu,\"messages\":%llu,\"total_bytes\":%.0f,\"gbps\":%.3f,\"seconds\":%.6f,"
           "\"send_gbps\":%.3f,\"wait\":\"%s\",\"spin_ns\":%lld,\"sender_cpu_s\":%.3f,"
           "\"receiver_cpu_s\":%.3f,\"eventfd_polls\":%llu,\"eventfd_wakeups\":%llu,"
           "\"post_calls\":%llu}\n",
           o->provider, o->nic ? o->nic : "", (unsigned long long)o->size, (unsigned long long)window,
           (unsigned long long)o->msg_slots, (unsigned long long)n, bytes, bytes / secs / 1e9, secs,
           bytes / ((double)(t_sent - t0) * 1e-9) / 1e9, wait_name(o), (long long)o->spin_ns, cpu,
           rcpu, (unsigned long long)s->polls, (unsigned long long)s->wakeups,
           (unsigned long long)s->post_calls);
}

/* 8-byte send/recv ping-pong; rank 1 answers each message with one. */
static void run_msgpingpong(side_t *s, const opts_t *o, int rank) {
    uint64_t total = o->warmup + o->iters;
    if (rank == 1) {
        for (uint64_t i = 0; i < total; i++) {
            side_wait_msgs(s, i + 1);
            side_send_blocking(s, i, 8);
        }
        side_wait_groups(s, total);
        char bye;
        read_full(s->rfd, &bye, 1);
        return;
    }
    int64_t *rtt = calloc(o->iters ? o->iters : 1, sizeof(int64_t));
    if (!rtt) die("out of memory");
    double c0 = 0;
    for (uint64_t i = 0; i < total; i++) {
        if (i == o->warmup) c0 = cpu_s();
        *(uint64_t *)s->buf = i;
        int64_t t = now_ns();
        side_send_blocking(s, i, 8);
        side_wait_msgs(s, i + 1);
        int64_t dt = now_ns() - t;
        if (i >= o->warmup) rtt[i - o->warmup] = dt;
    }
    pingpong_report(s, o, "msgpingpong", rtt, total, cpu_s() - c0);
}

/* Waits for the forked peer process: 0 if it exited cleanly, else 1 (said on stderr). */
static int wait_peer(pid_t pid) {
    int status = 0;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "aiote_cbench: the peer process failed (status 0x%x)\n", status);
        return 1;
    }
    return 0;
}

/* ------------------------------------------------------------------ bare sockets */

/* Moves messages first .. first+n-1 (slot i % slots of buf) over fd, spinning on a
 * nonblocking send or recv as a poller spins on its queue; the calls it made. */
static uint64_t sock_pump(int fd, uint8_t *buf, const opts_t *o, uint64_t first, uint64_t n, int sending) {
    uint64_t calls = 0;
    for (uint64_t i = first; i < first + n; i++) {
        uint8_t *p = buf + (i % o->slots) * o->size;
        uint64_t off = 0;
        while (off < o->size) {
            ssize_t r = sending ? send(fd, p + off, o->size - off, MSG_DONTWAIT | MSG_NOSIGNAL)
                                : recv(fd, p + off, o->size - off, MSG_DONTWAIT);
            calls++;
            if (r > 0) off += (uint64_t)r;
            else if (r == 0) die("sockets: the peer closed the connection");
            else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                die("sockets %s: %s", sending ? "send" : "recv", strerror(errno));
        }
    }
    return calls;
}

typedef struct sock_report {
    double cpu_s;
    uint64_t calls;
} sock_report;

/* Whether both ends of the connected socket fd have the same IP address, as the core's
 * tcp_tune decides "same host" for its send buffers. */
static int same_host_socket(int fd) {
    struct sockaddr_storage a, b;
    socklen_t al = sizeof(a), bl = sizeof(b);
    if (getsockname(fd, (struct sockaddr *)&a, &al) || getpeername(fd, (struct sockaddr *)&b, &bl) ||
        a.ss_family != b.ss_family)
        return 0;
    if (a.ss_family == AF_INET)
        return ((struct sockaddr_in *)&a)->sin_addr.s_addr == ((struct sockaddr_in *)&b)->sin_addr.s_addr;
    if (a.ss_family == AF_INET6)
        return !memcmp(&((struct sockaddr_in6 *)&a)->sin6_addr, &((struct sockaddr_in6 *)&b)->sin6_addr,
                       sizeof(struct in6_addr));
    return 0;
}

/* sockets SIZE WINDOW TOTAL: rank 0 sends, rank 1 receives, over the connected socket fd
 * (blocking; the pumps pass MSG_DONTWAIT). The control bytes travel back over it too. */
static void run_sockets(const opts_t *o, int rank, int fd) {
    uint64_t n = transfer_count(o), warm = n < o->window ? n : o->window, region = o->size * o->slots;
    int one = 1, got = 0, same_host = same_host_socket(fd);
    socklen_t gl = sizeof(got);
    signal(SIGPIPE, SIG_IGN); /* a peer gone: EPIPE and a message, not a silent death */
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one))) die("TCP_NODELAY: %s", strerror(errno));
    int64_t want = o->sndbuf >= 0 ? o->sndbuf : (same_host ? AIO_TCP_SNDBUF_AUTO : 0);
    if (rank == 0 && want > 0) {
        int v = (int)want;
        if (setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof(v))) die("SO_SNDBUF: %s", strerror(errno));
    }
    getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &got, &gl);
    uint8_t *buf = region_alloc(region, o->small_pages);
    region_touch(buf, region);
    char go = 'g';
    if (rank == 1) {
        sock_pump(fd, buf, o, 0, warm, 0); /* warm-up: connection, first touch, not timed */
        write_full(fd, &go, 1);
        double c0 = cpu_s();
        sock_report rep = {0, sock_pump(fd, buf, o, warm, n, 0)};
        rep.cpu_s = cpu_s() - c0;
        write_full(fd, &rep, sizeof(rep));
        free(buf);
        return;
    }
    sock_pump(fd, buf, o, 0, warm, 1);
    read_full(fd, &go, 1);
    double c0 = cpu_s();
    int64_t t0 = now_ns();
    uint64_t calls = sock_pump(fd, buf, o, warm, n, 1);
    sock_report rep;
    read_full(fd, &rep, sizeof(rep));
    int64_t t1 = now_ns();
    double cpu = cpu_s() - c0, secs = (double)(t1 - t0) * 1e-9, bytes = (double)n * (double)o->size;
    printf("{\"mode\":\"sockets\",\"provider\":\"sockets\",\"nic\":\"%s\",\"size\":%llu,"
           "\"window\":%llu,\"slots\":%llu,\"messages\":%llu,\"total_bytes\":%.0f,\"gbps\":%.3f,"
           "\"seconds\":%.6f,\"writer_cpu_s\":%.3f,\"receiver_cpu_s\":%.3f,\"sndbuf\":%lld,"
           "\"sndbuf_got\":%d,\"send_calls\":%llu,\"recv_calls\":%llu}\n",
           o->nic ? o->nic : "", (unsigned long long)o->size, (unsigned long long)o->window,
           (unsigned long long)o->slots, (unsigned long long)n, bytes, bytes / secs / 1e9, secs, cpu,
           rep.cpu_s, (long long)want, got, (unsigned long long)calls, (unsigned long long)rep.calls);
    free(buf);
}

/* The address the forked sockets run connects to: --nic's IPv4 address (lo: 127.0.0.1). */
static struct sockaddr_in sockets_addr(const opts_t *o) {
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (!o->nic || !strcmp(o->nic, "lo")) return a;
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs)) die("getifaddrs: %s", strerror(errno));
    int found = 0;
    for (struct ifaddrs *i = ifs; i && !found; i = i->ifa_next)
        if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && !strcmp(i->ifa_name, o->nic)) {
            a.sin_addr = ((struct sockaddr_in *)i->ifa_addr)->sin_addr;
            found = 1;
        }
    freeifaddrs(ifs);
    if (!found) die("sockets: --nic %s has no IPv4 address", o->nic);
    return a;
}

/* Forks the sockets run over one connection to sockets_addr: the parent sends. */
static int sockets_forked(const opts_t *o) {
    struct sockaddr_in a = sockets_addr(o);
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    socklen_t al = sizeof(a);
    if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof(a)) || listen(ls, 1) ||
        getsockname(ls, (struct sockaddr *)&a, &al))
        die("sockets: listen on the NIC's address: %s", strerror(errno));
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) die("fork: %s", strerror(errno));
    if (pid == 0) {
        g_role = "peer";
        close(ls);
        int c = socket(AF_INET, SOCK_STREAM, 0);
        if (c < 0 || connect(c, (struct sockaddr *)&a, sizeof(a))) die("sockets: connect: %s", strerror(errno));
        run_sockets(o, 1, c);
        close(c);
        _exit(0);
    }
    struct pollfd pl = {.fd = ls, .events = POLLIN};
    int c = -1;
    if (poll(&pl, 1, 30000) == 1) /* the peer connects at once, or it failed */
        while ((c = accept(ls, NULL, NULL)) < 0 && errno == EINTR) {}
    if (c < 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        die("sockets: the peer did not connect within 30 s");
    }
    close(ls);
    run_sockets(o, 0, c);
    close(c);
    return wait_peer(pid);
}

/* --listen: one connection on PORT (0: any), announced on stdout. */
static int sock_listen(int port) {
    int ls = socket(AF_INET6, SOCK_STREAM, 0), v6 = 1;
    if (ls < 0) {
        v6 = 0;
        ls = socket(AF_INET, SOCK_STREAM, 0);
    }
    if (ls < 0) die("socket: %s", strerror(errno));
    int one = 1, zero = 0;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof(ss));
    socklen_t sl;
    if (v6) {
        setsockopt(ls, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
        a->sin6_family = AF_INET6;
        a->sin6_addr = in6addr_any;
        a->sin6_port = htons((uint16_t)port);
        sl = sizeof(*a);
    } else {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
        a->sin_family = AF_INET;
        a->sin_addr.s_addr = htonl(INADDR_ANY);
        a->sin_port = htons((uint16_t)port);
        sl = sizeof(*a);
    }
    if (bind(ls, (struct sockaddr *)&ss, sl) || listen(ls, 1)) die("bind/listen: %s", strerror(errno));
    sl = sizeof(ss);
    getsockname(ls, (struct sockaddr *)&ss, &sl);
    int got = ntohs(v6 ? ((struct sockaddr_in6 *)&ss)->sin6_port : ((struct sockaddr_in *)&ss)->sin_port);
    printf("{\"listening\":%d}\n", got);
    fflush(stdout);
    int c;
    while ((c = accept(ls, NULL, NULL)) < 0 && errno == EINTR) {}
    if (c < 0) die("accept: %s", strerror(errno));
    close(ls);
    return c;
}

/* --connect HOST:PORT (HOST may be [v6]); retries for 10 s while the peer starts. */
static int sock_connect(const char *spec) {
    char host[256];
    const char *colon = strrchr(spec, ':');
    if (!colon || (size_t)(colon - spec) >= sizeof(host)) die("--connect wants HOST:PORT, got %s", spec);
    memcpy(host, spec, (size_t)(colon - spec));
    host[colon - spec] = 0;
    char *h = host;
    if (h[0] == '[') {
        h++;
        char *e = strchr(h, ']');
        if (e) *e = 0;
    }
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(h, colon + 1, &hints, &res);
    if (rc) die("getaddrinfo %s: %s", spec, gai_strerror(rc));
    int64_t t0 = now_ns();
    for (;;) {
        for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
            int c = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
            if (c < 0) continue;
            if (!connect(c, ai->ai_addr, ai->ai_addrlen)) {
                freeaddrinfo(res);
                return c;
            }
            close(c);
        }
        if (now_ns() - t0 > 10000000000LL) die("could not connect to %s: %s", spec, strerror(errno));
        usleep(50000);
    }
}

/* ------------------------------------------------------------------ main */

static void usage(void) {
    fprintf(stderr,
            "usage: aiote_cbench write SIZE WINDOW TOTAL_BYTES [options]\n"
            "       aiote_cbench pingpong ITERS [options]\n"
            "       aiote_cbench paged PAGE_SIZE NPAGES CALLS [options]\n"
            "       aiote_cbench read SIZE WINDOW TOTAL_BYTES [options]\n"
            "       aiote_cbench sendrecv SIZE WINDOW TOTAL_BYTES [options]\n"
            "       aiote_cbench msgpingpong ITERS [options]\n"
            "       aiote_cbench sockets SIZE WINDOW TOTAL_BYTES [options] (bare TCP, no libfabric)\n"
            "options: --provider tcp|shm  --nic NAME  --spin-ns N  --busy-spin-ns N  --busy\n"
            "         --slots N  --warmup N  --no-gather (paged)  --msg-slots N\n"
            "         --batch N (write, read: N requests per group and aio_post call)\n"
            "         --small-pages (4 KiB pages; default: huge pages from 4 MiB, as NumPy)\n"
            "         --no-direct (shm: READs through the provider, not direct copies)\n"
            "         --arena (shm: the region in a published arena; peers memcpy into it)\n"
            "         --sndbuf N (tcp: same-host send buffers, 0 = the kernel's autotuning)\n"
            "         --hand N (posts handed to the poller: 0 when busy (default), 1 always, -1 never)\n"
            "         --streams N (write, read: N rails on the NIC, request k on rail k %% N)\n"
            "         --pollers N (poller threads, rail i on thread i %% N; default 1)\n"
            "         --listen PORT | --connect HOST:PORT (two hosts: no fork)\n"
            "         --await-write --loop-poll-ns N --think-ns N (pingpong)\n"
            "sizes accept K/M/G suffixes (powers of 1024)\n");
    exit(2);
}

static uint64_t parse_size(const char *s) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) usage();
    switch (*end) {
    case 'k': case 'K': v <<= 10; end++; break;
    case 'm': case 'M': v <<= 20; end++; break;
    case 'g': case 'G': v <<= 30; end++; break;
    default: break;
    }
    if (*end == 'i' || *end == 'I') end++;
    if (*end == 'b' || *end == 'B') end++;
    if (*end) usage();
    return v;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!getenv("FI_PROVIDER")) setenv("FI_PROVIDER", "tcp,ofi_rxm,shm", 1);
    opts_t o;
    memset(&o, 0, sizeof(o));
    o.provider = "tcp";
    o.nic = NULL;
    o.spin_ns = 50000;
    o.warmup = 1000;
    o.msg_slots = MSG_SLOTS;
    o.listen_port = -1;
    o.sndbuf = -1;
    o.streams = 1;
    int nic_given = 0;
    const char *pos[5];
    int npos = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--provider") && i + 1 < argc) o.provider = argv[++i];
        else if (!strcmp(a, "--nic") && i + 1 < argc) { o.nic = argv[++i]; nic_given = 1; }
        else if (!strcmp(a, "--spin-ns") && i + 1 < argc) o.spin_ns = strtoll(argv[++i], NULL, 10);
        else if (!strcmp(a, "--busy-spin-ns") && i + 1 < argc) o.busy_spin_ns = strtoll(argv[++i], NULL, 10);
        else if (!strcmp(a, "--busy")) o.busy = 1;
        else if (!strcmp(a, "--no-gather")) o.no_gather = 1;
        else if (!strcmp(a, "--await-write")) o.await_write = 1;
        else if (!strcmp(a, "--think-ns") && i + 1 < argc) o.think_ns = parse_size(argv[++i]);
        else if (!strcmp(a, "--loop-poll-ns") && i + 1 < argc) o.loop_poll_ns = parse_size(argv[++i]);
        else if (!strcmp(a, "--slots") && i + 1 < argc) o.slots = parse_size(argv[++i]);
        else if (!strcmp(a, "--batch") && i + 1 < argc) o.batch = parse_size(argv[++i]);
        else if (!strcmp(a, "--small-pages")) o.small_pages = 1;
        else if (!strcmp(a, "--arena")) o.arena = 1;
        else if (!strcmp(a, "--no-direct")) o.no_direct = 1;
        else if (!strcmp(a, "--sndbuf") && i + 1 < argc) {
            uint64_t v = parse_size(argv[++i]);
            if (v > INT32_MAX / 2) usage(); /* the kernel doubles it into an int */
            o.sndbuf = (int64_t)v;
        }
        else if (!strcmp(a, "--hand") && i + 1 < argc) o.hand = atoi(argv[++i]);
        else if (!strcmp(a, "--streams") && i + 1 < argc) o.streams = atoi(argv[++i]);
        else if (!strcmp(a, "--pollers") && i + 1 < argc) o.pollers = atoi(argv[++i]);
        else if (!strcmp(a, "--warmup") && i + 1 < argc) o.warmup = parse_size(argv[++i]);
        else if (!strcmp(a, "--msg-slots") && i + 1 < argc) o.msg_slots = parse_size(argv[++i]);
        else if (!strcmp(a, "--listen") && i + 1 < argc) o.listen_port = (int)parse_size(argv[++i]);
        else if (!strcmp(a, "--connect") && i + 1 < argc) o.connect = argv[++i];
        else if (a[0] == '-' && a[1] == '-') usage();
        else if (npos < 5) pos[npos++] = a;
        else usage();
    }
    if (npos < 1) usage();
    o.mode = pos[0];
    if (!nic_given && !strcmp(o.provider, "tcp")) o.nic = "lo";
    if (o.nic && !*o.nic) o.nic = NULL;
    uint64_t region;
    if (o.msg_slots == 0 || o.msg_slots > 65536 || o.listen_port > 65535) usage();
    if (o.streams < 1 || o.streams > MAX_STREAMS || o.pollers < 0 || o.pollers > 16) usage();
    if (o.listen_port >= 0 && o.connect) usage();
    int sockets = !strcmp(o.mode, "sockets");
    if (!strcmp(o.mode, "write") || !strcmp(o.mode, "read") || !strcmp(o.mode, "sendrecv") || sockets) {
        if (npos != 4) usage();
        o.size = parse_size(pos[1]);
        o.window = parse_size(pos[2]);
        o.total = parse_size(pos[3]);
        if (o.size == 0 || o.window == 0) usage();
        if (o.slots == 0) o.slots = o.window;
        if (o.batch == 0) o.batch = 1;
        if (o.batch > MAX_BATCH || o.batch > o.window) usage();
        region = o.size * o.slots;
        if (!strcmp(o.mode, "sendrecv")) region = o.size; /* messages go from the send slots */
    } else if (!strcmp(o.mode, "pingpong") || !strcmp(o.mode, "msgpingpong")) {
        if (npos != 2) usage();
        o.iters = parse_size(pos[1]);
        if (o.iters == 0) usage();
        region = 4096;
    } else if (!strcmp(o.mode, "paged")) {
        if (npos != 4) usage();
        o.page_size = parse_size(pos[1]);
        o.npages = parse_size(pos[2]);
        o.calls = parse_size(pos[3]);
        if (o.page_size == 0 || o.npages == 0 || o.calls == 0) usage();
        if (o.npages > (1ULL << 40) / o.page_size) usage();
        region = o.page_size * o.npages;
    } else {
        usage();
    }

    if (sockets && strcmp(o.provider, "tcp")) usage();
    if (sockets && o.listen_port < 0 && !o.connect) return sockets_forked(&o);
    side_t s;
    memset(&s, 0, sizeof(s));
    int rank;
    pid_t pid = -1;
    if (o.listen_port >= 0 || o.connect) {
        g_role = o.connect ? "writer" : "peer";
        int c = o.connect ? sock_connect(o.connect) : sock_listen(o.listen_port);
        s.rfd = s.wfd = c;
        rank = o.connect ? 0 : 1;
    } else {
        int p2c[2], c2p[2];
        if (pipe(p2c) || pipe(c2p)) die("pipe: %s", strerror(errno));
        fflush(stdout);
        fflush(stderr);
        pid = fork(); /* before any libfabric call in either process */
        if (pid < 0) die("fork: %s", strerror(errno));
        rank = pid == 0 ? 1 : 0;
        if (rank == 1) {
            g_role = "peer";
            close(p2c[1]);
            close(c2p[0]);
            s.rfd = p2c[0];
            s.wfd = c2p[1];
        } else {
            close(p2c[0]);
            close(c2p[1]);
            s.rfd = c2p[0];
            s.wfd = p2c[1];
        }
    }
    if (sockets) { /* across hosts: the control connection carries the data */
        run_sockets(&o, rank, s.rfd);
        close(s.rfd);
        return 0;
    }
    side_init(&s, &o, region);
    side_exchange(&s);
    if (!strcmp(o.mode, "write")) run_write(&s, &o, rank);
    else if (!strcmp(o.mode, "paged")) run_paged(&s, &o, rank);
    else if (!strcmp(o.mode, "read")) run_read(&s, &o, rank);
    else if (!strcmp(o.mode, "sendrecv")) run_sendrecv(&s, &o, rank);
    else if (!strcmp(o.mode, "msgpingpong")) run_msgpingpong(&s, &o, rank);
    else run_pingpong(&s, &o, rank);
    side_free(&s);
    if (pid < 0) return 0; /* --listen / --connect */
    if (rank == 1) _exit(0);
    return wait_peer(pid);
}
