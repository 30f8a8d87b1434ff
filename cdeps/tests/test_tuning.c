/* Tuning and load: tcp send buffers, requests handed to the poller (and a stalled peer),
 * several poller threads, the ring when memory runs out. */
#include "harness.h"

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

int t_tcp_sndbuf(fix_t *f) {
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
int t_handed(fix_t *f) {
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
int t_handed_stall(fix_t *f) {
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
        /* rail 0 holds the stopped peer's writes in flight: it is the loaded one of the two,
         * whichever the round robin would start at; rails out of range are refused */
        const int32_t both[2] = {0, 1}, bad[2] = {0, 7};
        if (aio_least_loaded(x.e, both, 2, 0) != 1 || aio_least_loaded(x.e, both, 2, 3) != 1 ||
            aio_least_loaded(x.e, both, 1, 0) != 0 || aio_least_loaded(x.e, bad, 2, 0) != -1 ||
            aio_least_loaded(x.e, both, 0, 0) != -1) {
            fail_msg(__FILE__, __LINE__, "aio_least_loaded with rail 0's writes stalled: %d %d %d %d %d",
                     aio_least_loaded(x.e, both, 2, 0), aio_least_loaded(x.e, both, 2, 3),
                     aio_least_loaded(x.e, both, 1, 0), aio_least_loaded(x.e, bad, 2, 0),
                     aio_least_loaded(x.e, both, 0, 0));
            break;
        }
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
        /* every write is over (landed or failed): no rail counts bytes in flight, so the round
         * robin's start decides */
        const int32_t rails2[2] = {0, 1};
        if (aio_least_loaded(x.e, rails2, 2, 0) != 0 || aio_least_loaded(x.e, rails2, 2, 1) != 1) {
            fail_msg(__FILE__, __LINE__, "bytes still counted in flight after every write ended: %d %d",
                     aio_least_loaded(x.e, rails2, 2, 0), aio_least_loaded(x.e, rails2, 2, 1));
            break;
        }
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
int t_pollers(fix_t *f) {
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
        /* the copy threads (copier.c): 1..AIO_COPY_THREADS_MAX, until the start */
        int c0 = aio_engine_set_copy_threads(late, 0), c9 = aio_engine_set_copy_threads(late, AIO_COPY_THREADS_MAX + 1);
        int c1 = aio_engine_set_copy_threads(late, 1), c8 = aio_engine_set_copy_threads(late, AIO_COPY_THREADS_MAX);
        aio_engine_destroy(late);
        if (bad0 != -FI_EINVAL || bad17 != -FI_EINVAL || rail < 0 || after != -FI_EINVAL) {
            fail_msg(__FILE__, __LINE__, "set_pollers: 0 -> %d, 17 -> %d, add_rail %d, after a rail %d",
                     bad0, bad17, rail, after);
            break;
        }
        if (c0 != -FI_EINVAL || c9 != -FI_EINVAL || c1 != 0 || c8 != 0) {
            fail_msg(__FILE__, __LINE__, "set_copy_threads: 0 -> %d, 9 -> %d, 1 -> %d, 8 -> %d", c0, c9, c1, c8);
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
int t_ring_nomem(fix_t *f) {
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

uint64_t aio_test_kicks(aio_engine *e, int q);
int32_t aio_test_msg_rail(aio_engine *e);

/* A task that starts to await a message kicks the poller of the rail the last message came in
 * on, and no other (kicking every poller kept pollers spinning that no message would come
 * through: on 2 vCPUs they took the CPUs the event loops needed). Two rails, two pollers. */
int t_recv_kick(fix_t *f) {
    if (strcmp(f->prov, "tcp")) {
        printf("    (tcp only)\n");
        return 0;
    }
    eng_t x, y;
    if (eng_init_p(&x, f->prov, f->nic, 0, 2, 2) || eng_init_p(&y, f->prov, f->nic, 0, 2, 2)) {
        eng_free(&x);
        eng_free(&y);
        return -1;
    }
    int rc = -1;
    do {
        aio_rail_info yi;
        uint64_t peer;
        if (aio_rail_get_info(y.e, 1, &yi) || aio_av_insert(x.e, 1, yi.addr, yi.addr_len, &peer)) {
            fail_msg(__FILE__, __LINE__, "rail 1 of the receiver not reachable");
            break;
        }
        int64_t g = aio_group_open(x.e, g_token++);
        const char msg[8] = "kick-me";
        if (g < 0 || aio_post_send(x.e, g, 1, peer, msg, sizeof(msg), 1000000000LL) != 1 ||
            aio_group_seal(x.e, g)) {
            fail_msg(__FILE__, __LINE__, "the message was not posted on rail 1");
            break;
        }
        aio_record r;
        if (wait_rec(&y, AIO_REC_RECV, ANY, TIMEOUT, &r) || r.rail != 1) {
            fail_msg(__FILE__, __LINE__, "no message on the receiver's rail 1 (rail %d)", (int)r.rail);
            break;
        }
        if (aio_recv_repost(y.e, 1, (uint32_t)r.a)) break;
        if (aio_test_msg_rail(y.e) != 1) {
            fail_msg(__FILE__, __LINE__, "last message's rail %d, want 1", aio_test_msg_rail(y.e));
            break;
        }
        uint64_t k0 = aio_test_kicks(y.e, 0), k1 = aio_test_kicks(y.e, 1);
        aio_waiters_add(y.e, 1);
        uint64_t d0 = aio_test_kicks(y.e, 0) - k0, d1 = aio_test_kicks(y.e, 1) - k1;
        aio_waiters_add(y.e, -1);
        if (d1 != 1 || d0 != 0) {
            fail_msg(__FILE__, __LINE__, "a message awaited kicked poller 0 %llu times and poller 1 "
                     "(rail 1's) %llu times, want 0 and 1", (unsigned long long)d0, (unsigned long long)d1);
            break;
        }
        rc = 0;
    } while (0);
    eng_free(&x);
    eng_free(&y);
    return rc;
}
