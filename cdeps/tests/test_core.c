/* Plain C tests of the aiote core (cdeps/aiote_core.h), no framework.
 *
 * Every test runs on provider tcp (NIC "lo") and on shm, with two engines in this
 * process connected to each other; one test runs across two processes (fork + exec
 * of this binary with --peer, addresses and region descriptors exchanged over
 * pipes). One line per test, then "N passed, M failed"; the exit status is nonzero
 * when anything failed.
 *
 * Only the public header of the core is used (plus libfabric's error numbers). */
#define _GNU_SOURCE
#include "../aiote_core.h"

#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fi_errno.h>

#define U AIO_CREDIT_UNIT
#define MiB (1024ULL * 1024ULL)
#define REGION_LEN (16 * MiB + 64 * 1024)
#define INBOX 8192
#define SLOTS 64
#define SLOT_SIZE 4096
#define ANY UINT64_MAX
#define TIMEOUT 20.0

/* ------------------------------------------------------------------ harness */

static int g_pass, g_fail;
static char g_why[1024];

static void fail_msg(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void fail_msg(const char *file, int line, const char *fmt, ...) {
    int n = snprintf(g_why, sizeof(g_why), "%s:%d: ", file, line);
    if (n < 0 || (size_t)n >= sizeof(g_why)) n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_why + n, sizeof(g_why) - (size_t)n, fmt, ap);
    va_end(ap);
}

#define CHECK(cond, ...)                                   \
    do {                                                   \
        if (!(cond)) {                                     \
            fail_msg(__FILE__, __LINE__, __VA_ARGS__);     \
            return -1;                                     \
        }                                                  \
    } while (0)

/* a call returning 0 / negative error */
#define CHECK_OK(expr)                                                                   \
    do {                                                                                 \
        long long _r = (long long)(expr);                                                \
        if (_r != 0) {                                                                   \
            fail_msg(__FILE__, __LINE__, "%s = %lld (%s)", #expr, _r,                    \
                     _r < 0 ? aio_strerror((int)_r) : "unexpected");                     \
            return -1;                                                                   \
        }                                                                                \
    } while (0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_us(long us) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* byte k of pattern `seed`: position based, so any sub-range can be checked */
static inline uint8_t pat(uint64_t k, uint32_t seed) {
    uint32_t x = (uint32_t)k * 0x9E3779B1u + seed * 0x85EBCA77u + (uint32_t)(k >> 32);
    x ^= x >> 15;
    x *= 0x2C1B3C6Du;
    x ^= x >> 12;
    return (uint8_t)x;
}

static void fill(uint8_t *p, uint64_t n, uint64_t k0, uint32_t seed) {
    for (uint64_t i = 0; i < n; i++) p[i] = pat(k0 + i, seed);
}

/* index of the first byte that differs from the pattern, or -1 */
static int64_t verify(const uint8_t *p, uint64_t n, uint64_t k0, uint32_t seed) {
    for (uint64_t i = 0; i < n; i++)
        if (p[i] != pat(k0 + i, seed)) return (int64_t)i;
    return -1;
}

/* ------------------------------------------------------------------ engines */

typedef struct eng {
    aio_engine *e;
    int rail;
    aio_rail_info info;
    aio_record *inbox;
    int ninbox;
    uint64_t peer; /* fi_addr of the other engine on our rail */
    uint8_t *buf;
    uint64_t len;
    aio_mr *mr;
} eng_t;

static uint64_t g_token = 1000;

static void eng_free(eng_t *x) {
    if (x->e) {
        if (x->mr) aio_mr_close(x->e, x->mr);
        aio_engine_destroy(x->e);
    }
    free(x->inbox);
    free(x->buf);
    memset(x, 0, sizeof(*x));
}

static int32_t g_watch_us; /* the next engines' watch interval (0: the default) */

/* An engine with `nrails` rails of the provider (x->rail: the first) driven by `pollers`
 * poller threads, its region registered on all of them. */
static int eng_init_p(eng_t *x, const char *prov, const char *nic, uint64_t region_len, int nrails,
                      int pollers) {
    memset(x, 0, sizeof(*x));
    char err[512] = "";
    aio_engine_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.ring_capacity = 4096;
    cfg.spin_ns = 20000;
    cfg.sleep_ms = 100;
    cfg.watch_us = g_watch_us;
    int ret = aio_engine_create(&cfg, &x->e, err, sizeof(err));
    CHECK(ret == 0, "aio_engine_create: %s (%s)", aio_strerror(ret), err);
    if (pollers != 1) CHECK_OK(aio_engine_set_pollers(x->e, pollers));
    for (int i = 0; i < nrails; i++) {
        ret = aio_engine_add_rail(x->e, prov, nic, SLOTS, SLOT_SIZE, err, sizeof(err));
        CHECK(ret >= 0, "aio_engine_add_rail(%s, %s): %s (%s)", prov, nic ? nic : "-",
              aio_strerror(ret), err);
        if (i == 0) x->rail = ret;
    }
    CHECK_OK(aio_rail_get_info(x->e, x->rail, &x->info));
    CHECK_OK(aio_engine_start(x->e));
    x->inbox = calloc(INBOX, sizeof(aio_record));
    CHECK(x->inbox, "out of memory");
    if (region_len) {
        void *b = NULL;
        CHECK(posix_memalign(&b, 4096, region_len) == 0, "posix_memalign");
        x->buf = b;
        x->len = region_len;
        memset(x->buf, 0, region_len);
        ret = aio_mr_register(x->e, x->buf, region_len,
                              AIO_ACCESS_REMOTE_WRITE | AIO_ACCESS_REMOTE_READ, &x->mr, err,
                              sizeof(err));
        CHECK(ret == 0, "aio_mr_register: %s (%s)", aio_strerror(ret), err);
    }
    return 0;
}

static int eng_init_n(eng_t *x, const char *prov, const char *nic, uint64_t region_len, int nrails) {
    return eng_init_p(x, prov, nic, region_len, nrails, 1);
}

static int eng_init(eng_t *x, const char *prov, const char *nic, uint64_t region_len) {
    return eng_init_n(x, prov, nic, region_len, 1);
}

/* Drains the engine's ring into its inbox. */
static int pump(eng_t *x) {
    if (x->ninbox >= INBOX) return 0;
    int n = aio_drain(x->e, x->inbox + x->ninbox, INBOX - x->ninbox);
    x->ninbox += n;
    return n;
}

static int take_rec(eng_t *x, int kind, uint64_t token, aio_record *out) {
    for (int i = 0; i < x->ninbox; i++) {
        if (x->inbox[i].kind != kind || (token != ANY && x->inbox[i].token != token)) continue;
        if (out) *out = x->inbox[i];
        memmove(&x->inbox[i], &x->inbox[i + 1], (size_t)(x->ninbox - i - 1) * sizeof(aio_record));
        x->ninbox--;
        return 1;
    }
    return 0;
}

static int count_rec(eng_t *x, int kind, uint64_t token) {
    int c = 0;
    for (int i = 0; i < x->ninbox; i++)
        if (x->inbox[i].kind == kind && (token == ANY || x->inbox[i].token == token)) c++;
    return c;
}

/* Waits for a record (drain polled with 50 us sleeps). 0, or -1 on timeout. */
static int wait_rec(eng_t *x, int kind, uint64_t token, double timeout, aio_record *out) {
    double t0 = now_s();
    for (;;) {
        if (take_rec(x, kind, token, out)) return 0;
        if (pump(x) == 0) {
            if (now_s() - t0 > timeout) return -1;
            sleep_us(50);
        }
    }
}

/* Takes `units` of counter `imm`, polling. 0, or -1 on timeout. */
static int wait_take(eng_t *x, uint32_t imm, uint64_t units, double timeout) {
    double t0 = now_s();
    while (!aio_counter_take(x->e, imm, units)) {
        pump(x);
        if (now_s() - t0 > timeout) return -1;
        sleep_us(50);
    }
    return 0;
}

/* Waits until aio_counter_total(imm) >= units. */
static int wait_total(eng_t *x, uint32_t imm, uint64_t units, double timeout) {
    double t0 = now_s();
    while (aio_counter_total(x->e, imm) < units) {
        pump(x);
        if (now_s() - t0 > timeout) return -1;
        sleep_us(50);
    }
    return 0;
}

/* Posts all n items into group g, retrying while aio_post posts fewer (queue full,
 * or a connection to a new peer being set up). 0, a negative error, or -FI_ETIMEDOUT. */
static int post_all(eng_t *x, int64_t g, const aio_op_desc *it, int64_t n, double timeout) {
    int64_t done = 0;
    double t0 = now_s();
    while (done < n) {
        int64_t r = aio_post(x->e, g, it + done, n - done, 1000000);
        if (r < 0) return (int)r;
        done += r;
        if (r == 0) {
            if (now_s() - t0 > timeout) return -FI_ETIMEDOUT;
            sleep_us(50);
        }
    }
    return 0;
}

static aio_op_desc op_to(eng_t *src, eng_t *dst, int op, uint64_t loff, uint64_t roff,
                         uint64_t len, int flags, uint64_t data) {
    aio_op_desc d;
    memset(&d, 0, sizeof(d));
    d.mr = src->mr;
    d.offset = loff;
    d.length = len;
    d.peer = src->peer;
    d.raddr = aio_mr_remote_base(dst->mr, dst->rail) + roff;
    d.rkey = aio_mr_key(dst->mr, dst->rail);
    d.data = data;
    d.rail = src->rail;
    d.op = op;
    d.flags = flags;
    return d;
}

/* Opens a group, posts the items, seals it and waits for its record (whatever its status). */
static int group_record(eng_t *x, const aio_op_desc *it, int64_t n, aio_record *r) {
    uint64_t tok = g_token++;
    int64_t g = aio_group_open(x->e, tok);
    CHECK(g >= 0, "aio_group_open: %s", aio_strerror((int)g));
    int ret = post_all(x, g, it, n, TIMEOUT);
    CHECK(ret == 0, "posting %lld ops: %s", (long long)n, aio_strerror(ret));
    CHECK_OK(aio_group_seal(x->e, g));
    CHECK(wait_rec(x, AIO_REC_GROUP, tok, TIMEOUT, r) == 0, "no group record for token %llu",
          (unsigned long long)tok);
    return 0;
}

/* group_record, and the group must have succeeded with all n requests. */
static int run_group(eng_t *x, const aio_op_desc *it, int64_t n, aio_record *rec) {
    aio_record r;
    int rc = group_record(x, it, n, &r);
    if (rc) return rc;
    CHECK(r.status == 0, "group status %d (%s), prov_errno %d", r.status, aio_strerror(r.status),
          r.prov_errno);
    CHECK(r.a == (uint64_t)n, "group record a = %llu, want %lld", (unsigned long long)r.a,
          (long long)n);
    if (rec) *rec = r;
    return 0;
}

typedef struct fix {
    const char *prov;
    const char *nic;
    const char *name;
    eng_t a, b;
    uint8_t *arena; /* b's arena (direct tests), set once: ARENA_LEN bytes of a memfd */
} fix_t;

static int connect_pair(eng_t *a, eng_t *b) {
    CHECK_OK(aio_av_insert(a->e, a->rail, b->info.addr, b->info.addr_len, &a->peer));
    CHECK_OK(aio_av_insert(b->e, b->rail, a->info.addr, a->info.addr_len, &b->peer));
    return 0;
}

/* ------------------------------------------------------------------ tests */

static int t_write_sizes(fix_t *f) {
    static const uint64_t sizes[] = {1,    2,     3,     7,     63,    64,      65,
                                     4095, 4096,  4097,  65535, 65536, 65537,   MiB - 1,
                                     MiB,  MiB + 7, 4 * MiB, 16 * MiB};
    eng_t *a = &f->a, *b = &f->b;
    for (unsigned i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        uint64_t len = sizes[i];
        uint64_t loff = (i * 13u) % 4096;
        uint64_t roff = (i * 29u + 5u) % 4096 + 1;
        uint32_t seed = 0x100 + i, imm = 0x1000 + i;
        fill(a->buf + loff, len, 0, seed);
        memset(b->buf + roff - 1, 0xEE, len + 2);
        aio_op_desc d = op_to(a, b, AIO_OP_WRITE, loff, roff, len, AIO_F_DATA, imm);
        if (run_group(a, &d, 1, NULL)) return -1;
        CHECK(wait_take(b, imm, U, TIMEOUT) == 0, "size %llu: no credit at the receiver",
              (unsigned long long)len);
        int64_t bad = verify(b->buf + roff, len, 0, seed);
        CHECK(bad < 0, "size %llu at offset %llu->%llu: byte %lld differs",
              (unsigned long long)len, (unsigned long long)loff, (unsigned long long)roff,
              (long long)bad);
        CHECK(b->buf[roff - 1] == 0xEE && b->buf[roff + len] == 0xEE,
              "size %llu: bytes outside the target range were written", (unsigned long long)len);
        CHECK(aio_counter_available(b->e, imm) == 0 && aio_counter_total(b->e, imm) == U,
              "size %llu: counter avail %llu total %llu", (unsigned long long)len,
              (unsigned long long)aio_counter_available(b->e, imm),
              (unsigned long long)aio_counter_total(b->e, imm));
    }
    CHECK(aio_mr_inflight(a->mr) == 0, "inflight %lld", (long long)aio_mr_inflight(a->mr));
    return 0;
}

static int t_zero_byte_imm(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    uint32_t imm = 0x2000;
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 0, 0, AIO_F_DATA, imm);
    if (run_group(a, &d, 1, NULL)) return -1;
    CHECK(wait_total(b, imm, U, TIMEOUT) == 0, "0-byte write: no credit");
    sleep_us(20000);
    CHECK(aio_counter_total(b->e, imm) == U && aio_counter_available(b->e, imm) == U,
          "0-byte write credited %llu, want %llu", (unsigned long long)aio_counter_total(b->e, imm),
          (unsigned long long)U);
    /* three more, in one group */
    aio_op_desc ds[3] = {d, d, d};
    if (run_group(a, ds, 3, NULL)) return -1;
    CHECK(wait_take(b, imm, 4 * U, TIMEOUT) == 0, "0-byte writes: credits missing");
    CHECK(aio_counter_available(b->e, imm) == 0, "leftover credit");
    return 0;
}

static int t_weight(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    CHECK(a->info.cq_data_size >= 8 && b->info.cq_data_size >= 8,
          "cq_data_size %u: no room for a weight field", b->info.cq_data_size);
    uint32_t imm = 0x2100;
    uint64_t w1 = 12345, w2 = U - w1;
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 64, 8, AIO_F_DATA, imm | (w1 << 32));
    if (run_group(a, &d, 1, NULL)) return -1;
    CHECK(wait_total(b, imm, w1, TIMEOUT) == 0, "weighted write: no credit");
    sleep_us(10000);
    CHECK(aio_counter_available(b->e, imm) == w1, "weight %llu credited %llu",
          (unsigned long long)w1, (unsigned long long)aio_counter_available(b->e, imm));
    CHECK(aio_counter_take(b->e, imm, U) == 0, "took a whole unit out of %llu",
          (unsigned long long)w1);
    d = op_to(a, b, AIO_OP_WRITE, 0, 64, 0, AIO_F_DATA, imm | (w2 << 32));
    if (run_group(a, &d, 1, NULL)) return -1;
    CHECK(wait_take(b, imm, U, TIMEOUT) == 0, "two shards did not add up to one unit");
    CHECK(aio_counter_available(b->e, imm) == 0 && aio_counter_total(b->e, imm) == U,
          "avail %llu total %llu", (unsigned long long)aio_counter_available(b->e, imm),
          (unsigned long long)aio_counter_total(b->e, imm));
    return 0;
}

