/* Plain C tests of the aiote core (cdeps/aiote_core.h), no framework.
 *
 * Every test runs on provider tcp (NIC "lo") and on shm, with two engines in this
 * process connected to each other; one test runs across two processes (fork + exec
 * of this binary with --peer, addresses and region descriptors exchanged over
 * pipes). One line per test, then "N passed, M failed"; the exit status is nonzero
 * when anything failed.
 *
 * Only the public header of the core is used (plus libfabric's error numbers). The harness is
 * harness.c (harness.h); the tests, one file per concern: test_transfers.c, test_loop.c,
 * test_watch.c, test_processes.c, test_tuning.c. This file lists them and runs them. */
#include "harness.h"

static const test_t TESTS[] = {
    {"write_sizes", t_write_sizes},   {"zero_byte_imm", t_zero_byte_imm},
    {"weight", t_weight},             {"counters", t_counters},
    {"counter_release", t_counter_release},
    {"read", t_read},                 {"sendrecv", t_sendrecv},
    {"sendparts", t_sendparts},       {"sendref", t_sendref},
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
    {"direct", t_direct},             {"direct_retire", t_direct_retire}, {"direct_strided", t_direct_strided},
    {"tcp_sndbuf", t_tcp_sndbuf},     {"handed", t_handed},
    {"handed_stall", t_handed_stall}, {"pollers", t_pollers},
    {"ring_nomem", t_ring_nomem},     {"recv_kick", t_recv_kick},
};

void report(const char *prov, const char *name, int rc, double dt) {
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
