/* The engine's side towards its event loop: the eventfd and the ring, submitting in one call
 * (quiet or not), the loop thread's own polling, remote errors as records, idle pollers and
 * their CPU, the adaptive spin window, device-memory registration. */
#include "harness.h"

int poll_fd(int fd, int timeout_ms) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int r;
    do r = poll(&p, 1, timeout_ms);
    while (r < 0 && errno == EINTR);
    return r > 0 && (p.revents & POLLIN);
}

int t_eventfd(fix_t *f) {
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
int t_submit(fix_t *f) {
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
int t_submit_quiet(fix_t *f) {
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
int t_poll_ring(fix_t *f) {
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

/* A write the target must refuse (wrong key): the target's bytes stay untouched and
 * no credit is counted; the initiator's group completes exactly once, with an error.
 * On shm the refusal is the region table's (aiote never lets shm's own copy move a
 * region's bytes: libfabric 1.17's shm checks no key), asserted in remote_error_direct;
 * on tcp the target's provider refuses it and the connection breaks (ECANCELED). */
int t_remote_error(fix_t *f) {
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

double cpu_s(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

int t_idle(fix_t *f) {
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
int t_idle_waiting(fix_t *f) {
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
int t_spin_window(fix_t *f) {
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

int t_register_dev(fix_t *f) {
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
