/* Two processes: this program run again as the peer (pipes carry addresses and descriptors),
 * and direct same-host copies into and out of a peer's regions and arena. */
#include "harness.h"

/* ------------------------------------------------------------------ two processes */



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

int read_full(int fd, void *p, size_t n, int timeout_ms) {
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

aio_op_desc op_remote(eng_t *src, const peer_info *pi, int op, uint64_t loff, uint64_t roff, uint64_t len,
                      int flags, uint64_t data) {
    return op_at(src, op, loff, pi->base + roff, pi->key, len, flags, data);
}


/* the child: --peer PROV NIC RFD WFD */
int peer_body(const char *prov, const char *nic, int rfd, int wfd) {
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
int stall_peer_body(const char *prov, const char *nic, int rfd, int wfd) {
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

/* Starts this program again as a peer process (`mode`: --peer or --stall-peer) for f's
 * provider, connected by two pipes: *to_child (write end) and *from_child (read end). */
pid_t spawn_peer(fix_t *f, const char *mode, int *to_child, int *from_child) {
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
int reap_peer(pid_t pid, int to_child, int from_child, int *said_bye) {
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

int t_two_process(fix_t *f) {
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

/* Opens a direct-copy test on shm (elsewhere it is skipped: *skip = 1, returns 0): what
 * direct_setup returns. */
static int direct_open(fix_t *f, direct_fix *x, uint64_t len, int *skip) {
    *skip = strcmp(f->prov, "shm") != 0;
    if (*skip) {
        printf("    (shm only)\n");
        return 0;
    }
    return direct_setup(f, x, len);
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
int remote_error_direct(fix_t *f) {
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

int t_direct(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    direct_fix x;
    int skip = 0;
    int rc = direct_open(f, &x, 4 * MiB, &skip);
    if (skip || rc) return rc;
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

/* Paged writes to a direct route, into the arena (memcpy) and outside it (process_vm_writev):
 * pages with adjacent destinations and evenly spaced sources go as one strided copy (more
 * than the 512 pieces of one system call), sources a page apart as one plain copy, a break in
 * the spacing starts a new copy; every page where it belongs, nothing beside the range
 * touched, one credit unit per page. A strided run is never formed over gather = 0. */
int t_direct_strided(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    direct_fix x;
    int skip = 0;
    int rc = direct_open(f, &x, 4 * MiB, &skip);
    if (skip || rc) return rc;
    enum { NP = 700, PS = 1000, DOFF = 5 };
    static int64_t sp[NP], dp[NP];
    void *q = NULL;
    CHECK(posix_memalign(&q, 4096, MiB) == 0, "oom");
    aio_mr *plain = NULL;
    char err[512];
    CHECK_OK(aio_mr_register(b->e, q, MiB, AIO_ACCESS_REMOTE_WRITE, &plain, err, sizeof(err)));
    struct { aio_mr *mr; uint8_t *buf; int mapped; } tg[2] = {{x.mr, x.buf, 1}, {plain, q, 0}};
    /* source spacing (in pages) per case; case 2 breaks it at page 400; case 3 is case 0 with
     * gather off: one request per page */
    const int64_t spacing[4] = {3, 1, 3, 3};
    const uint64_t want_ops[4] = {1, 1, 3, NP};
    uint32_t imm = 0x6500;
    for (int t = 0; t < 2; t++) {
        for (int c = 0; c < 4; c++, imm++) {
            for (int k = 0; k < NP; k++) {
                sp[k] = spacing[c] * k;
                dp[k] = k;
            }
            if (c == 2) sp[400] = 0;
            fill(a->buf, 3 * NP * PS + 64, 0, 0xa00 + (uint32_t)(t * 4 + c));
            memset(tg[t].buf, 0xEE, NP * PS + 2 * DOFF);
            aio_paged_desc d = {.mr = a->mr, .src_pages = sp, .dst_pages = dp, .page_size = PS,
                                .src_stride = PS, .dst_stride = PS, .src_offset = 64, .dst_offset = DOFF,
                                .remote_len = tg[t].mr == plain ? MiB : x.len, .data = imm,
                                .flags = AIO_F_DATA, .gather = c != 3, .nroutes = 1};
            d.routes[0].rail = a->rail;
            d.routes[0].peer = a->peer;
            d.routes[0].rbase = aio_mr_remote_base(tg[t].mr, b->rail);
            d.routes[0].rkey = aio_mr_key(tg[t].mr, b->rail);
            d.routes[0].direct = AIO_DIRECT(x.attach, aio_mr_direct_slot(tg[t].mr));
            aio_stats s0, s1;
            aio_get_stats(a->e, &s0);
            aio_record rec;
            rc = paged_group(a, &d, NP, &rec);
            if (rc) return rc;
            CHECK(rec.status == 0, "case %d/%d: status %d", t, c, rec.status);
            CHECK(rec.a == want_ops[c], "case %d/%d: %llu requests, want %llu", t, c, (unsigned long long)rec.a,
                  (unsigned long long)want_ops[c]);
            CHECK(wait_take(b, imm, (uint64_t)NP * U, TIMEOUT) == 0, "case %d/%d: credits", t, c);
            aio_get_stats(a->e, &s1);
            CHECK(s1.direct_ops - s0.direct_ops == want_ops[c], "case %d/%d: %llu direct copies", t, c,
                  (unsigned long long)(s1.direct_ops - s0.direct_ops));
            uint64_t mapped = s1.direct_mapped - s0.direct_mapped;
            CHECK(tg[t].mapped ? mapped == want_ops[c] : mapped == 0, "case %d/%d: %llu mapped", t, c,
                  (unsigned long long)mapped);
            for (int k = 0; k < NP; k++)
                CHECK(memcmp(a->buf + 64 + (uint64_t)sp[k] * PS, tg[t].buf + DOFF + (uint64_t)k * PS, PS) == 0,
                      "case %d/%d: page %d differs", t, c, k);
            for (int i = 0; i < DOFF; i++)
                CHECK(tg[t].buf[i] == 0xEE && tg[t].buf[DOFF + NP * PS + i] == 0xEE,
                      "case %d/%d: a byte beside the pages changed", t, c);
        }
    }
    sleep_us(20000);
    for (uint32_t i = 0x6500; i < imm; i++) CHECK(aio_counter_available(b->e, i) == 0, "extra credits");
    CHECK_OK(aio_mr_close(b->e, plain));
    free(q);
    CHECK(aio_mr_inflight(a->mr) == 0, "inflight");
    CHECK_OK(aio_mr_close(b->e, x.mr));
    return 0;
}

/* Closing a region waits for copies under way: a live engine's mark keeps the region open
 * (and new copies out), a mark of a process that died is cleared. */
int t_direct_retire(fix_t *f) {
    eng_t *a = &f->a;
    direct_fix x;
    int skip = 0;
    int rc = direct_open(f, &x, MiB, &skip);
    if (skip || rc) return rc;
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