static int t_counters(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    uint32_t imm = 0x3000;
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 0, 0, AIO_F_DATA, imm);
    CHECK(aio_counter_available(b->e, imm) == 0 && aio_counter_total(b->e, imm) == 0, "fresh");
    CHECK(aio_counter_take(b->e, imm, 1) == 0, "took from an empty counter");
    CHECK(aio_counter_take(b->e, imm, 0) == 1, "taking 0 units must succeed");
    CHECK(aio_counter_watch(b->e, imm, 2 * U) == 0, "watch(2U) on an empty counter");
    if (run_group(a, &d, 1, NULL)) return -1;
    CHECK(wait_total(b, imm, U, TIMEOUT) == 0, "first credit");
    sleep_us(20000);
    pump(b);
    CHECK(count_rec(b, AIO_REC_COUNTER, imm) == 0, "watch fired at 1 of 2 units");
    if (run_group(a, &d, 1, NULL)) return -1;
    aio_record r;
    CHECK(wait_rec(b, AIO_REC_COUNTER, imm, TIMEOUT, &r) == 0, "watch did not fire");
    CHECK(r.status == 0 && r.token == imm, "record token %llu status %d",
          (unsigned long long)r.token, r.status);
    CHECK(aio_counter_available(b->e, imm) == 2 * U, "avail after watch");
    CHECK(aio_counter_take(b->e, imm, 2 * U) == 1, "take(2U)");
    CHECK(aio_counter_take(b->e, imm, 1) == 0, "took past zero");
    CHECK(aio_counter_total(b->e, imm) == 2 * U, "total");
    /* refund: back into available, not into total */
    aio_counter_refund(b->e, imm, U);
    CHECK(aio_counter_available(b->e, imm) == U && aio_counter_total(b->e, imm) == 2 * U,
          "refund: avail %llu total %llu", (unsigned long long)aio_counter_available(b->e, imm),
          (unsigned long long)aio_counter_total(b->e, imm));
    /* already satisfied: 1, nothing armed, no record */
    CHECK(aio_counter_watch(b->e, imm, U) == 1, "watch on a satisfied counter must return 1");
    sleep_us(10000);
    pump(b);
    CHECK(count_rec(b, AIO_REC_COUNTER, imm) == 0, "a satisfied watch pushed a record");
    /* a refund that satisfies a watch fires it */
    CHECK(aio_counter_watch(b->e, imm, 2 * U) == 0, "watch(2U) with U available");
    aio_counter_refund(b->e, imm, U);
    CHECK(wait_rec(b, AIO_REC_COUNTER, imm, TIMEOUT, &r) == 0, "refund did not fire the watch");
    CHECK(aio_counter_take(b->e, imm, 2 * U) == 1, "take after refund");
    /* a watch fires once: further credits push nothing */
    uint32_t imm2 = 0x3001;
    CHECK(aio_counter_watch(b->e, imm2, U) == 0, "watch imm2");
    aio_counter_add(b->e, imm2, U);
    CHECK(wait_rec(b, AIO_REC_COUNTER, imm2, TIMEOUT, NULL) == 0, "local add did not fire");
    aio_counter_add(b->e, imm2, U);
    d.data = imm2;
    if (run_group(a, &d, 1, NULL)) return -1;
    CHECK(wait_total(b, imm2, 3 * U, TIMEOUT) == 0, "imm2 credits");
    sleep_us(10000);
    pump(b);
    CHECK(count_rec(b, AIO_REC_COUNTER, imm2) == 0, "a watch fired twice");
    CHECK(aio_counter_take(b->e, imm2, 3 * U) == 1, "take imm2");
    /* counters of different imms do not mix */
    CHECK(aio_counter_available(b->e, imm) == 0 && aio_counter_available(b->e, imm2) == 0,
          "leftovers");
    CHECK(aio_counter_available(a->e, imm) == 0, "the writer got credits");
    return 0;
}

/* Releasing counters: many imms created and released keep the table consistent (probe
 * chains survive deletions), and a released counter starts again from zero. */
static int t_counter_release(fix_t *f) {
    eng_t *b = &f->b;
    for (uint32_t k = 0; k < 5000; k++) aio_counter_add(b->e, 0x700000 + k * 7919u, AIO_CREDIT_UNIT * (k % 5 + 1));
    for (uint32_t k = 0; k < 5000; k += 2) CHECK(aio_counter_release(b->e, 0x700000 + k * 7919u) == 1, "release %u", k);
    for (uint32_t k = 0; k < 5000; k++) {
        uint64_t want = (k % 2) ? AIO_CREDIT_UNIT * (k % 5 + 1) : 0;
        CHECK(aio_counter_available(b->e, 0x700000 + k * 7919u) == want, "counter %u after releases", k);
    }
    CHECK(aio_counter_release(b->e, 0x7fffffff) == 0, "releasing an unknown counter");
    CHECK(aio_counter_watch(b->e, 0x700001, AIO_CREDIT_UNIT) == 0, "watch");
    CHECK(aio_counter_release(b->e, 0x700001) == -FI_EBUSY, "released a watched counter");
    aio_counter_add(b->e, 0x700001, AIO_CREDIT_UNIT);
    pump(b);
    for (uint32_t k = 1; k < 5000; k += 2) aio_counter_release(b->e, 0x700000 + k * 7919u);
    return 0;
}

static int t_read(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    static const uint64_t sizes[] = {1, 4097, MiB + 3, 4 * MiB};
    for (unsigned i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        uint64_t len = sizes[i], roff = 100 + i * 7, loff = 4000 - i * 3;
        uint32_t seed = 0x400 + i;
        fill(b->buf + roff, len, 0, seed);
        memset(a->buf + loff - 1, 0xEE, len + 2);
        aio_op_desc d = op_to(a, b, AIO_OP_READ, loff, roff, len, 0, 0);
        if (run_group(a, &d, 1, NULL)) return -1;
        int64_t bad = verify(a->buf + loff, len, 0, seed);
        CHECK(bad < 0, "read of %llu: byte %lld differs", (unsigned long long)len, (long long)bad);
        CHECK(a->buf[loff - 1] == 0xEE && a->buf[loff + len] == 0xEE, "read overran");
    }
    /* several reads in one group */
    aio_op_desc ds[8];
    fill(b->buf, 8 * 65536, 0, 0x4ff);
    for (int i = 0; i < 8; i++) ds[i] = op_to(a, b, AIO_OP_READ, (uint64_t)i * 65536, (uint64_t)i * 65536, 65536, 0, 0);
    if (run_group(a, ds, 8, NULL)) return -1;
    CHECK(verify(a->buf, 8 * 65536, 0, 0x4ff) < 0, "grouped reads");
    CHECK(aio_counter_total(b->e, 0) == 0, "a read credited a counter");
    return 0;
}

static int t_sendrecv(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    uint64_t slot = b->info.slot_size;
    CHECK(slot == SLOT_SIZE, "slot_size %llu", (unsigned long long)slot);
    static uint8_t big[SLOT_SIZE + 1];
    fill(big, sizeof(big), 0, 0x500);
    const uint64_t lens[3] = {0, 5, slot};
    const void *bufs[3] = {"", "hello", big};
    uint64_t tok = g_token++;
    int64_t g = aio_group_open(a->e, tok);
    CHECK(g >= 0, "group");
    for (int i = 0; i < 3; i++) {
        double t0 = now_s();
        int r;
        /* the slot-sized one in two parts (aio_post_sendv): head and body land back to back */
        while ((r = i < 2 ? aio_post_send(a->e, g, a->rail, a->peer, bufs[i], lens[i], 1000000)
                          : aio_post_sendv(a->e, g, a->rail, a->peer, big, 100, big + 100, slot - 100,
                                           1000000)) == 0) {
            CHECK(now_s() - t0 < TIMEOUT, "send of %llu never posted", (unsigned long long)lens[i]);
            sleep_us(50);
        }
        CHECK(r == 1, "aio_post_send(%llu) = %d (%s)", (unsigned long long)lens[i], r,
              aio_strerror(r));
    }
    CHECK_OK(aio_group_seal(a->e, g));
    aio_record r;
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0, "no send group record");
    CHECK(r.status == 0 && r.a == 3, "send group status %d a %llu", r.status,
          (unsigned long long)r.a);
    int seen[3] = {0, 0, 0};
    for (int k = 0; k < 3; k++) {
        CHECK(wait_rec(b, AIO_REC_RECV, ANY, TIMEOUT, &r) == 0, "only %d of 3 messages arrived", k);
        CHECK(r.status == 0, "recv status %d", r.status);
        CHECK(r.rail == b->rail && r.a < SLOTS, "recv rail %d slot %llu", r.rail,
              (unsigned long long)r.a);
        const uint8_t *p = aio_recv_slot(b->e, r.rail, (uint32_t)r.a);
        CHECK(p, "aio_recv_slot");
        int which = r.b == 0 ? 0 : r.b == 5 ? 1 : r.b == slot ? 2 : -1;
        CHECK(which >= 0 && !seen[which], "unexpected message length %llu", (unsigned long long)r.b);
        seen[which] = 1;
        if (which == 1) CHECK(memcmp(p, "hello", 5) == 0, "5-byte message content");
        if (which == 2) CHECK(verify(p, slot, 0, 0x500) < 0, "slot-size message content");
        CHECK_OK(aio_recv_repost(b->e, r.rail, (uint32_t)r.a));
    }
    /* one byte too many */
    tok = g_token++;
    g = aio_group_open(a->e, tok);
    CHECK(g >= 0, "group");
    int rs = aio_post_send(a->e, g, a->rail, a->peer, big, slot + 1, 1000000);
    CHECK(rs == -FI_EMSGSIZE, "send of slot_size+1 returned %d, want -FI_EMSGSIZE", rs);
    rs = aio_post_sendv(a->e, g, a->rail, a->peer, big, 1, big, slot, 1000000);
    CHECK(rs == -FI_EMSGSIZE, "sendv of 1 + slot_size returned %d, want -FI_EMSGSIZE", rs);
    CHECK(aio_group_pending(a->e, g) == 0, "the oversized send was posted");
    CHECK_OK(aio_group_seal(a->e, g));
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0 && r.a == 0 && r.status == 0,
          "an empty sealed group must complete at once");
    /* more messages than slots: reposting works */
    for (int i = 0; i < SLOTS + 16; i++) {
        uint64_t v = 0xabc00000ULL + (uint64_t)i;
        tok = g_token++;
        g = aio_group_open(a->e, tok);
        CHECK(g >= 0, "group");
        double t0 = now_s();
        int ps;
        while ((ps = aio_post_send(a->e, g, a->rail, a->peer, &v, 8, 1000000)) == 0) {
            CHECK(now_s() - t0 < TIMEOUT, "send never posted");
            sleep_us(50);
        }
        CHECK(ps == 1, "send %d: %s", i, aio_strerror(ps));
        CHECK_OK(aio_group_seal(a->e, g));
        CHECK(wait_rec(b, AIO_REC_RECV, ANY, TIMEOUT, &r) == 0, "message %d did not arrive", i);
        uint64_t got;
        memcpy(&got, aio_recv_slot(b->e, r.rail, (uint32_t)r.a), 8);
        CHECK(r.b == 8 && got == v, "message %d: len %llu value %llx", i, (unsigned long long)r.b,
              (unsigned long long)got);
        CHECK_OK(aio_recv_repost(b->e, r.rail, (uint32_t)r.a));
        CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0 && r.status == 0, "send %d group", i);
    }
    return 0;
}

static int t_batch10k(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    enum { N = 10000, SZ = 16 };
    uint32_t imm = 0x5000;
    uint64_t rbase = MiB;
    aio_op_desc *ds = calloc(N, sizeof(*ds));
    CHECK(ds, "oom");
    fill(a->buf, (uint64_t)N * SZ, 0, 0x600);
    memset(b->buf + rbase, 0, (uint64_t)N * SZ);
    for (int i = 0; i < N; i++)
        ds[i] = op_to(a, b, AIO_OP_WRITE, (uint64_t)i * SZ, rbase + (uint64_t)i * SZ, SZ,
                      AIO_F_DATA, imm);
    uint64_t tok = g_token++;
    int64_t g = aio_group_open(a->e, tok);
    if (g < 0) free(ds);
    CHECK(g >= 0, "group");
    int64_t done = 0, calls = 0;
    double t0 = now_s();
    int err = 0;
    while (done < N) {
        int64_t r = aio_post(a->e, g, ds + done, N - done, 1000000);
        calls++;
        if (r < 0) {
            err = (int)r;
            break;
        }
        done += r;
        if (r == 0) {
            if (now_s() - t0 > TIMEOUT) {
                err = -FI_ETIMEDOUT;
                break;
            }
            sleep_us(50);
        }
    }
    free(ds);
    CHECK(err == 0, "posting stopped at %lld: %s", (long long)done, aio_strerror(err));
    CHECK_OK(aio_group_seal(a->e, g));
    aio_record r;
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, 60, &r) == 0, "no group record");
    CHECK(r.status == 0 && r.a == N, "group status %d a %llu", r.status, (unsigned long long)r.a);
    CHECK(wait_take(b, imm, (uint64_t)N * U, 60) == 0, "receiver got %llu of %d credits",
          (unsigned long long)(aio_counter_total(b->e, imm) / U), N);
    CHECK(verify(b->buf + rbase, (uint64_t)N * SZ, 0, 0x600) < 0, "batch bytes");
    sleep_us(200000);
    pump(a);
    CHECK(count_rec(a, AIO_REC_GROUP, tok) == 0, "the group record came twice");
    CHECK(aio_ops_in_flight(a->e) == 0, "ops in flight %lld", (long long)aio_ops_in_flight(a->e));
    CHECK(aio_counter_total(b->e, imm) == (uint64_t)N * U, "extra credits");
    printf("    (%lld aio_post calls for %d writes)\n", (long long)calls, N);
    return 0;
}

/* Groups of one write, sealed only once the write has completed (pending == 0), the
 * next group opened as soon as the record is drained (it reuses the slot). Every
 * record must carry its own token and a == 1. A completion racing with the seal of
 * the previous group must not finish the next group that reuses its slot. */
static int t_group_race(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 0, 8, 0, 0);
    const int max_iters = 50000;
    double t0 = now_s();
    int i, bad = 0;
    aio_record r;
    memset(&r, 0, sizeof(r));
    while (pump(a)) {
    }
    a->ninbox = 0;
    for (i = 0; i < max_iters && now_s() - t0 < 4.0; i++) {
        uint64_t tok = g_token++;
        int64_t g = aio_group_open(a->e, tok);
        CHECK(g >= 0, "group");
        CHECK(post_all(a, g, &d, 1, TIMEOUT) == 0, "post");
        double t1 = now_s();
        while (aio_group_pending(a->e, g) != 0)
            CHECK(now_s() - t1 < TIMEOUT, "write %d never completed", i);
        int sr = aio_group_seal(a->e, g);
        int n;
        t1 = now_s();
        while ((n = aio_drain(a->e, &r, 1)) == 0)
            CHECK(now_s() - t1 < TIMEOUT, "no record for group %d", i);
        if (sr != 0 || r.kind != AIO_REC_GROUP || r.token != tok || r.a != 1 || r.status != 0) {
            bad = 1;
            fail_msg(__FILE__, __LINE__,
                     "iteration %d: seal %d; record kind %d token %llu (want %llu) a %llu status %d",
                     i, sr, r.kind, (unsigned long long)r.token, (unsigned long long)tok,
                     (unsigned long long)r.a, r.status);
            break;
        }
    }
    /* let whatever is left settle, then forget it */
    sleep_us(100000);
    while (pump(a)) {
    }
    a->ninbox = 0;
    if (bad) return -1;
    printf("    (%d groups)\n", i);
    return 0;
}

/* Paged writes: reversed and repeated page indices with strides larger than the page,
 * each page carrying the imm; a page past the remote region is refused before posting. */
static int t_paged(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    enum { NP = 300, PS = 1000, SS = 1536, DS = 2048 };
    int64_t sp[NP], dp[NP];
    for (int k = 0; k < NP; k++) {
        sp[k] = k % 7 == 3 ? 5 : k;  /* repeated source pages */
        dp[k] = NP - 1 - k;          /* reversed destinations */
    }
    fill(a->buf, (uint64_t)SS * NP + 64, 0, 77);
    memset(b->buf, 0, (uint64_t)DS * NP + 64);
    aio_paged_desc d;
    memset(&d, 0, sizeof(d));
    d.mr = a->mr;
    d.src_pages = sp;
    d.dst_pages = dp;
    d.page_size = PS;
    d.src_stride = SS;
    d.dst_stride = DS;
    d.src_offset = 64;
    d.dst_offset = 32;
    d.remote_len = b->len;
    d.data = 0x5150;
    d.flags = AIO_F_DATA;
    d.nroutes = 1;
    d.first_route = 0;
    d.routes[0].rail = a->rail;
    d.routes[0].peer = a->peer;
    d.routes[0].rbase = aio_mr_remote_base(b->mr, b->rail);
    d.routes[0].rkey = aio_mr_key(b->mr, b->rail);
    uint64_t tok = g_token++;
    int64_t g = aio_group_open(a->e, tok);
    CHECK(g >= 0, "aio_group_open");
    int64_t done = 0;
    double t0 = now_s();
    while (done < NP) {
        int64_t r = aio_post_paged(a->e, g, &d, done, NP, 1000000);
        CHECK(r >= 0, "aio_post_paged: %s", aio_strerror((int)r));
        done += r;
        CHECK(now_s() - t0 < TIMEOUT, "paged post timed out");
        if (r == 0) sleep_us(50);
    }
    CHECK_OK(aio_group_seal(a->e, g));
    aio_record rec;
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &rec) == 0, "no group record");
    CHECK(rec.status == 0 && rec.a == NP, "group status %d, %llu ops", rec.status,
          (unsigned long long)rec.a);
    CHECK(wait_take(b, 0x5150, (uint64_t)NP * AIO_CREDIT_UNIT, TIMEOUT) == 0, "imm credits");
    for (int k = 0; k < NP; k++) {
        const uint8_t *want = a->buf + 64 + (uint64_t)sp[k] * SS;
        const uint8_t *got = b->buf + 32 + (uint64_t)dp[k] * DS;
        CHECK(memcmp(want, got, PS) == 0, "page %d differs", k);
    }
    /* gathering: contiguous destinations, scattered sources, one weighted credit per
     * request that adds up to one unit per page */
    for (int k = 0; k < NP; k++) {
        sp[k] = (k * 37) % NP;
        dp[k] = k < NP / 2 ? k : k + 3; /* two contiguous runs with a gap */
    }
    memset(b->buf, 0, (uint64_t)DS * NP + 64);
    d.gather = 1;
    d.dst_stride = PS;
    d.data = 0x5151;
    tok = g_token++;
    g = aio_group_open(a->e, tok);
    CHECK(g >= 0, "aio_group_open");
    done = 0;
    while (done < NP) {
        int64_t r = aio_post_paged(a->e, g, &d, done, NP, 1000000);
        CHECK(r >= 0, "aio_post_paged (gather): %s", aio_strerror((int)r));
        done += r;
        if (r == 0) sleep_us(50);
    }
    CHECK_OK(aio_group_seal(a->e, g));
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &rec) == 0, "no group record (gather)");
    CHECK(rec.status == 0, "gather group status %d", rec.status);
    CHECK(rec.a < NP, "gathering formed no multi-page request (%llu requests)", (unsigned long long)rec.a);
    CHECK(wait_take(b, 0x5151, (uint64_t)NP * AIO_CREDIT_UNIT, TIMEOUT) == 0, "gather credits");
    sleep_us(20000);
    CHECK(aio_counter_available(b->e, 0x5151) == 0, "extra credits after gathering");
    for (int k = 0; k < NP; k++) {
        const uint8_t *want = a->buf + 64 + (uint64_t)sp[k] * SS;
        const uint8_t *got = b->buf + 32 + (uint64_t)dp[k] * PS;
        CHECK(memcmp(want, got, PS) == 0, "gathered page %d differs", k);
    }
    d.gather = 0;
    d.dst_stride = DS;
    for (int k = 0; k < NP; k++) dp[k] = NP - 1 - k;
    /* a destination page past the remote region: refused, nothing posted */
    dp[0] = (int64_t)(b->len / DS);
    g = aio_group_open(a->e, g_token++);
    CHECK(g >= 0, "aio_group_open");
    CHECK(aio_post_paged(a->e, g, &d, 0, NP, 1000000) == -FI_EINVAL, "bad page accepted");
    dp[0] = -1;
    CHECK(aio_post_paged(a->e, g, &d, 0, NP, 1000000) == -FI_EINVAL, "negative page accepted");
    CHECK(aio_group_pending(a->e, g) == 0, "something was posted");
    CHECK_OK(aio_group_seal(a->e, g));
    return 0;
}

