/* The plain C tests' harness (harness.c) and what the test files share: checks, patterns,
 * engine pairs on one provider, records and groups, the peer process. Each test file holds
 * tests of one concern; test_core.c lists them and runs each on tcp and shm. */
#ifndef AIOTE_TESTS_HARNESS_H
#define AIOTE_TESTS_HARNESS_H
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

extern int g_pass, g_fail;
extern char g_why[1024];
extern char g_self[4096]; /* this program, which a two-process test runs again as the peer */
extern uint64_t g_token;
extern int32_t g_watch_us; /* the next engines' watch interval (0: the default) */

void fail_msg(const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

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

/* byte k of pattern `seed`: position based, so any sub-range can be checked */
static inline uint8_t pat(uint64_t k, uint32_t seed) {
    uint32_t x = (uint32_t)k * 0x9E3779B1u + seed * 0x85EBCA77u + (uint32_t)(k >> 32);
    x ^= x >> 15;
    x *= 0x2C1B3C6Du;
    x ^= x >> 12;
    return (uint8_t)x;
}

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

typedef struct fix {
    const char *prov;
    const char *nic;
    const char *name;
    eng_t a, b;
    uint8_t *arena; /* b's arena (direct tests), set once: ARENA_LEN bytes of a memfd */
} fix_t;

typedef struct test {
    const char *name;
    int (*fn)(fix_t *);
} test_t;

typedef struct peer_info {
    uint32_t addr_len;
    uint8_t addr[AIO_MAX_ADDR];
    uint64_t base, key, len;
} peer_info;

#define ARENA_LEN (8 * MiB)
#define XP_LEN (4 * MiB)
#define XP_SEED 0xA11CE

/* harness.c */
void fail_msg(const char *file, int line, const char *fmt, ...);
double now_s(void);
void sleep_us(long us);
void fill(uint8_t *p, uint64_t n, uint64_t k0, uint32_t seed);
int64_t verify(const uint8_t *p, uint64_t n, uint64_t k0, uint32_t seed);
void eng_free(eng_t *x);
int eng_init_p(eng_t *x, const char *prov, const char *nic, uint64_t region_len, int nrails, int pollers);
int eng_init_n(eng_t *x, const char *prov, const char *nic, uint64_t region_len, int nrails);
int eng_init(eng_t *x, const char *prov, const char *nic, uint64_t region_len);
int pump(eng_t *x);
int count_rec(eng_t *x, int kind, uint64_t token);
int wait_rec(eng_t *x, int kind, uint64_t token, double timeout, aio_record *out);
int wait_take(eng_t *x, uint32_t imm, uint64_t units, double timeout);
int wait_total(eng_t *x, uint32_t imm, uint64_t units, double timeout);
int post_all(eng_t *x, int64_t g, const aio_op_desc *it, int64_t n, double timeout);
aio_op_desc op_at(eng_t *src, int op, uint64_t loff, uint64_t raddr, uint64_t rkey, uint64_t len, int flags, uint64_t data);
aio_op_desc op_to(eng_t *src, eng_t *dst, int op, uint64_t loff, uint64_t roff, uint64_t len, int flags, uint64_t data);
int group_record(eng_t *x, const aio_op_desc *it, int64_t n, aio_record *r);
int run_group(eng_t *x, const aio_op_desc *it, int64_t n, aio_record *rec);
/* Posts a paged write into one group (retrying while the queue is full) and waits for its
 * record (rec->a: the requests formed). */
int paged_group(eng_t *a, const aio_paged_desc *d, int64_t n, aio_record *rec);
int connect_pair(eng_t *a, eng_t *b);
aio_stats stats_of(aio_engine *e);

/* test_transfers.c, test_loop.c */
int t_write_sizes(fix_t *f);
int t_zero_byte_imm(fix_t *f);
int t_weight(fix_t *f);
int t_counters(fix_t *f);
int t_counter_release(fix_t *f);
int t_read(fix_t *f);
int t_sendrecv(fix_t *f);
int t_sendref(fix_t *f);
int t_sendparts(fix_t *f);
int t_batch10k(fix_t *f);
int t_group_race(fix_t *f);
int t_paged(fix_t *f);
int t_post_invalid(fix_t *f);
int t_mr_close_busy(fix_t *f);
int poll_fd(int fd, int timeout_ms);
int t_eventfd(fix_t *f);
int t_submit(fix_t *f);
int t_submit_quiet(fix_t *f);
int t_poll_ring(fix_t *f);
int t_remote_error(fix_t *f);
double cpu_s(void);
int t_idle(fix_t *f);
int t_idle_waiting(fix_t *f);
int t_spin_window(fix_t *f);
int t_register_dev(fix_t *f);

/* test_watch.c */
int t_watch(fix_t *f);
int t_watch_soon(fix_t *f);
int t_lane(fix_t *f);

/* test_processes.c */
int read_full(int fd, void *p, size_t n, int timeout_ms);
aio_op_desc op_remote(eng_t *src, const peer_info *pi, int op, uint64_t loff, uint64_t roff, uint64_t len, int flags, uint64_t data);
int peer_body(const char *prov, const char *nic, int rfd, int wfd);
int stall_peer_body(const char *prov, const char *nic, int rfd, int wfd);
pid_t spawn_peer(fix_t *f, const char *mode, int *to_child, int *from_child);
int reap_peer(pid_t pid, int to_child, int from_child, int *said_bye);
int t_two_process(fix_t *f);
int remote_error_direct(fix_t *f);
int t_direct(fix_t *f);
int t_direct_retire(fix_t *f);
int t_direct_strided(fix_t *f);

/* test_tuning.c */
int t_tcp_sndbuf(fix_t *f);
int t_handed(fix_t *f);
int t_handed_stall(fix_t *f);
int t_pollers(fix_t *f);
int t_ring_nomem(fix_t *f);
int t_recv_kick(fix_t *f);

/* test_core.c */
void report(const char *prov, const char *name, int rc, double dt);

#endif
