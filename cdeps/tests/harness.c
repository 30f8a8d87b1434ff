/* The harness of the plain C tests: checks and their messages, byte patterns, engines on one
 * provider, records drained from the ring, groups posted and awaited. */
#include "harness.h"

/* ------------------------------------------------------------------ harness */

int g_pass, g_fail;
char g_why[1024];
char g_self[4096];

void fail_msg(const char *file, int line, const char *fmt, ...) {
    int n = snprintf(g_why, sizeof(g_why), "%s:%d: ", file, line);
    if (n < 0 || (size_t)n >= sizeof(g_why)) n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_why + n, sizeof(g_why) - (size_t)n, fmt, ap);
    va_end(ap);
}

double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void sleep_us(long us) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

void fill(uint8_t *p, uint64_t n, uint64_t k0, uint32_t seed) {
    for (uint64_t i = 0; i < n; i++) p[i] = pat(k0 + i, seed);
}

/* index of the first byte that differs from the pattern, or -1 */
int64_t verify(const uint8_t *p, uint64_t n, uint64_t k0, uint32_t seed) {
    for (uint64_t i = 0; i < n; i++)
        if (p[i] != pat(k0 + i, seed)) return (int64_t)i;
    return -1;
}

/* ------------------------------------------------------------------ engines */

uint64_t g_token = 1000;

void eng_free(eng_t *x) {
    if (x->e) {
        if (x->mr) aio_mr_close(x->e, x->mr);
        aio_engine_destroy(x->e);
    }
    free(x->inbox);
    free(x->buf);
    memset(x, 0, sizeof(*x));
}

int32_t g_watch_us; /* the next engines' watch interval (0: the default) */

/* An engine with `nrails` rails of the provider (x->rail: the first) driven by `pollers`
 * poller threads, its region registered on all of them. */
int eng_init_p(eng_t *x, const char *prov, const char *nic, uint64_t region_len, int nrails,
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

int eng_init_n(eng_t *x, const char *prov, const char *nic, uint64_t region_len, int nrails) {
    return eng_init_p(x, prov, nic, region_len, nrails, 1);
}

int eng_init(eng_t *x, const char *prov, const char *nic, uint64_t region_len) {
    return eng_init_n(x, prov, nic, region_len, 1);
}

/* Drains the engine's ring into its inbox. */
int pump(eng_t *x) {
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

int count_rec(eng_t *x, int kind, uint64_t token) {
    int c = 0;
    for (int i = 0; i < x->ninbox; i++)
        if (x->inbox[i].kind == kind && (token == ANY || x->inbox[i].token == token)) c++;
    return c;
}

/* Waits for a record (drain polled with 50 us sleeps). 0, or -1 on timeout. */
int wait_rec(eng_t *x, int kind, uint64_t token, double timeout, aio_record *out) {
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
int wait_take(eng_t *x, uint32_t imm, uint64_t units, double timeout) {
    double t0 = now_s();
    while (!aio_counter_take(x->e, imm, units)) {
        pump(x);
        if (now_s() - t0 > timeout) return -1;
        sleep_us(50);
    }
    return 0;
}

/* Waits until aio_counter_total(imm) >= units. */
int wait_total(eng_t *x, uint32_t imm, uint64_t units, double timeout) {
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
int post_all(eng_t *x, int64_t g, const aio_op_desc *it, int64_t n, double timeout) {
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

/* A request from src's region (at loff) to the remote address raddr under key rkey. */
aio_op_desc op_at(eng_t *src, int op, uint64_t loff, uint64_t raddr, uint64_t rkey, uint64_t len,
                  int flags, uint64_t data) {
    aio_op_desc d;
    memset(&d, 0, sizeof(d));
    d.mr = src->mr;
    d.offset = loff;
    d.length = len;
    d.peer = src->peer;
    d.raddr = raddr;
    d.rkey = rkey;
    d.data = data;
    d.rail = src->rail;
    d.op = op;
    d.flags = flags;
    return d;
}

aio_op_desc op_to(eng_t *src, eng_t *dst, int op, uint64_t loff, uint64_t roff, uint64_t len, int flags,
                  uint64_t data) {
    return op_at(src, op, loff, aio_mr_remote_base(dst->mr, dst->rail) + roff, aio_mr_key(dst->mr, dst->rail),
                 len, flags, data);
}

/* Opens a group, posts the items, seals it and waits for its record (whatever its status). */
int group_record(eng_t *x, const aio_op_desc *it, int64_t n, aio_record *r) {
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
int run_group(eng_t *x, const aio_op_desc *it, int64_t n, aio_record *rec) {
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

int connect_pair(eng_t *a, eng_t *b) {
    CHECK_OK(aio_av_insert(a->e, a->rail, b->info.addr, b->info.addr_len, &a->peer));
    CHECK_OK(aio_av_insert(b->e, b->rail, a->info.addr, a->info.addr_len, &b->peer));
    return 0;
}

aio_stats stats_of(aio_engine *e) {
    aio_stats st;
    aio_get_stats(e, &st);
    return st;
}

/* Posts a paged write into one group and returns its record (rec->a: the requests formed). */
int paged_group(eng_t *a, const aio_paged_desc *d, int64_t n, aio_record *rec) {
    uint64_t tok = g_token++;
    int64_t g = aio_group_open(a->e, tok);
    CHECK(g >= 0, "aio_group_open");
    int64_t done = 0;
    double t0 = now_s();
    while (done < n) {
        int64_t r = aio_post_paged(a->e, g, d, done, n, 1000000);
        CHECK(r >= 0, "aio_post_paged: %s", aio_strerror((int)r));
        done += r;
        CHECK(now_s() - t0 < TIMEOUT, "paged post timed out");
        if (r == 0) sleep_us(50);
    }
    CHECK_OK(aio_group_seal(a->e, g));
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, rec) == 0, "no group record");
    return 0;
}