static int t_post_invalid(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    uint64_t tok = g_token++;
    int64_t g = aio_group_open(a->e, tok);
    CHECK(g >= 0, "group");
    int64_t before = aio_ops_in_flight(a->e);
    struct {
        uint64_t off, len;
    } bad[] = {{REGION_LEN + 1, 0},  {REGION_LEN - 4, 8}, {0, REGION_LEN + 1},
               {UINT64_MAX - 2, 8}, {8, UINT64_MAX - 4}, {REGION_LEN, 1}};
    for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        for (int op = AIO_OP_WRITE; op <= AIO_OP_READ; op++) {
            aio_op_desc d = op_to(a, b, op, bad[i].off, 0, bad[i].len, 0, 0);
            int64_t r = aio_post(a->e, g, &d, 1, 0);
            CHECK(r == -FI_EINVAL, "offset %llu length %llu op %d: aio_post = %lld, want -FI_EINVAL",
                  (unsigned long long)bad[i].off, (unsigned long long)bad[i].len, op, (long long)r);
        }
    }
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 0, 8, 0, 0);
    d.rail = 7;
    CHECK(aio_post(a->e, g, &d, 1, 0) == -FI_EINVAL, "bad rail accepted");
    d = op_to(a, b, 9, 0, 0, 8, 0, 0);
    CHECK(aio_post(a->e, g, &d, 1, 0) == -FI_EINVAL, "bad op accepted");
    CHECK(aio_group_pending(a->e, g) == 0, "something was posted");
    CHECK(aio_ops_in_flight(a->e) == before, "ops in flight changed");
    CHECK(aio_mr_inflight(a->mr) == 0, "region in flight");
    /* the region's end exactly is fine */
    aio_op_desc ok = op_to(a, b, AIO_OP_WRITE, REGION_LEN - 8, REGION_LEN - 8, 8, 0, 0);
    CHECK(post_all(a, g, &ok, 1, TIMEOUT) == 0, "write ending at the region's end");
    /* [valid, invalid]: the valid one is posted, then the error */
    aio_op_desc two[2] = {op_to(a, b, AIO_OP_WRITE, 0, 0, 8, 0, 0),
                          op_to(a, b, AIO_OP_WRITE, REGION_LEN, 0, 8, 0, 0)};
    int64_t r = aio_post(a->e, g, two, 2, 1000000000);
    CHECK(r == 1, "[valid, invalid] posted %lld, want 1", (long long)r);
    r = aio_post(a->e, g, two + 1, 1, 0);
    CHECK(r == -FI_EINVAL, "invalid item alone: %lld", (long long)r);
    CHECK_OK(aio_group_seal(a->e, g));
    aio_record rec;
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &rec) == 0, "no group record");
    CHECK(rec.status == 0 && rec.a == 2, "status %d a %llu", rec.status, (unsigned long long)rec.a);
    /* a finished group takes nothing more */
    CHECK(aio_post(a->e, g, &ok, 1, 0) == -FI_EINVAL, "post into a finished group");
    CHECK(aio_group_seal(a->e, g) == -FI_EINVAL, "seal of a finished group");
    return 0;
}

static int t_mr_close_busy(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    /* 32 writes of 16 MiB (512 MiB, tens of milliseconds over loopback) with remote CQ data,
     * so that the peer's progress is needed (shm completes a plain CMA write inside the post
     * call). Closing the region right after posting must be refused. On a loaded machine the
     * posting thread can lose the CPU while the pollers move everything: a close that then
     * succeeds is right (nothing was in flight; checked below) but proves nothing, so the
     * scenario runs again, up to 3 times. */
    enum { NW = 32, ATTEMPTS = 3 };
    uint64_t len = 16 * MiB;
    uint32_t imm = 0x6100;
    int busy = -1, refused_once = 0;
    for (int attempt = 0; attempt < ATTEMPTS && !refused_once; attempt++) {
        void *p = NULL;
        CHECK(posix_memalign(&p, 4096, len) == 0, "oom");
        memset(p, 0x5a, len);
        aio_mr *mr = NULL;
        char err[256];
        int ret = aio_mr_register(a->e, p, len, 0, &mr, err, sizeof(err));
        if (ret) free(p);
        CHECK(ret == 0, "register: %s", err);
        aio_op_desc ds[NW];
        for (int i = 0; i < NW; i++) {
            ds[i] = op_to(a, b, AIO_OP_WRITE, 0, 0, len, AIO_F_DATA, imm);
            ds[i].mr = mr;
        }
        uint64_t tok = g_token++;
        int64_t g = aio_group_open(a->e, tok);
        int posted = g >= 0 && post_all(a, g, ds, NW, TIMEOUT) == 0;
        busy = posted ? aio_mr_close(a->e, mr) : -1;
        int64_t infl = busy == -FI_EBUSY ? aio_mr_inflight(mr) : -1;
        if (busy == 0) mr = NULL; /* closed: every write had completed (the in-flight count was 0) */
        if (g >= 0) aio_group_seal(a->e, g);
        aio_record r;
        int got = wait_rec(a, AIO_REC_GROUP, tok, 60, &r);
        int64_t infl_after = mr ? aio_mr_inflight(mr) : -1;
        int closed = (mr && got == 0) ? aio_mr_close(a->e, mr) : -1;
        if (closed == 0 || !mr) free(p);
        wait_take(b, imm, NW * U, TIMEOUT);
        CHECK(posted, "posting the big writes failed");
        CHECK(got == 0 && r.status == 0, "big writes did not complete");
        CHECK(r.a == NW, "the group counted %llu writes done, want %d", (unsigned long long)r.a, NW);
        if (busy == 0) {
            printf("    (attempt %d: every write had landed before the close: again)\n", attempt + 1);
            continue;
        }
        CHECK(busy == -FI_EBUSY, "aio_mr_close with writes in flight = %d, want -FI_EBUSY", busy);
        CHECK(infl >= 1, "aio_mr_inflight %lld", (long long)infl);
        CHECK(infl_after == 0, "inflight after completion %lld", (long long)infl_after);
        CHECK(closed == 0, "aio_mr_close after completion = %d", closed);
        refused_once = 1;
    }
    CHECK(refused_once, "no attempt closed the region while its writes were in flight");
    return 0;
}

static int poll_fd(int fd, int timeout_ms) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int r;
    do r = poll(&p, 1, timeout_ms);
    while (r < 0 && errno == EINTR);
    return r > 0 && (p.revents & POLLIN);
}

static int t_eventfd(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    int efd = aio_engine_eventfd(a->e);
    CHECK(efd >= 0, "eventfd");
    sleep_us(10000);
    while (pump(a)) {
    }
    a->ninbox = 0;
    aio_clear_eventfd(a->e);
    CHECK(!poll_fd(efd, 0), "eventfd readable after clear");
    CHECK(aio_arm(a->e) == 0, "aio_arm with nothing waiting must return 0");
    CHECK(!poll_fd(efd, 20), "eventfd readable without a completion");
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 0, 4096, 0, 0);
    uint64_t tok = g_token++;
    int64_t g = aio_group_open(a->e, tok);
    CHECK(g >= 0, "group");
    CHECK(post_all(a, g, &d, 1, TIMEOUT) == 0, "post");
    CHECK_OK(aio_group_seal(a->e, g));
    double t0 = now_s();
    CHECK(poll_fd(efd, 10000), "the completion did not make the eventfd readable");
    double dt = now_s() - t0;
    aio_clear_eventfd(a->e);
    aio_record r;
    CHECK(aio_drain(a->e, &r, 1) == 1 && r.kind == AIO_REC_GROUP && r.token == tok,
          "record after wake-up");
    CHECK(!poll_fd(efd, 0), "eventfd still readable after clear");
    /* not armed: a completion does not signal */
    tok = g_token++;
    g = aio_group_open(a->e, tok);
    CHECK(post_all(a, g, &d, 1, TIMEOUT) == 0, "post");
    CHECK_OK(aio_group_seal(a->e, g));
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, NULL) == 0, "group 2");
    CHECK(!poll_fd(efd, 0), "eventfd signalled while not armed");
    /* armed, record waiting and not drained: aio_arm returns 1 */
    CHECK(aio_arm(a->e) == 0, "arm");
    tok = g_token++;
    g = aio_group_open(a->e, tok);
    CHECK(post_all(a, g, &d, 1, TIMEOUT) == 0, "post");
    CHECK_OK(aio_group_seal(a->e, g));
    CHECK(poll_fd(efd, 10000), "second wake-up");
    aio_clear_eventfd(a->e);
    CHECK(aio_arm(a->e) == 1, "aio_arm with a record waiting must return 1");
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, NULL) == 0, "group 3");
    aio_clear_eventfd(a->e); /* that arm may signal on the next record: spurious, harmless */
    /* receiver side: a counter watch wakes the loop */
    uint32_t imm = 0x6000;
    int befd = aio_engine_eventfd(b->e);
    while (pump(b)) {
    }
    b->ninbox = 0;
    aio_clear_eventfd(b->e);
    CHECK(aio_counter_watch(b->e, imm, U) == 0, "watch");
    CHECK(aio_arm(b->e) == 0, "arm b");
    d = op_to(a, b, AIO_OP_WRITE, 0, 0, 0, AIO_F_DATA, imm);
    if (run_group(a, &d, 1, NULL)) return -1;
    CHECK(poll_fd(befd, 10000), "the counter watch did not make the eventfd readable");
    aio_clear_eventfd(b->e);
    CHECK(aio_drain(b->e, &r, 1) == 1 && r.kind == AIO_REC_COUNTER && r.token == imm,
          "counter record after wake-up");
    CHECK(aio_counter_take(b->e, imm, U) == 1, "take");
    printf("    (wake-up after post %.1f us)\n", dt * 1e6);
    return 0;
}

/* aio_submit: open + post + seal in one call. */
static int t_submit(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    uint32_t imm = 0x6500;
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 0, 0, AIO_F_DATA, imm);
    aio_op_desc ds[3] = {d, d, d};
    aio_record r;
    uint64_t tok = g_token++;
    int64_t g = -7;
    int64_t k = aio_submit(a->e, tok, ds, 3, 1000000000LL, &g);
    CHECK(g >= 0, "aio_submit opened no group: %lld", (long long)g);
    if (k < 3) { /* a new connection may push back: finish by hand */
        CHECK(k >= 0, "aio_submit: %s", aio_strerror((int)k));
        CHECK(post_all(a, g, ds + k, 3 - k, TIMEOUT) == 0, "post the rest");
        CHECK_OK(aio_group_seal(a->e, g));
    } else {
        CHECK(aio_group_seal(a->e, g) == -FI_EINVAL, "a fully posted submit must be sealed already");
    }
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0 && r.status == 0 && r.a == 3,
          "group record of the submit");
    CHECK(wait_take(b, imm, 3 * U, TIMEOUT) == 0, "credits of the submit");
    /* nothing to post: the group finishes at once */
    tok = g_token++;
    CHECK(aio_submit(a->e, tok, ds, 0, 0, &g) == 0 && g >= 0, "empty submit");
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0 && r.a == 0, "empty submit's record");
    /* a bad request: the error comes back and the group stays open for the caller */
    aio_op_desc bad = d;
    bad.rail = -1;
    tok = g_token++;
    k = aio_submit(a->e, tok, &bad, 1, 0, &g);
    CHECK(k == -FI_EINVAL && g >= 0, "bad submit returned %lld, group %lld", (long long)k, (long long)g);
    CHECK(count_rec(a, AIO_REC_GROUP, tok) == 0, "an unsealed group finished");
    CHECK_OK(aio_group_seal(a->e, g));
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0 && r.a == 0, "bad submit's record after seal");
    return 0;
}

/* aio_submit_quiet: the completion record goes into the ring without signalling the armed
 * eventfd, unless a quiet waiter is counted in; aio_quiet_waiters reports waiting records;
 * aio_group_quiet changes an open group only. */
static int t_submit_quiet(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    int efd = aio_engine_eventfd(a->e);
    sleep_us(10000);
    while (pump(a)) {
    }
    a->ninbox = 0;
    aio_clear_eventfd(a->e);
    uint32_t imm = 0x6600;
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 0, 64, AIO_F_DATA, imm);
    aio_record r;
    CHECK(aio_arm(a->e) == 0, "arm");
    uint64_t tok = g_token++;
    int64_t g = -1;
    int64_t k = aio_submit_quiet(a->e, tok, &d, 1, 1000000000LL, &g);
    CHECK(k == 1 && g >= 0, "quiet submit: %lld, group %lld", (long long)k, (long long)g);
    CHECK(wait_take(b, imm, U, TIMEOUT) == 0, "credit of the quiet write");
    double t0 = now_s();
    while (!aio_quiet_waiters(a->e, 0) && now_s() - t0 < TIMEOUT) sleep_us(100);
    CHECK(aio_quiet_waiters(a->e, 0) == 1, "the quiet record never reached the ring");
    CHECK(!poll_fd(efd, 20), "a quiet completion signalled the armed eventfd");
    CHECK(aio_drain(a->e, &r, 1) == 1 && r.kind == AIO_REC_GROUP && r.token == tok && r.status == 0,
          "the quiet group's record");
    /* a waiter counted in: the next quiet record signals as usual */
    CHECK(aio_arm(a->e) == 0, "arm 2");
    CHECK(aio_quiet_waiters(a->e, 1) == 0, "no record should be waiting");
    tok = g_token++;
    k = aio_submit_quiet(a->e, tok, &d, 1, 1000000000LL, &g);
    CHECK(k == 1 && g >= 0, "quiet submit 2");
    CHECK(poll_fd(efd, 10000), "a quiet completion with a waiter did not signal");
    aio_clear_eventfd(a->e);
    CHECK(aio_drain(a->e, &r, 1) == 1 && r.kind == AIO_REC_GROUP && r.token == tok, "record 2");
    CHECK(aio_quiet_waiters(a->e, -1) == 0, "waiters back to none");
    CHECK(wait_take(b, imm, U, TIMEOUT) == 0, "credit 2");
    /* an open group may be made quiet (or loud again) until it is sealed */
    CHECK(aio_arm(a->e) == 0, "arm 3");
    tok = g_token++;
    g = aio_group_open(a->e, tok);
    CHECK(g >= 0, "group");
    CHECK_OK(aio_group_quiet(a->e, g, 1));
    CHECK_OK(aio_group_seal(a->e, g)); /* empty: finishes now, quietly */
    CHECK(aio_group_quiet(a->e, g, 0) == -FI_EINVAL, "a finished group must refuse aio_group_quiet");
    CHECK(!poll_fd(efd, 20), "an empty quiet group signalled");
    CHECK(aio_drain(a->e, &r, 1) == 1 && r.token == tok && r.a == 0, "record 3");
    tok = g_token++;
    g = aio_group_open(a->e, tok);
    CHECK_OK(aio_group_quiet(a->e, g, 1));
    CHECK_OK(aio_group_quiet(a->e, g, 0));
    CHECK(aio_arm(a->e) == 0, "arm 4");
    CHECK_OK(aio_group_seal(a->e, g));
    CHECK(poll_fd(efd, 10000), "a group made loud again did not signal");
    aio_clear_eventfd(a->e);
    CHECK(aio_drain(a->e, &r, 1) == 1 && r.token == tok, "record 4");
    return 0;
}

