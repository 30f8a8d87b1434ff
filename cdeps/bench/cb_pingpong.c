/* aiote_cbench's latency runs: pingpong, msgpingpong.
 *
 * Theory of operation. Rank 0 (the pinger) sends one 8-byte message, waits for the answer,
 * and times the round trip; rank 1 answers each one. --warmup round trips (1000) come first,
 * untimed; then ITERS timed ones, whose one-way latency (RTT / 2) is reported as p50 / p99 /
 * mean / min / max in microseconds, with the round trip's p50 / p99, in one JSON line
 * (pingpong_report). Each side waits as aiote's event loop does (cb_side.c).
 *
 *   pingpong ITERS
 *       8-byte write-with-imm ping-pong; each side waits for its counter. --await-write:
 *       each side also waits for its write's completion before going on (as `await
 *       engine.write(...)`); --think-ns N: busy work after each wait (an application's);
 *       --loop-poll-ns N: wait as aiote's low-latency setting does.
 *   msgpingpong ITERS
 *       8-byte send/recv ping-pong (the core's message slots). */
#include "cbench.h"

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

/* The answering side's end: its last answers sent, then the pinger's word to stop. */
static void answerer_done(side_t *s, uint64_t total) {
    side_wait_groups(s, total);
    char bye;
    read_full(s->rfd, &bye, 1);
}

/* The pinger's room for the timed round trips. */
static int64_t *rtts_new(const opts_t *o) {
    int64_t *rtt = calloc(o->iters ? o->iters : 1, sizeof(int64_t));
    if (!rtt) die("out of memory");
    return rtt;
}

void run_pingpong(side_t *s, const opts_t *o, int rank) {
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
        answerer_done(s, total);
        return;
    }
    int64_t *rtt = rtts_new(o);
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

/* 8-byte send/recv ping-pong; rank 1 answers each message with one. */
void run_msgpingpong(side_t *s, const opts_t *o, int rank) {
    uint64_t total = o->warmup + o->iters;
    if (rank == 1) {
        for (uint64_t i = 0; i < total; i++) {
            side_wait_msgs(s, i + 1);
            side_send_blocking(s, i, 8);
        }
        answerer_done(s, total);
        return;
    }
    int64_t *rtt = rtts_new(o);
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