/* aio_poll_ring: the calling thread drives the CQs until a record waits (a group
 * completion, a satisfied counter watch) or its budget runs out; the poller keeps working,
 * and an armed loop is woken by the eventfd afterwards as usual. */
static int t_poll_ring(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    int aefd = aio_engine_eventfd(a->e);
    sleep_us(10000);
    while (pump(a)) {
    }
    while (pump(b)) {
    }
    a->ninbox = b->ninbox = 0;
    aio_clear_eventfd(a->e);
    aio_clear_eventfd(b->e);
    uint64_t polls0 = aio_loop_polls(a->e);
    /* nothing in flight: returns 0 after about its budget */
    double t0 = now_s();
    CHECK(aio_poll_ring(a->e, 2000000) == 0, "aio_poll_ring with nothing to wait for returned 1");
    double dt = now_s() - t0;
    CHECK(dt >= 0.0019 && dt < 1.0, "a 2 ms budget took %.6f s", dt);
    CHECK(aio_loop_polls(a->e) == polls0 + 1, "loop polls %llu", (unsigned long long)aio_loop_polls(a->e));
    aio_record r;
    for (int round = 0; round < 200; round++) {
        /* b waits for a credit (watch armed first), a for its write's completion */
        uint32_t imm = 0x6400;
        CHECK(aio_arm(a->e) == 0 && aio_arm(b->e) == 0, "arm");
        /* a call (even of budget 0) disarms the eventfd: from here on the caller drains */
        CHECK(aio_poll_ring(a->e, 0) == 0 && aio_poll_ring(b->e, 0) == 0, "nothing waiting yet");
        CHECK(aio_counter_watch(b->e, imm, U) == 0, "watch");
        aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 0, 8, AIO_F_DATA, imm);
        uint64_t tok = g_token++;
        int64_t g = aio_group_open(a->e, tok);
        CHECK(g >= 0, "group");
        CHECK(post_all(a, g, &d, 1, TIMEOUT) == 0, "post");
        CHECK_OK(aio_group_seal(a->e, g));
        int got = 0;
        for (int k = 0; k < 100 && !got; k++) got = aio_poll_ring(a->e, 100000000);
        CHECK(got == 1, "round %d: no group record within the budget", round);
        CHECK(aio_drain(a->e, &r, 1) == 1 && r.kind == AIO_REC_GROUP && r.token == tok && r.status == 0,
              "round %d: the group record", round);
        got = 0;
        for (int k = 0; k < 100 && !got; k++) got = aio_poll_ring(b->e, 100000000);
        CHECK(got == 1, "round %d: no counter record within the budget", round);
        CHECK(aio_drain(b->e, &r, 1) == 1 && r.kind == AIO_REC_COUNTER && r.token == imm,
              "round %d: the counter record", round);
        CHECK(aio_counter_take(b->e, imm, U) == 1, "round %d: take", round);
        /* while it sleeps aio_poll_ring arms the eventfd and clears it on waking; a producer
         * that raced with that may still signal it once: spurious, harmless (the event loop
         * drains an empty ring) */
        aio_clear_eventfd(a->e);
        aio_clear_eventfd(b->e);
    }
    /* afterwards: a completion wakes an armed loop through the eventfd */
    CHECK(aio_arm(a->e) == 0, "arm");
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 0, 4096, 0, 0);
    uint64_t tok = g_token++;
    int64_t g = aio_group_open(a->e, tok);
    CHECK(post_all(a, g, &d, 1, TIMEOUT) == 0, "post");
    CHECK_OK(aio_group_seal(a->e, g));
    CHECK(poll_fd(aefd, 10000), "no eventfd wake-up after aio_poll_ring");
    aio_clear_eventfd(a->e);
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, NULL) == 0, "group after resume");
    /* a record already waiting: returns 1 at once */
    CHECK(aio_counter_watch(b->e, 0x6401, 0) == 1, "a watch of 0 is satisfied");
    g = aio_group_open(a->e, g_token++);
    CHECK_OK(aio_group_seal(a->e, g)); /* an empty group finishes at seal */
    CHECK(aio_poll_ring(a->e, 0) == 1, "a waiting record must make aio_poll_ring return 1");
    while (pump(a)) {
    }
    a->ninbox = 0;
    return 0;
}

static int remote_error_direct(fix_t *f);

/* A write the target must refuse (wrong key): the target's bytes stay untouched and
 * no credit is counted; the initiator's group completes exactly once, with an error.
 * On shm the refusal is the region table's (aiote never lets shm's own copy move a
 * region's bytes: libfabric 1.17's shm checks no key), asserted in remote_error_direct;
 * on tcp the target's provider refuses it and the connection breaks (ECANCELED). */
static int t_remote_error(fix_t *f) {
    if (!strcmp(f->prov, "shm")) return remote_error_direct(f);
    eng_t *a = &f->a, *b = &f->b;
    uint32_t imm = 0x6300;
    aio_stats sb0, sb1;
    aio_get_stats(b->e, &sb0);
    fill(a->buf, 4096, 0, 0x777);
    memset(b->buf + 8192, 0xEE, 4096);
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 8192, 4096, AIO_F_DATA, imm);
    d.rkey ^= 0x5a5a5a5a5a5aULL;
    uint64_t tok = g_token++;
    int64_t g = aio_group_open(a->e, tok);
    CHECK(g >= 0, "group");
    int ret = post_all(a, g, &d, 1, TIMEOUT);
    CHECK_OK(aio_group_seal(a->e, g));
    aio_record r;
    memset(&r, 0, sizeof(r));
    int st = 0;
    if (ret == 0) {
        CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0, "no group record");
        CHECK(r.a == 1, "a = %llu", (unsigned long long)r.a);
        st = r.status;
    }
    /* the pair works again. On tcp the target drops the connection over the refused
     * write: a write right behind it can fail (-FI_ENOTCONN), or even complete with
     * status 0 at the initiator and never arrive (transmit-complete semantics), until
     * rxm reconnects. Retry until a credit lands; report what was lost. */
    aio_op_desc ok = op_to(a, b, AIO_OP_WRITE, 0, 0, 64, AIO_F_DATA, 0x6301);
    int failed = 0, lost = 0, delivered = 0;
    for (int attempt = 0; attempt < 40 && !delivered; attempt++) {
        tok = g_token++;
        g = aio_group_open(a->e, tok);
        CHECK(g >= 0, "group");
        CHECK(post_all(a, g, &ok, 1, TIMEOUT) == 0, "post");
        CHECK_OK(aio_group_seal(a->e, g));
        CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0, "no group record");
        if (r.status) {
            failed++;
            sleep_us(10000);
            continue;
        }
        if (wait_take(b, 0x6301, U, 0.5) == 0) delivered = 1;
        else lost++;
    }
    CHECK(delivered, "no write got through after the refused one (%d failed, %d lost)", failed,
          lost);
    sleep_us(50000);
    aio_get_stats(b->e, &sb1);
    printf("    (wrong key: %s; initiator status %d (%s); target CQ errors +%llu; writes "
           "behind it: %d failed, %d reported success but never arrived)\n",
           ret ? "refused at post" : "posted", ret ? ret : st, aio_strerror(ret ? ret : st),
           (unsigned long long)(sb1.errors - sb0.errors), failed, lost);
    CHECK(aio_counter_total(b->e, imm) == 0, "a refused write was credited");
    int untouched = 1;
    for (int i = 0; i < 4096; i++)
        if (b->buf[8192 + i] != 0xEE) untouched = 0;
    CHECK(untouched, "a write with a wrong key changed the target's bytes");
    CHECK(ret != 0 || st != 0, "a write with a wrong key completed without an error");
    CHECK(aio_mr_inflight(a->mr) == 0, "inflight");
    return 0;
}

static double cpu_s(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

static int t_idle(fix_t *f) {
    aio_stats sa0, sa1, sb0, sb1;
    sleep_us(300000); /* let spin budgets run out */
    aio_get_stats(f->a.e, &sa0);
    aio_get_stats(f->b.e, &sb0);
    double c0 = cpu_s(), t0 = now_s();
    sleep_us(2000000);
    double c1 = cpu_s(), t1 = now_s();
    aio_get_stats(f->a.e, &sa1);
    aio_get_stats(f->b.e, &sb1);
    double pct = 100.0 * (c1 - c0) / (t1 - t0);
    printf("    (two idle engines: %.2f%% CPU over %.2f s; polls %llu/%llu sleeps %llu/%llu)\n", pct,
           t1 - t0, (unsigned long long)(sa1.polls - sa0.polls),
           (unsigned long long)(sb1.polls - sb0.polls), (unsigned long long)(sa1.sleeps - sa0.sleeps),
           (unsigned long long)(sb1.sleeps - sb0.sleeps));
    /* the requirement is under 2% of a core per idle engine; this process holds two */
    CHECK(pct < 4.0, "two idle engines used %.2f%% CPU (more than 2%% each)", pct);
    return 0;
}


/* An idle engine with a task of its loop awaiting something (aio_waiters_add: a message or a
 * counter) sleeps: on shm, which has no wait object, its poller used to look every 50 us (12%
 * of a core); now the peer wakes it when it posts (shm_wake). An immediate from the peer is
 * then seen at once, not at the poller's next timed look (sleep_ms, 100 ms). */
static int t_idle_waiting(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    aio_waiters_add(b->e, 1);
    sleep_us(300000); /* spin budgets run out */
    aio_stats s0, s1;
    aio_get_stats(b->e, &s0);
    double c0 = cpu_s(), t0 = now_s();
    sleep_us(1000000);
    double c1 = cpu_s(), t1 = now_s();
    aio_get_stats(b->e, &s1);
    double pct = 100.0 * (c1 - c0) / (t1 - t0);
    uint64_t polls = s1.polls - s0.polls;
    uint32_t imm = 0x7300;
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 0, 0, AIO_F_DATA, imm);
    double dts[5];
    int rc = 0;
    for (int i = 0; i < 5 && !rc; i++) {
        sleep_us(300000); /* asleep again, past the poller's short steps (WAKE_IDLE_NS) */
        double ts = now_s();
        rc = run_group(a, &d, 1, NULL) || wait_take(b, imm, U, TIMEOUT);
        dts[i] = now_s() - ts;
    }
    aio_waiters_add(b->e, -1);
    CHECK(rc == 0, "an immediate to the sleeping engine did not arrive");
    for (int i = 0; i < 5; i++)
        for (int j = i + 1; j < 5; j++)
            if (dts[j] < dts[i]) {
                double t = dts[i];
                dts[i] = dts[j], dts[j] = t;
            }
    printf("    (a waiter, idle: %.2f%% CPU, %llu polls in %.2f s; immediates seen after %.2f ms (median))\n",
           pct, (unsigned long long)polls, t1 - t0, dts[2] * 1e3);
    CHECK(polls < 100, "%llu polls in %.2f s while idle: the poller did not sleep", (unsigned long long)polls,
          t1 - t0);
    CHECK(dts[2] < 0.03, "an immediate to a sleeping engine took %.1f ms (median of 5)", dts[2] * 1e3);
    return 0;
}



/* The adaptive spin window: a stream of 1 MiB writes may grow the receiver's window; 8-byte
 * writes 300 to about 400 us apart straight after it (more than ADAPT_SPARSE_NS, less than
 * ADAPT_MAX_NS, so a window left at its maximum would never let the poller sleep through one)
 * put it back to the base, and the receiver sleeps between them. */
static int t_spin_window(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    if (!b->info.has_wait_fd) {
        printf("    (no wait fd: the window follows completions alone; not checked here)\n");
        return 0;
    }
    enum { STREAM = 64, SPARSE = 200 };
    uint32_t imm = 0x7100;
    aio_op_desc ds[STREAM];
    for (int k = 0; k < STREAM; k++)
        ds[k] = op_to(a, b, AIO_OP_WRITE, (uint64_t)(k % 16) * MiB, (uint64_t)(k % 16) * MiB, MiB,
                      AIO_F_DATA, imm);
    int64_t grown = 0;
    aio_stats s0, s1;
    /* until a stream grew it (on a loaded machine the receiver may spin through one without
     * sleeping, and then it does not grow) */
    for (int attempt = 0; attempt < 20 && !grown; attempt++) {
        if (run_group(a, ds, STREAM, NULL)) return -1;
        CHECK(wait_take(b, imm, STREAM * U, TIMEOUT) == 0, "stream: credits missing");
        aio_get_stats(b->e, &s0);
        grown = (int64_t)s0.spin_window_ns;
    }
    CHECK(grown > 0, "20 streams of 64 x 1 MiB never grew the receiver's spin window");
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 0, 8, AIO_F_DATA, imm + 1);
    for (int i = 0; i < SPARSE; i++) { /* each at least 300 us after the last one landed */
        if (run_group(a, &d, 1, NULL)) return -1;
        sleep_us(300);
    }
    CHECK(wait_take(b, imm + 1, SPARSE * U, TIMEOUT) == 0, "sparse writes: credits missing");
    aio_get_stats(b->e, &s1);
    uint64_t sleeps = s1.sleeps - s0.sleeps;
    printf("    (window after the stream %lld us, after %d writes 300 us apart %llu us; the "
           "receiver slept %llu times)\n",
           (long long)grown / 1000, SPARSE, (unsigned long long)s1.spin_window_ns / 1000,
           (unsigned long long)sleeps);
    CHECK(s1.spin_window_ns == 0, "the window stayed at %llu us under writes 300 us apart",
          (unsigned long long)s1.spin_window_ns / 1000);
    CHECK(sleeps >= SPARSE / 2, "the receiver slept %llu times in %d writes 300 us apart: it spun "
          "through the gaps", (unsigned long long)sleeps, SPARSE);
    return 0;
}

static int t_register_dev(fix_t *f) {
    eng_t *x = &f->a;
    char err[256] = "";
    aio_mr *m = NULL;
    static uint8_t buf[8192];
    CHECK(aio_rail_hmem(x->e, 0) == 0, "a Debian provider reports FI_HMEM");
    int ret = aio_mr_register_dev(x->e, buf, sizeof(buf), AIO_ACCESS_REMOTE_WRITE, AIO_HMEM_CUDA, 0, &m,
                                  err, sizeof(err));
    CHECK(ret == -FI_EOPNOTSUPP && m == NULL && strstr(err, "FI_HMEM"), "device memory accepted: %d %s",
          ret, err);
    CHECK(aio_mr_register_dev(x->e, buf, sizeof(buf), 0, 7, 0, &m, err, sizeof(err)) == -FI_EINVAL,
          "unknown interface accepted");
    CHECK_OK(aio_mr_register_dev(x->e, buf, sizeof(buf), AIO_ACCESS_REMOTE_WRITE, AIO_HMEM_SYSTEM, 0,
                                 &m, err, sizeof(err)));
    CHECK_OK(aio_mr_close(x->e, m));
    return 0;
}

/* ------------------------------------------------------------------ watched words */

typedef struct storer {
    aio_engine *e;
    volatile uint64_t *word;
    int n;
} storer_t;

static void *store_thread(void *arg) {
    storer_t *st = arg;
    for (int i = 1; i <= st->n; i++) {
        __atomic_store_n((uint64_t *)st->word, (uint64_t)i, __ATOMIC_RELEASE);
        sleep_us(5000); /* far slower than the poller's watch interval: most values are seen even on a busy VM */
    }
    return NULL;
}

static int t_watch(fix_t *f) {
    eng_t *x = &f->a;
    static uint64_t words[3] __attribute__((aligned(8)));
    memset(words, 0, sizeof(words));
    CHECK(aio_watch_add(x->e, (const volatile uint64_t *)((char *)words + 4), 0, 1) == -FI_EINVAL,
          "a misaligned word was accepted");
    int id0 = aio_watch_add(x->e, &words[0], 0, 77);
    int id1 = aio_watch_add(x->e, &words[1], 5, 78);
    CHECK(id0 >= 0 && id1 >= 0 && id0 != id1, "aio_watch_add: %d %d", id0, id1);
    /* words[1] starts at 0 but the caller said it knew 5: the difference is reported */
    aio_record rec;
    CHECK(wait_rec(x, AIO_REC_WATCH, 78, 2.0, &rec) == 0, "no record for a word that differs");
    CHECK(rec.a == 0, "value %llu", (unsigned long long)rec.a);
    /* a GPU-like writer (another thread, no kick): every store seen, in order */
    storer_t st = {.e = x->e, .word = &words[0], .n = 20};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, store_thread, &st) == 0, "pthread_create");
    uint64_t last = 0;
    int seen = 0;
    double t0 = now_s();
    while (last < 20 && now_s() - t0 < 5.0) {
        if (wait_rec(x, AIO_REC_WATCH, 77, 5.0, &rec) != 0) break;
        CHECK(rec.a > last, "values out of order: %llu after %llu", (unsigned long long)rec.a,
              (unsigned long long)last);
        last = rec.a;
        seen++;
    }
    pthread_join(th, NULL);
    CHECK(last == 20, "last value seen %llu", (unsigned long long)last);
    CHECK(seen >= 10, "only %d of 20 changes reported", seen);
    /* host-side store: reported too */
    aio_word_store(x->e, &words[1], 9);
    CHECK(wait_rec(x, AIO_REC_WATCH, 78, 2.0, &rec) == 0 && rec.a == 9, "host store not reported");
    /* removed: no more records */
    CHECK_OK(aio_watch_remove(x->e, id0));
    CHECK(aio_watch_remove(x->e, id0) == -FI_EINVAL, "double remove accepted");
    words[0] = 1000;
    sleep_us(50000);
    pump(x);
    CHECK(count_rec(x, AIO_REC_WATCH, 77) == 0, "a removed watch still reported");
    CHECK(aio_word_load(&words[0]) == 1000, "aio_word_load");
    /* an armed watch with no change: the poller sleeps between reads (at most one read per
     * watch interval, 100 us by default), it does not spin */
    sleep_us(300000);
    aio_stats s0, s1;
    aio_get_stats(x->e, &s0);
    double c0 = cpu_s(), w0 = now_s();
    sleep_us(1000000);
    double dt = now_s() - w0;
    double pct = 100.0 * (cpu_s() - c0) / dt;
    aio_get_stats(x->e, &s1);
    double polls = (double)(s1.polls - s0.polls) / dt;
    printf("    (one armed watch, no change: %.2f%% CPU, %.0f polls/s, %.0f sleeps/s)\n", pct, polls,
           (double)(s1.sleeps - s0.sleeps) / dt);
    CHECK(polls < 15000, "the poller read %.0f times a second: it spins", polls);
    CHECK(pct < 40.0, "an armed watch cost %.2f%% CPU", pct);
    CHECK_OK(aio_watch_remove(x->e, id1));
    return 0;
}

/* Median of `n` latencies (ms) from a plain store into a watched word (no kick, as a GPU's) to
 * its record; `hint_ms` >= 0: each store is made inside a window announced with aio_watch_soon
 * that long before (the poller takes the hint at its next wake-up, within watch_us). */
static double store_to_record_ms(eng_t *x, volatile uint64_t *word, uint64_t token, int n, int hint_ms) {
    double lat[16];
    if (n > 16) n = 16;
    for (int i = 0; i < n; i++) {
        if (hint_ms >= 0) {
            aio_watch_soon(x->e, (int64_t)hint_ms * 1000000, 20 * 1000000LL);
            sleep_us((long)hint_ms * 1000 + 2000);
        } else {
            sleep_us(7000 + 3000 * i); /* anywhere in the poller's long steps */
        }
        __atomic_store_n((uint64_t *)word, (uint64_t)(i + 1), __ATOMIC_RELEASE);
        double t0 = now_s();
        aio_record rec;
        if (wait_rec(x, AIO_REC_WATCH, token, 2.0, &rec) != 0) return -1.0;
        lat[i] = (now_s() - t0) * 1e3;
    }
    for (int i = 1; i < n; i++) /* insertion sort: n is small */
        for (int j = i; j > 0 && lat[j] < lat[j - 1]; j--) {
            double t = lat[j];
            lat[j] = lat[j - 1];
            lat[j - 1] = t;
        }
    return lat[n / 2];
}

/* aio_watch_soon: with a 50 ms watch interval, a store outside any window is seen at the poller's
 * next long step (median of 5 well past 3 ms); inside a window announced with a hint (the
 * completion a GPU copy should reach then) it is seen within the fine steps' microseconds; once
 * the window is over the poller goes back to its long steps (it does not spin). */
static int t_watch_soon(fix_t *f) {
    eng_t x;
    g_watch_us = 50000;
    int ret = eng_init(&x, f->prov, f->nic, 0);
    g_watch_us = 0;
    if (ret) return ret;
    static uint64_t word __attribute__((aligned(8)));
    word = 0;
    int id = aio_watch_add(x.e, &word, 0, 91);
    CHECK(id >= 0, "aio_watch_add: %d", id);
    sleep_us(100000); /* past the spin after the add's kick */
    double slow = store_to_record_ms(&x, &word, 91, 5, -1);
    double fast = store_to_record_ms(&x, &word, 91, 5, 60);
    printf("    (store to record, median of 5: %.2f ms without a hint, %.3f ms inside a window)\n", slow, fast);
    CHECK(slow > 3.0, "without a hint a store was seen in %.2f ms: the poller reads too often", slow);
    CHECK(fast >= 0 && fast < 3.0, "inside a window a store took %.2f ms to be seen", fast);
    sleep_us(100000); /* the last window (20 ms) is over */
    aio_stats s0, s1;
    aio_get_stats(x.e, &s0);
    double w0 = now_s();
    sleep_us(500000);
    aio_get_stats(x.e, &s1);
    double polls = (double)(s1.polls - s0.polls) / (now_s() - w0);
    CHECK(polls < 500, "after the window the poller read %.0f times a second", polls);
    CHECK_OK(aio_watch_remove(x.e, id));
    eng_free(&x);
    return 0;
}

/* Credit lanes: entries published by another thread (as a GPU stream would, no kick) are
 * credited to their counters, DONE follows the head, a waiting counter's record fires. */
static int t_lane(fix_t *f) {
    eng_t *x = &f->a;
    const uint32_t n = 4;
    static uint64_t lane[AIO_LANE_ENTRY + 4] __attribute__((aligned(8)));
    memset(lane, 0, sizeof(lane));
    CHECK(aio_lane_add(x->e, lane, 0) == -FI_EINVAL, "a lane of 0 entries was accepted");
    int id = aio_lane_add(x->e, lane, n);
    CHECK(id >= 0, "aio_lane_add: %d", id);
    CHECK(aio_word_load(&lane[AIO_LANE_OPEN]) == 1, "OPEN not set");
    uint32_t imm = 0x5150;
    CHECK(aio_counter_watch(x->e, imm, 7 * U) == 0, "watch on an empty counter");
    /* 6 credits, past the 4 entries: the producer waits for DONE before reusing an entry */
    for (uint64_t s = 0; s < 6; s++) {
        double t0 = now_s();
        while (s - aio_word_load(&lane[AIO_LANE_DONE]) >= n && now_s() - t0 < 5.0) sleep_us(100);
        CHECK(s - aio_word_load(&lane[AIO_LANE_DONE]) < n, "DONE never advanced");
        uint64_t w = s == 5 ? 2 : 1; /* the last one worth 2 (a paged write of 2 pages) */
        __atomic_store_n(&lane[AIO_LANE_ENTRY + s % n], ((uint64_t)imm << 32) | w, __ATOMIC_RELEASE);
        __atomic_store_n(&lane[AIO_LANE_HEAD], s + 1, __ATOMIC_RELEASE);
    }
    aio_record rec;
    CHECK(wait_rec(x, AIO_REC_COUNTER, imm, 5.0, &rec) == 0, "the counter's watch did not fire");
    CHECK(aio_counter_available(x->e, imm) == 7 * U, "credits: %llu",
          (unsigned long long)aio_counter_available(x->e, imm));
    CHECK(aio_word_load(&lane[AIO_LANE_DONE]) == 6, "DONE %llu", (unsigned long long)lane[AIO_LANE_DONE]);
    CHECK(count_rec(x, AIO_REC_WATCH, ANY) == 0, "a lane pushed a watch record");
    CHECK_OK(aio_watch_remove(x->e, id));
    __atomic_store_n(&lane[AIO_LANE_ENTRY + 6 % n], ((uint64_t)imm << 32) | 1, __ATOMIC_RELEASE);
    __atomic_store_n(&lane[AIO_LANE_HEAD], 7, __ATOMIC_RELEASE);
    sleep_us(50000);
    CHECK(aio_counter_available(x->e, imm) == 7 * U, "a removed lane was still read");
    return 0;
}

/* ------------------------------------------------------------------ two processes */

typedef struct peer_info {
    uint32_t addr_len;
    uint8_t addr[AIO_MAX_ADDR];
    uint64_t base, key, len;
} peer_info;

static int write_full(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_full(int fd, void *p, size_t n, int timeout_ms) {
    char *c = p;
    while (n) {
        if (!poll_fd(fd, timeout_ms)) {
            /* POLLHUP without POLLIN: fall through to read() to see EOF */
            struct pollfd q = {.fd = fd, .events = POLLIN};
            if (poll(&q, 1, 0) <= 0) return -1;
        }
        ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        c += r;
        n -= (size_t)r;
    }
    return 0;
}

static void my_info(eng_t *x, peer_info *pi) {
    memset(pi, 0, sizeof(*pi));
    pi->addr_len = x->info.addr_len;
    memcpy(pi->addr, x->info.addr, x->info.addr_len);
    pi->base = aio_mr_remote_base(x->mr, x->rail);
    pi->key = aio_mr_key(x->mr, x->rail);
    pi->len = x->len;
}

static aio_op_desc op_remote(eng_t *src, const peer_info *pi, int op, uint64_t loff, uint64_t roff,
                             uint64_t len, int flags, uint64_t data) {
    aio_op_desc d;
    memset(&d, 0, sizeof(d));
    d.mr = src->mr;
    d.offset = loff;
    d.length = len;
    d.peer = src->peer;
    d.raddr = pi->base + roff;
    d.rkey = pi->key;
    d.data = data;
    d.rail = src->rail;
    d.op = op;
    d.flags = flags;
    return d;
}

#define XP_LEN (4 * MiB)
#define XP_SEED 0xA11CE

/* the child: --peer PROV NIC RFD WFD */
static int peer_body(const char *prov, const char *nic, int rfd, int wfd) {
    eng_t c;
    if (eng_init(&c, prov, nic, XP_LEN)) return -1;
    peer_info mine, theirs;
    my_info(&c, &mine);
    CHECK(write_full(wfd, &mine, sizeof(mine)) == 0, "pipe write");
    CHECK(read_full(rfd, &theirs, sizeof(theirs), 30000) == 0, "pipe read");
    CHECK_OK(aio_av_insert(c.e, c.rail, theirs.addr, theirs.addr_len, &c.peer));
    /* the parent wrote [0, 1 MiB) with imm 0x7001 */
    CHECK(wait_take(&c, 0x7001, U, TIMEOUT) == 0, "child: no credit from the parent");
    CHECK(verify(c.buf, MiB, 0, XP_SEED) < 0, "child: bytes written by the parent");
    /* read the parent's [1, 2) MiB */
    aio_op_desc d = op_remote(&c, &theirs, AIO_OP_READ, MiB, MiB, MiB, 0, 0);
    if (run_group(&c, &d, 1, NULL)) return -1;
    CHECK(verify(c.buf + MiB, MiB, MiB, XP_SEED) < 0, "child: bytes read from the parent");
    /* write back what we got into the parent's [2, 3) MiB */
    d = op_remote(&c, &theirs, AIO_OP_WRITE, 0, 2 * MiB, MiB, AIO_F_DATA, 0x7002);
    if (run_group(&c, &d, 1, NULL)) return -1;
    char bye;
    CHECK(read_full(rfd, &bye, 1, 30000) == 0, "child: no goodbye");
    eng_free(&c);
    return 0;
}

/* the child of t_handed_stall: --stall-peer PROV NIC RFD WFD. Serves writes until the goodbye;
 * the parent stops and continues this process meanwhile. */
static int stall_peer_body(const char *prov, const char *nic, int rfd, int wfd) {
    eng_t c;
    if (eng_init(&c, prov, nic, XP_LEN)) return -1;
    peer_info mine;
    my_info(&c, &mine);
    CHECK(write_full(wfd, &mine, sizeof(mine)) == 0, "pipe write");
    char bye;
    CHECK(read_full(rfd, &bye, 1, 120000) == 0, "stall peer: no goodbye");
    eng_free(&c);
    return 0;
}

static char g_self[4096];

/* Starts this program again as a peer process (`mode`: --peer or --stall-peer) for f's
 * provider, connected by two pipes: *to_child (write end) and *from_child (read end). */
static pid_t spawn_peer(fix_t *f, const char *mode, int *to_child, int *from_child) {
    int p2c[2], c2p[2];
    if (pipe(p2c) || pipe(c2p)) {
        fail_msg(__FILE__, __LINE__, "pipe: %s", strerror(errno));
        return -1;
    }
    char rfd[16], wfd[16];
    snprintf(rfd, sizeof(rfd), "%d", p2c[0]);
    snprintf(wfd, sizeof(wfd), "%d", c2p[1]);
    const char *nic = f->nic ? f->nic : "-";
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        close(p2c[1]);
        close(c2p[0]);
        execl(g_self, g_self, mode, f->prov, nic, rfd, wfd, (char *)NULL);
        _exit(127);
    }
    close(p2c[0]);
    close(c2p[1]);
    if (pid < 0) {
        close(p2c[1]);
        close(c2p[0]);
        fail_msg(__FILE__, __LINE__, "fork: %s", strerror(errno));
        return -1;
    }
    *to_child = p2c[1];
    *from_child = c2p[0];
    return pid;
}

/* Says goodbye to a spawn_peer child, closes the pipes and reaps it (killed after 30 s):
 * the child's exit status, or -1 if it had to be killed. */
static int reap_peer(pid_t pid, int to_child, int from_child, int *said_bye) {
    char bye = 'x';
    *said_bye = write_full(to_child, &bye, 1) == 0;
    close(to_child);
    close(from_child);
    double t0 = now_s();
    int status = -1;
    pid_t w;
    while ((w = waitpid(pid, &status, WNOHANG)) == 0 && now_s() - t0 < 30) sleep_us(1000);
    if (w == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        return -1;
    }
    return status;
}

static int t_two_process(fix_t *f) {
    int to_child, from_child;
    pid_t pid = spawn_peer(f, "--peer", &to_child, &from_child);
    if (pid < 0) return -1;
    eng_t p;
    int rc = -1, status = -1;
    memset(&p, 0, sizeof(p));
    do {
        if (eng_init(&p, f->prov, f->nic, XP_LEN)) break;
        fill(p.buf, XP_LEN, 0, XP_SEED);
        peer_info mine, theirs;
        my_info(&p, &mine);
        if (write_full(to_child, &mine, sizeof(mine)) ||
            read_full(from_child, &theirs, sizeof(theirs), 30000)) {
            fail_msg(__FILE__, __LINE__, "exchanging descriptors with the child failed");
            break;
        }
        int ret = aio_av_insert(p.e, p.rail, theirs.addr, theirs.addr_len, &p.peer);
        if (ret) {
            fail_msg(__FILE__, __LINE__, "av_insert: %s", aio_strerror(ret));
            break;
        }
        memset(p.buf + 2 * MiB, 0, MiB);
        aio_op_desc d = op_remote(&p, &theirs, AIO_OP_WRITE, 0, 0, MiB, AIO_F_DATA, 0x7001);
        if (run_group(&p, &d, 1, NULL)) break;
        if (wait_take(&p, 0x7002, U, TIMEOUT)) {
            fail_msg(__FILE__, __LINE__, "parent: no credit from the child");
            break;
        }
        int64_t bad = verify(p.buf + 2 * MiB, MiB, 0, XP_SEED);
        if (bad >= 0) {
            fail_msg(__FILE__, __LINE__, "parent: byte %lld written back by the child differs",
                     (long long)bad);
            break;
        }
        rc = 0;
    } while (0);
    int said_bye;
    status = reap_peer(pid, to_child, from_child, &said_bye);
    if (!said_bye) rc = -1;
    eng_free(&p);
    if (rc == 0) {
        CHECK(status != -1, "the child did not exit");
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child failed (status 0x%x)",
              status);
    }
    return rc;
}

/* ------------------------------------------------------------------ direct same-host copies */

#define ARENA_LEN (8 * MiB)

typedef struct direct_fix {
    aio_mr *mr; /* b's region with a slot in b's table, in b's arena: */
    uint8_t *arena; /* the fixture's arena (f->arena), the region a page into it */
    uint8_t *buf;
    uint64_t len;
    int32_t slot;
    int attach; /* a's attachment to b's table */
    aio_direct_info info;
} direct_fix;

/* Enables b's table and arena, registers a region in the arena and attaches a to it. */
static int direct_setup(fix_t *f, direct_fix *x, uint64_t len) {
    char err[512] = "";
    memset(x, 0, sizeof(*x));
    int ret = aio_engine_enable_direct(f->b.e, err, sizeof(err));
    CHECK(ret == 0, "enable_direct: %s (%s)", aio_strerror(ret), err);
    CHECK_OK(aio_direct_info_get(f->b.e, &x->info));
    CHECK(len + 8192 <= ARENA_LEN, "the fixture's arena is too small");
    if (!f->arena) { /* once per engine; the region lies a page into it, so that ranges just
                      * before and past it are in the arena (and refused by the slot's checks) */
        int afd = memfd_create("test-arena", MFD_CLOEXEC);
        CHECK(afd >= 0 && ftruncate(afd, (off_t)ARENA_LEN) == 0, "memfd: %s", strerror(errno));
        void *p = mmap(NULL, ARENA_LEN, PROT_READ | PROT_WRITE, MAP_SHARED, afd, 0);
        CHECK(p != MAP_FAILED, "mmap");
        /* refused: no such mapping, a length past the file; then a second arena */
        CHECK(aio_engine_set_arena(f->b.e, afd, NULL, ARENA_LEN, err, sizeof(err)) == -FI_EINVAL, "NULL base");
        CHECK(aio_engine_set_arena(f->b.e, afd, p, 2 * ARENA_LEN, err, sizeof(err)) == -FI_EINVAL,
              "an arena longer than its file");
        ret = aio_engine_set_arena(f->b.e, afd, p, ARENA_LEN, err, sizeof(err));
        CHECK(ret == 0, "set_arena: %s (%s)", aio_strerror(ret), err);
        CHECK(aio_engine_set_arena(f->b.e, afd, p, ARENA_LEN, err, sizeof(err)) == -FI_EBUSY,
              "a second arena");
        close(afd); /* the engine keeps its own */
        f->arena = p;
    }
    x->arena = f->arena;
    x->buf = x->arena + 4096;
    x->len = len;
    memset(x->buf, 0xEE, len);
    ret = aio_mr_register(f->b.e, x->buf, len, AIO_ACCESS_REMOTE_WRITE | AIO_ACCESS_REMOTE_READ, &x->mr,
                          err, sizeof(err));
    CHECK(ret == 0, "register: %s", err);
    x->slot = aio_mr_direct_slot(x->mr);
    CHECK(x->slot >= 0, "a host region of an engine with a table got no slot");
    x->attach = aio_direct_attach(f->a.e, &x->info, err, sizeof(err));
    CHECK(x->attach >= 0, "attach: %s (%s)", aio_strerror(x->attach), err);
    return 0;
}

static aio_op_desc direct_op(fix_t *f, direct_fix *x, int op, uint64_t loff, uint64_t roff, uint64_t len,
                             int flags, uint64_t data) {
    aio_op_desc d = op_to(&f->a, &f->b, op, loff, roff, len, flags, data);
    d.raddr = aio_mr_remote_base(x->mr, f->b.rail) + roff;
    d.rkey = aio_mr_key(x->mr, f->b.rail);
    d.direct = AIO_DIRECT(x->attach, x->slot);
    return d;
}

/* Posts one op and returns its group's status. */
static int one_status(eng_t *a, const aio_op_desc *d, int *status) {
    aio_record r = {0};
    int rc = group_record(a, d, 1, &r);
    *status = r.status;
    return rc;
}

/* t_remote_error on shm: a region outside the arena (process_vm_writev) and one inside it
 * (memcpy), each refused for a wrong key and for a range past it, with EACCES, nothing
 * moved and nothing credited; a bare immediate with a wrong key is refused at post. */
static int remote_error_direct(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    direct_fix x;
    int rc = direct_setup(f, &x, 65536);
    if (rc) return rc;
    char err[512];
    uint8_t *plain = aligned_alloc(4096, 65536);
    CHECK(plain, "alloc");
    memset(plain, 0xEE, 65536);
    aio_mr *pm = NULL;
    CHECK(aio_mr_register(b->e, plain, 65536, AIO_ACCESS_REMOTE_WRITE | AIO_ACCESS_REMOTE_READ, &pm, err,
                          sizeof(err)) == 0, "register: %s", err);
    int32_t pslot = aio_mr_direct_slot(pm);
    CHECK(pslot >= 0, "no slot");
    uint32_t imm = 0x6310;
    fill(a->buf, 65536, 0, 0x778);
    for (int which = 0; which < 2; which++) {
        aio_op_desc d = direct_op(f, &x, AIO_OP_WRITE, 0, 0, 4096, AIO_F_DATA, imm);
        if (which == 1) { /* the region outside the arena */
            d.raddr = aio_mr_remote_base(pm, b->rail);
            d.rkey = aio_mr_key(pm, b->rail);
            d.direct = AIO_DIRECT(x.attach, pslot);
        }
        aio_op_desc good = d;
        d.rkey ^= 0x5a5a;
        int st = 0;
        CHECK_OK(one_status(a, &d, &st));
        CHECK(st == -FI_EACCES, "a wrong key (%s) gave status %d (%s)", which ? "plain" : "arena", st,
              aio_strerror(st));
        aio_op_desc past = good;
        past.raddr += (which ? 65536 : x.len) - 100;
        CHECK_OK(one_status(a, &past, &st));
        CHECK(st == -FI_EACCES, "a range past the region gave status %d", st);
        aio_op_desc bare = d; /* zero bytes, the wrong key: refused before shm sees it */
        bare.length = 0;
        uint64_t tok = g_token++;
        int64_t g = aio_group_open(a->e, tok);
        CHECK(g >= 0, "group");
        int ret = post_all(a, g, &bare, 1, TIMEOUT);
        CHECK_OK(aio_group_seal(a->e, g));
        CHECK(ret == -FI_EACCES, "a bare immediate with a wrong key: %d (%s)", ret, aio_strerror(ret));
        aio_record r;
        CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0, "no group record");
        CHECK_OK(one_status(a, &good, &st)); /* and the right one lands, counted once */
        CHECK(st == 0, "the good write: %d", st);
        CHECK(wait_take(b, imm, U, TIMEOUT) == 0, "no credit for the good write");
    }
    sleep_us(50000);
    CHECK(aio_counter_total(b->e, imm) == 2 * U, "refused writes were credited (%llu)",
          (unsigned long long)aio_counter_total(b->e, imm));
    CHECK(verify(x.buf, 4096, 0, 0x778) < 0 && verify(plain, 4096, 0, 0x778) < 0, "the good writes");
    for (int i = 4096; i < 65536; i++)
        CHECK(plain[i] == 0xEE && x.buf[i] == 0xEE, "a refused write changed byte %d", i);
    CHECK_OK(aio_mr_close(b->e, pm));
    free(plain);
    CHECK_OK(aio_mr_close(b->e, x.mr));
    return 0;
}

static int t_direct(fix_t *f) {
    if (strcmp(f->prov, "shm")) {
        printf("    (shm only)\n");
        return 0;
    }
    eng_t *a = &f->a, *b = &f->b;
    direct_fix x;
    int rc = direct_setup(f, &x, 4 * MiB);
    if (rc) return rc;
    char err[512];
    CHECK(aio_direct_attach(a->e, &x.info, err, sizeof(err)) == x.attach, "the same table, another index");
    /* a wrong nonce, fd or table address is refused (a fresh engine, without rails) */
    aio_engine_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    aio_engine *c = NULL;
    CHECK_OK(aio_engine_create(&cfg, &c, err, sizeof(err)));
    aio_direct_info bad = x.info;
    bad.nonce ^= 1;
    int x1 = aio_direct_attach(c, &bad, err, sizeof(err));
    bad = x.info;
    bad.table += 64; /* the probe reads something else than the table's nonce */
    int x2 = aio_direct_attach(c, &bad, err, sizeof(err));
    bad = x.info;
    bad.fd = 0;
    int x3 = aio_direct_attach(c, &bad, err, sizeof(err));
    aio_engine_destroy(c);
    CHECK(x1 < 0 && x2 < 0 && x3 < 0, "attached with a wrong nonce (%d), table address (%d) or fd (%d)",
          x1, x2, x3);
    aio_stats s0, s1, sb0, sb1;
    aio_get_stats(a->e, &s0);
    aio_get_stats(b->e, &sb0);
    /* writes of odd sizes and offsets, each with an immediate: every one a memcpy into the
     * arena, the immediate after it through shm */
    const uint64_t sizes[] = {1, 4095, 65536, MiB + 3};
    uint32_t imm = 0x6400;
    uint64_t roff = 7;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        fill(a->buf, sizes[i], 0, 0x900 + (uint32_t)i);
        aio_op_desc d = direct_op(f, &x, AIO_OP_WRITE, 0, roff, sizes[i], AIO_F_DATA, imm);
        CHECK_OK(run_group(a, &d, 1, NULL));
        CHECK(wait_take(b, imm, U, TIMEOUT) == 0, "no credit for the %llu-byte direct write",
              (unsigned long long)sizes[i]);
        int64_t at = verify(x.buf + roff, sizes[i], 0, 0x900 + (uint32_t)i);
        CHECK(at < 0, "%llu-byte direct write: byte %lld differs", (unsigned long long)sizes[i], (long long)at);
        CHECK(x.buf[roff + sizes[i]] == 0xEE && x.buf[roff - 1] == 0xEE, "bytes beside the write changed");
    }
    /* a write without an immediate, and a read back */
    fill(a->buf, 8192, 0, 0x9a0);
    aio_op_desc w = direct_op(f, &x, AIO_OP_WRITE, 0, 2 * MiB, 8192, 0, 0);
    CHECK_OK(run_group(a, &w, 1, NULL));
    CHECK(verify(x.buf + 2 * MiB, 8192, 0, 0x9a0) < 0, "plain direct write");
    fill(x.buf + 3 * MiB, 65536, 0, 0x9b0);
    memset(a->buf + MiB, 0, 65536);
    aio_op_desc rd = direct_op(f, &x, AIO_OP_READ, MiB, 3 * MiB, 65536, 0, 0);
    CHECK_OK(run_group(a, &rd, 1, NULL));
    CHECK(verify(a->buf + MiB, 65536, 0, 0x9b0) < 0, "direct read");
    aio_get_stats(a->e, &s1);
    aio_get_stats(b->e, &sb1);
    CHECK(s1.direct_ops - s0.direct_ops == 6 && s1.direct_mapped - s0.direct_mapped == 6,
          "direct copies %llu (mapped %llu), want 6 (6)", (unsigned long long)(s1.direct_ops - s0.direct_ops),
          (unsigned long long)(s1.direct_mapped - s0.direct_mapped));
    CHECK(sb1.remote_data - sb0.remote_data == 4, "the target saw %llu immediates, want 4",
          (unsigned long long)(sb1.remote_data - sb0.remote_data));
    /* refused before any byte moves: a wrong key, a range past the region */
    memset(x.buf, 0xEE, 65536);
    aio_op_desc k = direct_op(f, &x, AIO_OP_WRITE, 0, 0, 4096, AIO_F_DATA, imm + 1);
    k.rkey ^= 0x5a5a;
    int st = 0;
    CHECK_OK(one_status(a, &k, &st));
    CHECK(st == -FI_EACCES, "a wrong key gave status %d (%s)", st, aio_strerror(st));
    aio_op_desc o = direct_op(f, &x, AIO_OP_WRITE, 0, x.len - 100, 4096, 0, 0);
    CHECK_OK(one_status(a, &o, &st));
    CHECK(st == -FI_EACCES, "a range past the region gave status %d", st);
    aio_op_desc o2 = direct_op(f, &x, AIO_OP_WRITE, 0, 0, 4096, 0, 0);
    o2.raddr -= 4096; /* before the region */
    CHECK_OK(one_status(a, &o2, &st));
    CHECK(st == -FI_EACCES, "a range before the region gave status %d", st);
    aio_op_desc inval = direct_op(f, &x, AIO_OP_WRITE, 0, 0, 64, 0, 0);
    inval.direct = AIO_DIRECT(x.attach + 5, x.slot);
    int64_t g = aio_group_open(a->e, g_token++);
    CHECK(aio_post(a->e, g, &inval, 1, 1000000) == -FI_EINVAL, "an unknown attachment was posted");
    CHECK_OK(aio_group_seal(a->e, g));
    pump(a);
    for (int i = 0; i < 65536; i++) CHECK(x.buf[i] == 0xEE, "a refused write changed byte %d", i);
    CHECK(aio_counter_total(b->e, imm + 1) == 0, "a refused write was credited");
    /* a region without remote read: a direct read is refused */
    aio_mr *wo = NULL;
    CHECK_OK(aio_mr_register(b->e, x.buf, 8192, AIO_ACCESS_REMOTE_WRITE, &wo, err, sizeof(err)));
    aio_op_desc r2 = direct_op(f, &x, AIO_OP_READ, 0, 0, 4096, 0, 0);
    r2.rkey = aio_mr_key(wo, b->rail);
    r2.raddr = aio_mr_remote_base(wo, b->rail);
    r2.direct = AIO_DIRECT(x.attach, aio_mr_direct_slot(wo));
    CHECK_OK(one_status(a, &r2, &st));
    CHECK(st == -FI_EACCES, "a read of a write-only region gave status %d", st);
    CHECK_OK(aio_mr_close(b->e, wo));
    /* a region outside the arena: writes and reads are direct copies too
     * (process_vm_writev / process_vm_readv) */
    void *q = NULL;
    CHECK(posix_memalign(&q, 4096, MiB) == 0, "oom");
    memset(q, 0xEE, MiB);
    aio_mr *plain = NULL;
    CHECK_OK(aio_mr_register(b->e, q, MiB, AIO_ACCESS_REMOTE_WRITE | AIO_ACCESS_REMOTE_READ, &plain, err,
                             sizeof(err)));
    aio_get_stats(a->e, &s0);
    fill(a->buf, 65536, 0, 0x9c0);
    aio_op_desc pw = direct_op(f, &x, AIO_OP_WRITE, 0, 4096, 65536, AIO_F_DATA, imm + 2);
    pw.rkey = aio_mr_key(plain, b->rail);
    pw.raddr = aio_mr_remote_base(plain, b->rail) + 4096;
    pw.direct = AIO_DIRECT(x.attach, aio_mr_direct_slot(plain));
    CHECK_OK(run_group(a, &pw, 1, NULL));
    CHECK(wait_take(b, imm + 2, U, TIMEOUT) == 0, "no credit for the write outside the arena");
    CHECK(verify((uint8_t *)q + 4096, 65536, 0, 0x9c0) < 0, "the write outside the arena");
    aio_op_desc pr = pw;
    pr.op = AIO_OP_READ;
    pr.flags = 0;
    pr.offset = MiB;
    CHECK_OK(run_group(a, &pr, 1, NULL));
    CHECK(verify(a->buf + MiB, 65536, 0, 0x9c0) < 0, "the read outside the arena");
    aio_get_stats(a->e, &s1);
    CHECK(s1.direct_ops - s0.direct_ops == 2 && s1.direct_mapped == s0.direct_mapped,
          "outside the arena: direct copies %llu (mapped %llu), want 2 (0)",
          (unsigned long long)(s1.direct_ops - s0.direct_ops),
          (unsigned long long)(s1.direct_mapped - s0.direct_mapped));
    CHECK_OK(aio_mr_close(b->e, plain));
    free(q);
    CHECK(aio_mr_inflight(a->mr) == 0, "inflight");
    CHECK_OK(aio_mr_close(b->e, x.mr));
    return 0;
}

/* Closing a region waits for copies under way: a live engine's mark keeps the region open
 * (and new copies out), a mark of a process that died is cleared. */
static int t_direct_retire(fix_t *f) {
    if (strcmp(f->prov, "shm")) {
        printf("    (shm only)\n");
        return 0;
    }
    eng_t *a = &f->a;
    direct_fix x;
    int rc = direct_setup(f, &x, MiB);
    if (rc) return rc;
    aio_op_desc d = direct_op(f, &x, AIO_OP_WRITE, 0, 0, 4096, 0, 0);
    int st = 0;
    CHECK_OK(one_status(a, &d, &st));
    CHECK(st == 0, "direct write %d", st);
    CHECK_OK(aio_direct_mark(a->e, x.attach, x.slot, 1));
    CHECK(aio_mr_close(f->b.e, x.mr) == -FI_EBUSY, "closed under a live engine's copy");
    CHECK(aio_mr_close(f->b.e, x.mr) == -FI_EBUSY, "closed under a live engine's copy (twice)");
    memset(x.buf, 0xEE, 4096);
    CHECK_OK(one_status(a, &d, &st)); /* closing: new copies are refused at once */
    CHECK(st == -FI_EACCES, "a write into a closing region gave status %d", st);
    CHECK(x.buf[0] == 0xEE, "a write into a closing region landed");
    CHECK_OK(aio_direct_mark(a->e, x.attach, x.slot, 0));
    CHECK_OK(aio_mr_close(f->b.e, x.mr));
    /* a process that attaches, marks a slot and dies */
    char err[512];
    void *p = NULL;
    CHECK(posix_memalign(&p, 4096, MiB) == 0, "oom");
    aio_mr *mr2 = NULL;
    CHECK_OK(aio_mr_register(f->b.e, p, MiB, AIO_ACCESS_REMOTE_WRITE, &mr2, err, sizeof(err)));
    int32_t slot2 = aio_mr_direct_slot(mr2);
    CHECK(slot2 >= 0, "no slot");
    fflush(stdout);
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid == 0) { /* no libfabric here: an engine without rails attaches and marks */
        aio_engine_config cfg;
        memset(&cfg, 0, sizeof(cfg));
        aio_engine *e = NULL;
        if (aio_engine_create(&cfg, &e, err, sizeof(err))) _exit(2);
        int at = aio_direct_attach(e, &x.info, err, sizeof(err));
        if (at < 0) _exit(3);
        if (aio_direct_mark(e, at, slot2, 1)) _exit(4);
        _exit(0); /* dies with its mark set */
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "the child failed (status 0x%x)", status);
    CHECK_OK(aio_mr_close(f->b.e, mr2)); /* its mark is void: the close goes through */
    free(p);
    return 0;
}

/* ------------------------------------------------------------------ main */

typedef struct test {
    const char *name;
    int (*fn)(fix_t *);
} test_t;

static aio_stats stats_of(aio_engine *e) {
    aio_stats st;
    aio_get_stats(e, &st);
    return st;
}

/* SO_SNDBUF of this process's TCP connection to `port` on the same IP, or -1 if none. */
static int sndbuf_to(uint16_t port) {
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    int out = -1;
    struct dirent *de;
    while ((de = readdir(d))) {
        int fd = atoi(de->d_name), v = 0;
        socklen_t l = sizeof(v);
        struct sockaddr_in loc, rem;
        socklen_t ll = sizeof(loc), rl = sizeof(rem);
        if (de->d_name[0] < '0' || de->d_name[0] > '9' || fd == dirfd(d) ||
            getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &v, &l) || v != IPPROTO_TCP ||
            getsockname(fd, (struct sockaddr *)&loc, &ll) || getpeername(fd, (struct sockaddr *)&rem, &rl) ||
            rem.sin_family != AF_INET || ntohs(rem.sin_port) != port || rem.sin_addr.s_addr != loc.sin_addr.s_addr)
            continue;
        l = sizeof(v);
        if (!getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, &l)) out = v;
    }
    closedir(d);
    return out;
}

static int t_tcp_sndbuf(fix_t *f) {
    if (strcmp(f->prov, "tcp")) {
        printf("    (tcp only)\n");
        return 0;
    }
    CHECK(aio_engine_set_tcp_sndbuf(f->a.e, 0, 0) == -FI_EINVAL, "set after start accepted");
    /* off: nothing set; arguments checked; too late once a rail exists */
    char err[256] = "";
    aio_engine_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    aio_engine *e = NULL;
    CHECK_OK(aio_engine_create(&cfg, &e, err, sizeof(err)));
    int bad = aio_engine_set_tcp_sndbuf(e, -1, 0), off = aio_engine_set_tcp_sndbuf(e, 0, 0);
    int rail = aio_engine_add_rail(e, "tcp", f->nic, 4, 4096, err, sizeof(err));
    int late = aio_engine_set_tcp_sndbuf(e, 4096, 0);
    uint64_t n_off = stats_of(e).tcp_tuned;
    aio_engine_destroy(e);
    CHECK(bad == -FI_EINVAL && off == 0 && rail >= 0 && late == -FI_EINVAL,
          "set_tcp_sndbuf: -1 -> %d, 0 -> %d, add_rail %d, after a rail %d", bad, off, rail, late);
    CHECK(n_off == 0, "sndbuf 0: %llu sockets set", (unsigned long long)n_off);
    /* default: the listener on lo at add_rail, then the connection at the first write */
    eng_t c, d;
    memset(&c, 0, sizeof(c));
    memset(&d, 0, sizeof(d));
    int rc = eng_init(&c, "tcp", f->nic, MiB);
    if (!rc) rc = eng_init(&d, "tcp", f->nic, MiB);
    if (!rc) rc = connect_pair(&c, &d);
    uint64_t at_open = rc ? 0 : stats_of(c.e).tcp_tuned;
    if (!rc) {
        fill(c.buf, MiB, 0, 0x5b);
        aio_op_desc op = op_to(&c, &d, AIO_OP_WRITE, 0, 0, MiB, 0, 0);
        rc = run_group(&c, &op, 1, NULL);
    }
    int64_t differs = rc ? 0 : verify(d.buf, MiB, 0, 0x5b);
    uint64_t after = rc ? 0 : stats_of(c.e).tcp_tuned;
    const struct sockaddr_in *dl = (const struct sockaddr_in *)(const void *)d.info.addr;
    int got = rc ? -1 : sndbuf_to(ntohs(dl->sin_port));
    FILE *fm = fopen("/proc/sys/net/core/wmem_max", "r");
    long cap = AIO_TCP_SNDBUF_AUTO;
    if (fm) {
        if (fscanf(fm, "%ld", &cap) != 1) cap = AIO_TCP_SNDBUF_AUTO;
        fclose(fm);
    }
    eng_free(&c);
    eng_free(&d);
    if (rc) return rc;
    CHECK(differs < 0, "the write: byte %lld differs", (long long)differs);
    CHECK(at_open == 1, "at open: %llu sockets set, want the listener", (unsigned long long)at_open);
    CHECK(after == 2, "after a write: %llu sockets set, want 2", (unsigned long long)after);
    long want = 2 * (cap < AIO_TCP_SNDBUF_AUTO ? cap : AIO_TCP_SNDBUF_AUTO);
    CHECK(got == want, "the connection's SO_SNDBUF is %d, want %ld", got, want);
    return 0;
}

/* Requests handed to the poller (aio_engine_set_hand_posts(1): every eligible one) arrive
 * whole, credited, and read back; a failed one stops handing to that peer until a request to
 * it goes through in the posting thread again. */
static int t_handed(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    CHECK(aio_engine_set_hand_posts(a->e, 2) == -FI_EINVAL, "mode 2 accepted");
    CHECK(aio_engine_set_hand_posts(a->e, -2) == -FI_EINVAL, "mode -2 accepted");
    /* one request in the posting thread: the peer's connection is known to carry */
    aio_op_desc first = op_to(a, b, AIO_OP_WRITE, 0, 0, 64, AIO_F_DATA, 0x7000);
    if (run_group(a, &first, 1, NULL)) return -1;
    CHECK(wait_take(b, 0x7000, U, TIMEOUT) == 0, "first write: no credit");
    CHECK_OK(aio_engine_set_hand_posts(a->e, 1));
    enum { N = 48 };
    aio_op_desc w[N];
    uint64_t off = 0, loffs[N], lens[N];
    for (int i = 0; i < N; i++) {
        lens[i] = (i % 3 == 0) ? 1 + (uint64_t)i * 977 : (i % 3 == 1) ? 65536 : 200000 + (uint64_t)i;
        loffs[i] = off;
        fill(a->buf + off, lens[i], 0, 0x7100 + (uint32_t)i);
        w[i] = op_to(a, b, AIO_OP_WRITE, off, off, lens[i], AIO_F_DATA, 0x7001);
        off += (lens[i] + 4095) & ~4095ULL;
    }
    CHECK(off <= a->len / 2, "test layout exceeds half the region");
    uint64_t h0 = stats_of(a->e).posts_handed;
    if (run_group(a, w, N, NULL)) return -1;
    CHECK(stats_of(a->e).posts_handed - h0 == N, "handed %llu of %d writes",
          (unsigned long long)(stats_of(a->e).posts_handed - h0), N);
    CHECK(wait_take(b, 0x7001, N * U, TIMEOUT) == 0, "handed writes: credits missing");
    for (int i = 0; i < N; i++) {
        int64_t bad = verify(b->buf + loffs[i], lens[i], 0, 0x7100 + (uint32_t)i);
        CHECK(bad < 0, "handed write %d (%llu bytes): byte %lld differs", i,
              (unsigned long long)lens[i], (long long)bad);
    }
    /* read them back into the upper half, handed too */
    aio_op_desc rd[N];
    uint64_t half = a->len / 2;
    memset(a->buf + half, 0, off);
    for (int i = 0; i < N; i++) rd[i] = op_to(a, b, AIO_OP_READ, half + loffs[i], loffs[i], lens[i], 0, 0);
    h0 = stats_of(a->e).posts_handed;
    if (run_group(a, rd, N, NULL)) return -1;
    CHECK(stats_of(a->e).posts_handed - h0 == N, "handed %llu of %d reads", (unsigned long long)(stats_of(a->e).posts_handed - h0), N);
    for (int i = 0; i < N; i++) {
        int64_t bad = verify(a->buf + half + loffs[i], lens[i], 0, 0x7100 + (uint32_t)i);
        CHECK(bad < 0, "handed read %d: byte %lld differs", i, (long long)bad);
    }
    CHECK(aio_mr_inflight(a->mr) == 0, "inflight %lld", (long long)aio_mr_inflight(a->mr));
    /* never (-1) hands nothing over; the default (0) on shm hands only requests under 16 KiB,
     * and those only while the poller holds the rail */
    CHECK_OK(aio_engine_set_hand_posts(a->e, -1));
    h0 = stats_of(a->e).posts_handed;
    if (run_group(a, w, N, NULL)) return -1;
    CHECK(stats_of(a->e).posts_handed == h0, "mode -1 handed %llu writes", (unsigned long long)(stats_of(a->e).posts_handed - h0));
    CHECK(wait_take(b, 0x7001, N * U, TIMEOUT) == 0, "mode -1 writes: credits missing");
    CHECK_OK(aio_engine_set_hand_posts(a->e, 0));
    uint64_t small = 0;
    for (int i = 0; i < N; i++) small += lens[i] < 16384;
    if (!strcmp(a->info.provider, "shm")) { /* shm reports no error at the initiator */
        h0 = stats_of(a->e).posts_handed;
        if (run_group(a, w, N, NULL)) return -1;
        CHECK(stats_of(a->e).posts_handed - h0 <= small, "shm handed %llu writes by default (%llu under 16 KiB)",
              (unsigned long long)(stats_of(a->e).posts_handed - h0), (unsigned long long)small);
        CHECK(wait_take(b, 0x7001, N * U, TIMEOUT) == 0, "default shm writes: credits missing");
        return 0;
    }
    /* the default on tcp: every write of 16 KiB or more is handed, busy rail or not; smaller
     * ones only while the poller holds the rail */
    uint64_t large = 0;
    for (int i = 0; i < N; i++) large += lens[i] >= 16384;
    h0 = stats_of(a->e).posts_handed;
    if (run_group(a, w, N, NULL)) return -1;
    uint64_t handed = stats_of(a->e).posts_handed - h0;
    CHECK(handed >= large && handed <= (uint64_t)N, "tcp default handed %llu of %d writes (%llu of 16 KiB or more)",
          (unsigned long long)handed, N, (unsigned long long)large);
    CHECK(wait_take(b, 0x7001, N * U, TIMEOUT) == 0, "default tcp writes: credits missing");
    for (int i = 0; i < N; i++) {
        int64_t bad = verify(b->buf + loffs[i], lens[i], 0, 0x7100 + (uint32_t)i);
        CHECK(bad < 0, "default tcp write %d: byte %lld differs", i, (long long)bad);
    }
    CHECK_OK(aio_engine_set_hand_posts(a->e, 1));
    /* a handed write that fails (a wrong key: tcp drops the connection) */
    aio_op_desc badk = op_to(a, b, AIO_OP_WRITE, 0, 8192, 4096, AIO_F_DATA, 0x7002);
    badk.rkey ^= 0x5a5a5a5a5a5aULL;
    aio_record r;
    h0 = stats_of(a->e).posts_handed;
    if (group_record(a, &badk, 1, &r)) return -1;
    CHECK(r.status != 0, "a write with a wrong key succeeded");
    CHECK(stats_of(a->e).posts_handed - h0 == 1, "the wrong-key write was not handed");
    /* the next requests go in the posting thread until one gets through */
    int delivered = 0;
    aio_op_desc ok = op_to(a, b, AIO_OP_WRITE, 0, 0, 64, AIO_F_DATA, 0x7003);
    for (int attempt = 0; attempt < 40 && !delivered; attempt++) {
        h0 = stats_of(a->e).posts_handed;
        if (group_record(a, &ok, 1, &r)) return -1;
        CHECK(stats_of(a->e).posts_handed == h0, "a write to a failed peer was handed (attempt %d)", attempt);
        if (r.status) {
            sleep_us(10000);
            continue;
        }
        if (wait_take(b, 0x7003, U, 0.5) == 0) delivered = 1;
    }
    CHECK(delivered, "no write got through after the failed one");
    h0 = stats_of(a->e).posts_handed;
    if (run_group(a, &ok, 1, NULL)) return -1;
    CHECK(stats_of(a->e).posts_handed - h0 == 1, "handing did not resume after a write got through");
    CHECK(wait_take(b, 0x7003, U, TIMEOUT) == 0, "no credit after handing resumed");
    CHECK_OK(aio_engine_set_hand_posts(a->e, 0));
    CHECK(aio_mr_inflight(a->mr) == 0, "inflight");
    return 0;
}

/* A handed request whose connection is full (its peer process stopped) waits in the poller's
 * queue with the later ones to that connection; handed requests on another rail go on past
 * them, and on shm (a queue per peer) so do those to another peer on the same rail. On tcp the
 * same rail's other peers wait too: rxm's pool of send buffers is per endpoint, so a stopped
 * peer that holds all of it leaves none to them. Once the peer continues, its requests complete. */
static int t_handed_stall(fix_t *f) {
    eng_t *b = &f->b, x; /* x: an initiator with two rails */
    if (eng_init_n(&x, f->prov, f->nic, MiB, 2)) {
        eng_free(&x);
        return -1;
    }
    int to_child, from_child;
    pid_t pid = spawn_peer(f, "--stall-peer", &to_child, &from_child);
    if (pid < 0) {
        eng_free(&x);
        return -1;
    }
    int rc = -1, stopped = 0;
    uint64_t tok = 0;
    do {
        peer_info theirs;
        if (read_full(from_child, &theirs, sizeof(theirs), 30000)) {
            fail_msg(__FILE__, __LINE__, "no descriptor from the child");
            break;
        }
        uint64_t pc, pb0, pb1;
        int ret = aio_av_insert(x.e, 0, theirs.addr, theirs.addr_len, &pc);
        if (!ret) ret = aio_av_insert(x.e, 0, b->info.addr, b->info.addr_len, &pb0);
        if (!ret) ret = aio_av_insert(x.e, 1, b->info.addr, b->info.addr_len, &pb1);
        if (ret) {
            fail_msg(__FILE__, __LINE__, "av_insert: %s", aio_strerror(ret));
            break;
        }
        /* first requests in the posting thread: every connection carries */
        aio_op_desc wc = op_remote(&x, &theirs, AIO_OP_WRITE, 0, 0, 65536, 0, 0);
        wc.peer = pc;
        aio_op_desc wb[2]; /* to b on rail 0 (c's rail) and on rail 1 */
        for (int i = 0; i < 2; i++) {
            wb[i] = op_to(&x, b, AIO_OP_WRITE, 0, (uint64_t)i * 64, 64, AIO_F_DATA, 0x7200);
            wb[i].rail = i;
            wb[i].peer = i ? pb1 : pb0;
        }
        if (run_group(&x, &wc, 1, NULL) || run_group(&x, wb, 2, NULL)) break;
        if (wait_take(b, 0x7200, 2 * U, TIMEOUT)) {
            fail_msg(__FILE__, __LINE__, "first writes to b: no credit");
            break;
        }
        if (aio_engine_set_hand_posts(x.e, 1)) break;
        if (kill(pid, SIGSTOP)) {
            fail_msg(__FILE__, __LINE__, "SIGSTOP: %s", strerror(errno));
            break;
        }
        stopped = 1;
        /* handed writes to the stopped peer, until one finds its connection full */
        tok = g_token++;
        int64_t g = aio_group_open(x.e, tok);
        if (g < 0) {
            fail_msg(__FILE__, __LINE__, "aio_group_open: %s", aio_strerror((int)g));
            break;
        }
        uint64_t w0 = stats_of(x.e).posts_handed_waited;
        int posted = 0;
        double t0 = now_s();
        while (stats_of(x.e).posts_handed_waited == w0 && posted < 32768 && now_s() - t0 < 10) {
            if (post_all(&x, g, &wc, 1, TIMEOUT)) break;
            if (++posted % 32 == 0) sleep_us(2000);
        }
        double t_full = now_s();
        if (aio_group_seal(x.e, g)) break;
        if (stats_of(x.e).posts_handed_waited == w0) {
            fail_msg(__FILE__, __LINE__, "none of %d handed writes to the stopped peer met a full queue", posted);
            break;
        }
        /* handed writes to b go past them: rail 1's, and on shm rail 0's (until the queue let
         * requests past a full connection, they waited for the stopped peer's first request to
         * time out, 1 s) */
        int nb = strcmp(f->prov, "shm") ? 1 : 2;
        for (int i = 0; i < 2; i++) wb[i].data = 0x7201;
        uint64_t h0 = stats_of(x.e).posts_handed;
        aio_record r;
        if (group_record(&x, nb == 2 ? wb : wb + 1, nb, &r)) break;
        double waited = now_s() - t_full;
        if (r.status || stats_of(x.e).posts_handed - h0 != (uint64_t)nb) {
            fail_msg(__FILE__, __LINE__, "the writes to b: status %d (%s), %llu of %d handed", r.status,
                     aio_strerror(r.status), (unsigned long long)(stats_of(x.e).posts_handed - h0), nb);
            break;
        }
        if (wait_take(b, 0x7201, (uint64_t)nb * U, TIMEOUT)) {
            fail_msg(__FILE__, __LINE__, "the writes to b: no credit");
            break;
        }
        pump(&x);
        if (count_rec(&x, AIO_REC_GROUP, tok)) {
            fail_msg(__FILE__, __LINE__, "the stopped peer's writes completed while it was stopped");
            break;
        }
        if (waited > 0.5) {
            fail_msg(__FILE__, __LINE__, "the writes to b completed %.2f s after the stopped peer's queue filled", waited);
            break;
        }
        kill(pid, SIGCONT);
        stopped = 0;
        if (wait_rec(&x, AIO_REC_GROUP, tok, TIMEOUT, &r)) {
            fail_msg(__FILE__, __LINE__, "no record for the stopped peer's %d writes", posted);
            break;
        }
        tok = 0;
        /* handed requests that waited over 1 s for room fail as timed out (the caller retries) */
        double held = now_s() - t_full;
        if (!(r.status == 0 || (r.status == -FI_ETIMEDOUT && held > 0.9))) {
            fail_msg(__FILE__, __LINE__, "the stopped peer's writes: status %d (%s) after %.2f s",
                     r.status, aio_strerror(r.status), held);
            break;
        }
        rc = 0;
    } while (0);
    if (stopped) kill(pid, SIGCONT);
    if (tok) { /* a failure above: let the group's record come before the engine goes */
        aio_record r;
        wait_rec(&x, AIO_REC_GROUP, tok, TIMEOUT, &r);
    }
    int64_t inflight = aio_mr_inflight(x.mr);
    eng_free(&x);
    int said_bye, status = reap_peer(pid, to_child, from_child, &said_bye);
    if (rc) return rc;
    CHECK(said_bye && status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "the stall peer failed (status 0x%x)", status);
    CHECK(inflight == 0, "inflight %lld", (long long)inflight);
    return 0;
}

/* The threads of this process (/proc/self/status), or -1. */
static int thread_count(void) {
    FILE *fp = fopen("/proc/self/status", "r");
    if (!fp) return -1;
    char line[256];
    int n = -1;
    while (fgets(line, sizeof(line), fp))
        if (sscanf(line, "Threads: %d", &n) == 1) break;
    fclose(fp);
    return n;
}

/* Several poller threads: rail i is driven by poller i % n. aio_engine_set_pollers refuses bad
 * values and comes before the rails; an engine with 3 rails and 3 pollers runs two threads
 * more than one with a single poller; writes with immediates and reads on all three rails at
 * once land whole, and every counter gets exactly its credits; the watched words (poller 0)
 * still report. */
static int t_pollers(fix_t *f) {
    enum { NR = 3, PER = 24 };
    const uint64_t len = 256 * 1024;
    eng_t x, y, one;
    memset(&x, 0, sizeof(x));
    memset(&y, 0, sizeof(y));
    memset(&one, 0, sizeof(one));
    int rc = -1;
    do {
        int t0 = thread_count();
        if (eng_init_p(&one, f->prov, f->nic, 0, NR, 1)) break;
        int t1 = thread_count();
        if (eng_init_p(&x, f->prov, f->nic, 2 * NR * PER * len, NR, NR) ||
            eng_init_p(&y, f->prov, f->nic, 2 * NR * PER * len, NR, 8)) /* 8: capped at 3 */
            break;
        int t2 = thread_count();
        if (aio_engine_num_pollers(one.e) != 1 || aio_engine_num_pollers(x.e) != NR ||
            aio_engine_num_pollers(y.e) != NR) {
            fail_msg(__FILE__, __LINE__, "pollers: %d %d %d, want 1 3 3", aio_engine_num_pollers(one.e),
                     aio_engine_num_pollers(x.e), aio_engine_num_pollers(y.e));
            break;
        }
        /* each 3-poller engine: two threads more than the 1-poller one */
        if (t0 < 0 || (t2 - t1) != 2 * (t1 - t0) + 4) {
            fail_msg(__FILE__, __LINE__, "threads: %d, %d after a 1-poller engine, %d after two "
                     "3-poller ones", t0, t1, t2);
            break;
        }
        char err[256];
        aio_engine *late = NULL;
        aio_engine_config cfg;
        memset(&cfg, 0, sizeof(cfg));
        if (aio_engine_create(&cfg, &late, err, sizeof(err)) != 0) {
            fail_msg(__FILE__, __LINE__, "aio_engine_create: %s", err);
            break;
        }
        int bad0 = aio_engine_set_pollers(late, 0), bad17 = aio_engine_set_pollers(late, AIO_MAX_RAILS + 1);
        int rail = aio_engine_add_rail(late, f->prov, f->nic, 4, 4096, err, sizeof(err));
        int after = aio_engine_set_pollers(late, 2);
        aio_engine_destroy(late);
        if (bad0 != -FI_EINVAL || bad17 != -FI_EINVAL || rail < 0 || after != -FI_EINVAL) {
            fail_msg(__FILE__, __LINE__, "set_pollers: 0 -> %d, 17 -> %d, add_rail %d, after a rail %d",
                     bad0, bad17, rail, after);
            break;
        }
        uint64_t peer[NR];
        aio_rail_info yi;
        int ret = 0;
        for (int i = 0; i < NR && !ret; i++) {
            ret = aio_rail_get_info(y.e, i, &yi);
            if (!ret) ret = aio_av_insert(x.e, i, yi.addr, yi.addr_len, &peer[i]);
        }
        if (ret) {
            fail_msg(__FILE__, __LINE__, "av_insert: %s", aio_strerror(ret));
            break;
        }
        /* writes: the rails interleaved in one batch, each rail its own immediate */
        aio_op_desc w[NR * PER];
        for (int k = 0; k < NR * PER; k++) {
            int i = k % NR;
            fill(x.buf + (uint64_t)k * len, len, 0, 0x500u + (uint32_t)k);
            memset(&w[k], 0, sizeof(w[k]));
            w[k].mr = x.mr;
            w[k].offset = (uint64_t)k * len;
            w[k].length = len;
            w[k].rail = i;
            w[k].peer = peer[i];
            w[k].raddr = aio_mr_remote_base(y.mr, i) + (uint64_t)k * len;
            w[k].rkey = aio_mr_key(y.mr, i);
            w[k].op = AIO_OP_WRITE;
            w[k].flags = AIO_F_DATA;
            w[k].data = 0x7300u + (uint32_t)i;
        }
        if (run_group(&x, w, NR * PER, NULL)) break;
        int bad = 0;
        for (int i = 0; i < NR && !bad; i++)
            if (wait_take(&y, 0x7300u + (uint32_t)i, PER * U, TIMEOUT)) {
                fail_msg(__FILE__, __LINE__, "rail %d: credits missing", i);
                bad = 1;
            } else if (aio_counter_total(y.e, 0x7300u + (uint32_t)i) != PER * U) {
                fail_msg(__FILE__, __LINE__, "rail %d: %llu credits, want %llu", i,
                         (unsigned long long)aio_counter_total(y.e, 0x7300u + (uint32_t)i),
                         (unsigned long long)(PER * U));
                bad = 1;
            }
        for (int k = 0; k < NR * PER && !bad; k++) {
            int64_t off = verify(y.buf + (uint64_t)k * len, len, 0, 0x500u + (uint32_t)k);
            if (off >= 0) {
                fail_msg(__FILE__, __LINE__, "write %d (rail %d): byte %lld differs", k, k % NR, (long long)off);
                bad = 1;
            }
        }
        if (bad) break;
        /* reads back into the second half, all rails at once */
        aio_op_desc r[NR * PER];
        for (int k = 0; k < NR * PER; k++) {
            r[k] = w[k];
            r[k].op = AIO_OP_READ;
            r[k].flags = 0;
            r[k].data = 0;
            r[k].offset = (uint64_t)(NR * PER + k) * len;
        }
        if (run_group(&x, r, NR * PER, NULL)) break;
        for (int k = 0; k < NR * PER && !bad; k++) {
            int64_t off = verify(x.buf + (uint64_t)(NR * PER + k) * len, len, 0, 0x500u + (uint32_t)k);
            if (off >= 0) {
                fail_msg(__FILE__, __LINE__, "read %d (rail %d): byte %lld differs", k, k % NR, (long long)off);
                bad = 1;
            }
        }
        if (bad) break;
        /* a watched word reports through poller 0 */
        static volatile uint64_t word = 0;
        int id = aio_watch_add(x.e, &word, 0, 0x77);
        if (id < 0) {
            fail_msg(__FILE__, __LINE__, "aio_watch_add: %s", aio_strerror(id));
            break;
        }
        aio_word_store(x.e, &word, 5);
        aio_record rec;
        int got = wait_rec(&x, AIO_REC_WATCH, 0x77, TIMEOUT, &rec);
        aio_watch_remove(x.e, id);
        if (got || rec.a != 5) {
            fail_msg(__FILE__, __LINE__, "watched word: %s", got ? "no record" : "wrong value");
            break;
        }
        rc = 0;
    } while (0);
    if (x.mr && aio_mr_inflight(x.mr) != 0 && !rc) {
        fail_msg(__FILE__, __LINE__, "inflight %lld", (long long)aio_mr_inflight(x.mr));
        rc = -1;
    }
    eng_free(&x);
    eng_free(&y);
    eng_free(&one);
    return rc;
}


/* The ring full and malloc failing (the core's test hook: the overflow list's malloc fails):
 * no completion record is lost. N one-write groups are submitted while nothing drains, so
 * that the ring (4096) fills and more records come: the poller keeps its records and stops
 * reading completions until the ring has room (backpressure), other threads take reserve
 * nodes. Then everything is drained: every group's record must come, exactly once. */
extern _Atomic int aio_test_ovf_malloc_fail;
static int t_ring_nomem(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    enum { N = 7000 };
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 0, 8, 0, 0);
    uint64_t tok0 = g_token;
    g_token += N;
    uint8_t *seen = calloc(N, 1);
    CHECK(seen, "oom");
    pump(a);
    int ninbox0 = a->ninbox;
    atomic_store(&aio_test_ovf_malloc_fail, 1);
    int posted = 0, got = 0, draining = 0, err = 0;
    int64_t g = -1;
    double t0 = now_s(), last = now_s();
    while (got < N) {
        if (now_s() - t0 > 60) {
            err = -FI_ETIMEDOUT;
            break;
        }
        if (posted < N) {
            int64_t r;
            if (g < 0) {
                r = aio_submit(a->e, tok0 + (uint64_t)posted, &d, 1, 1000000, &g);
                if (g < 0) r = 0;
                else if (r == 1) g = -1;
            } else {
                r = aio_post(a->e, g, &d, 1, 1000000);
                if (r == 1) {
                    aio_group_seal(a->e, g);
                    g = -1;
                }
            }
            if (r < 0) {
                err = (int)r;
                break;
            }
            if (r == 1) {
                posted++;
                last = now_s();
            } else if (now_s() - last > 0.1) {
                draining = 1; /* the engine holds back: let it go on */
            }
        }
        if (posted == N || draining) {
            pump(a);
            for (int i = ninbox0; i < a->ninbox; i++) {
                aio_record *x = &a->inbox[i];
                if (x->kind != AIO_REC_GROUP || x->token < tok0 || x->token >= tok0 + N) continue;
                if (x->status != 0) err = x->status;
                if (seen[x->token - tok0]++ == 0) got++;
                memmove(x, x + 1, (size_t)(a->ninbox - i - 1) * sizeof(aio_record));
                a->ninbox--;
                i--;
            }
            if (posted == N) sleep_us(100);
        }
    }
    atomic_store(&aio_test_ovf_malloc_fail, 0);
    int twice = 0;
    for (int i = 0; i < N; i++) twice += seen[i] > 1;
    free(seen);
    CHECK(err == 0, "%s (posted %d, records %d)", aio_strerror(err), posted, got);
    CHECK(got == N && twice == 0, "%d of %d group records came (%d twice)", got, N, twice);
    printf("    (%s while posting)\n", draining ? "drained" : "not drained");
    return 0;
}

static const test_t TESTS[] = {
    {"write_sizes", t_write_sizes},   {"zero_byte_imm", t_zero_byte_imm},
    {"weight", t_weight},             {"counters", t_counters},
    {"counter_release", t_counter_release},
    {"read", t_read},                 {"sendrecv", t_sendrecv},
    {"batch10k", t_batch10k},         {"group_race", t_group_race},
    {"post_invalid", t_post_invalid}, {"paged", t_paged},
    {"mr_close_busy", t_mr_close_busy}, {"eventfd", t_eventfd},
    {"two_process", t_two_process},   {"remote_error", t_remote_error},
    {"idle_cpu", t_idle},             {"idle_waiting", t_idle_waiting},
    {"watch", t_watch},               {"watch_soon", t_watch_soon},
    {"lane", t_lane},
    {"register_dev", t_register_dev},
    {"poll_ring", t_poll_ring},       {"submit", t_submit},
    {"submit_quiet", t_submit_quiet}, {"spin_window", t_spin_window},
    {"direct", t_direct},             {"direct_retire", t_direct_retire},
    {"tcp_sndbuf", t_tcp_sndbuf},     {"handed", t_handed},
    {"handed_stall", t_handed_stall}, {"pollers", t_pollers},
    {"ring_nomem", t_ring_nomem},
};

static void report(const char *prov, const char *name, int rc, double dt) {
    if (rc == 0) {
        g_pass++;
        printf("ok   %-8s %-14s (%.2f s)\n", prov, name, dt);
    } else {
        g_fail++;
        printf("FAIL %-8s %-14s (%.2f s): %s\n", prov, name, dt, g_why);
    }
    fflush(stdout);
}

static void run_provider(const char *label, const char *prov, const char *nic, const char *only) {
    fix_t f;
    memset(&f, 0, sizeof(f));
    f.prov = prov;
    f.nic = nic;
    f.name = label;
    double t0 = now_s();
    g_why[0] = 0;
    int rc = eng_init(&f.a, prov, nic, REGION_LEN);
    if (!rc) rc = eng_init(&f.b, prov, nic, REGION_LEN);
    if (!rc) rc = connect_pair(&f.a, &f.b);
    if (rc) {
        report(label, "setup", rc, now_s() - t0);
        eng_free(&f.a);
        eng_free(&f.b);
        return;
    }
    printf("#    %s: provider %s, domain %s, mr_mode 0x%llx, cq_data_size %u, wait fd %d\n", label,
           f.a.info.provider, f.a.info.domain, (unsigned long long)f.a.info.mr_mode,
           f.a.info.cq_data_size, f.a.info.has_wait_fd);
    for (unsigned i = 0; i < sizeof(TESTS) / sizeof(TESTS[0]); i++) {
        if (only && !strstr(TESTS[i].name, only)) continue;
        g_why[0] = 0;
        t0 = now_s();
        rc = TESTS[i].fn(&f);
        report(label, TESTS[i].name, rc, now_s() - t0);
    }
    /* teardown: regions close cleanly once idle */
    t0 = now_s();
    g_why[0] = 0;
    rc = 0;
    int ra = aio_mr_close(f.a.e, f.a.mr), rb = aio_mr_close(f.b.e, f.b.mr);
    f.a.mr = ra == 0 ? NULL : f.a.mr;
    f.b.mr = rb == 0 ? NULL : f.b.mr;
    if (ra || rb) {
        fail_msg(__FILE__, __LINE__, "aio_mr_close at teardown: %d %d", ra, rb);
        rc = -1;
    }
    eng_free(&f.a);
    eng_free(&f.b);
    report(label, "teardown", rc, now_s() - t0);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!getenv("FI_PROVIDER")) setenv("FI_PROVIDER", "tcp,ofi_rxm,shm", 1);
    ssize_t n = readlink("/proc/self/exe", g_self, sizeof(g_self) - 1);
    if (n <= 0) snprintf(g_self, sizeof(g_self), "%s", argv[0]);
    else g_self[n] = 0;
    if (argc == 6 && (!strcmp(argv[1], "--peer") || !strcmp(argv[1], "--stall-peer"))) {
        const char *nic = strcmp(argv[3], "-") ? argv[3] : NULL;
        int rc = !strcmp(argv[1], "--peer") ? peer_body(argv[2], nic, atoi(argv[4]), atoi(argv[5]))
                                            : stall_peer_body(argv[2], nic, atoi(argv[4]), atoi(argv[5]));
        if (rc) fprintf(stderr, "peer (%s): %s\n", argv[2], g_why);
        return rc ? 1 : 0;
    }
    /* usage: test_core [provider-filter] [test-filter] */
    const char *pf = argc > 1 ? argv[1] : NULL, *tf = argc > 2 ? argv[2] : NULL;
    printf("# aiote core tests, libfabric %u.%u\n", aio_fabric_version() >> 16,
           aio_fabric_version() & 0xffff);
    if (!pf || !strcmp(pf, "tcp") || !strcmp(pf, "all")) run_provider("tcp/lo", "tcp", "lo", tf);
    if (!pf || !strcmp(pf, "shm") || !strcmp(pf, "all")) run_provider("shm", "shm", NULL, tf);
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
