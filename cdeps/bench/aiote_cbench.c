/* aiote_cbench: the C baseline of the aiote core, without Python.
 *
 * Theory of operation. One run of one mode between two processes, each with its own engine on
 * the core, driven as aiote's Engine and event-loop bridge drive it (cb_side.c). By default
 * the program forks its peer before any libfabric call: the parent (rank 0) posts and reports,
 * the child (rank 1) is the other side. The two exchange their rail addresses and region
 * descriptors over pipes, which then carry the run's few control bytes and reports (cb_util.c).
 * --listen / --connect run the two sides as separate processes, possibly on two hosts: the
 * exchange goes over that TCP connection, the transfers over libfabric. cbench.h lists the
 * files; this one reads the command line and starts the run.
 *
 *   write SIZE WINDOW TOTAL_BYTES     one-sided writes with immediate data  (cb_modes.c)
 *   read SIZE WINDOW TOTAL_BYTES      one-sided READs                       (cb_modes.c)
 *   paged PAGE_SIZE NPAGES CALLS      paged writes, one call in flight      (cb_modes.c)
 *   sendrecv SIZE WINDOW TOTAL_BYTES  two-sided messages                    (cb_modes.c)
 *   pingpong ITERS                    8-byte write-with-imm ping-pong       (cb_pingpong.c)
 *   msgpingpong ITERS                 8-byte send/recv ping-pong            (cb_pingpong.c)
 *   sockets SIZE WINDOW TOTAL_BYTES   bare TCP, no libfabric                (cb_sockets.c)
 *   fan SIZE WINDOW TOTAL_BYTES       --senders S processes each writing TOTAL_BYTES to
 *                                     --receivers R processes at once       (cb_fan.c)
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
 *          i % N; default one thread), --copy-threads N (aio_engine_set_copy_threads:
 *          threads that make one large arena copy; default the core's, 2),
 *          --slots N (buffer slots the writes cycle through; WINDOW by default,
 *          1 = one cache-hot slot), --warmup N (pingpong warm-up round trips, 1000),
 *          --msg-slots N (message slots per side: sendrecv, msgpingpong; 16),
 *          --copy-out (sendrecv, msgpingpong: the receiver copies each message out of its
 *          slot into a fresh allocation before reposting it, as Engine.recv does),
 *          --listen PORT (no fork: serve as the peer of one run on this TCP port, 0 = any;
 *          prints {"listening":PORT} first), --connect HOST:PORT (no fork: run against a
 *          --listen peer, possibly on another host; the addresses and region descriptors
 *          are exchanged over that socket, the transfers go over libfabric);
 *          --start-at NS (write: after its warm-up the run waits until this CLOCK_REALTIME
 *          time, ns since the epoch, to start its timed part: several runs started together
 *          measure what they move at once; the JSON's start_late_us says how late it began),
 *          and the modes' own: --batch N (write, read), --no-gather (paged), --await-write,
 *          --think-ns N, --loop-poll-ns N (pingpong): see cb_modes.c and cb_pingpong.c.
 *
 * Output: one JSON object per line on stdout; diagnostics on stderr. */
#include "cbench.h"

static void usage(void) {
    fprintf(stderr,
            "usage: aiote_cbench write SIZE WINDOW TOTAL_BYTES [options]\n"
            "       aiote_cbench pingpong ITERS [options]\n"
            "       aiote_cbench paged PAGE_SIZE NPAGES CALLS [options]\n"
            "       aiote_cbench read SIZE WINDOW TOTAL_BYTES [options]\n"
            "       aiote_cbench sendrecv SIZE WINDOW TOTAL_BYTES [options]\n"
            "       aiote_cbench msgpingpong ITERS [options]\n"
            "       aiote_cbench sockets SIZE WINDOW TOTAL_BYTES [options] (bare TCP, no libfabric)\n"
            "       aiote_cbench fan SIZE WINDOW TOTAL_BYTES --senders S --receivers R [options]\n"
            "options: --provider tcp|shm  --nic NAME  --spin-ns N  --busy-spin-ns N  --busy\n"
            "         --slots N  --warmup N  --no-gather (paged)  --msg-slots N\n"
            "         --batch N (write, read: N requests per group and aio_post call)\n"
            "         --small-pages (4 KiB pages; default: huge pages from 4 MiB, as NumPy)\n"
            "         --no-direct (shm: READs through the provider, not direct copies)\n"
            "         --copy-out (sendrecv: each message copied out of its slot, as recv does)\n"
            "         --in-place (sendrecv: each message over 16 KiB sent from its buffer, not copied into a send slot)\n"
            "         --arena (shm: the region in a published arena; peers memcpy into it)\n"
            "         --sndbuf N (tcp: same-host send buffers, 0 = the kernel's autotuning)\n"
            "         --hand N (posts handed to the poller: 0 when busy (default), 1 always, -1 never)\n"
            "         --streams N (write, read: N rails on the NIC, request k on rail k %% N)\n"
            "         --pollers N (poller threads, rail i on thread i %% N; default 1)\n"
            "         --copy-threads N (threads that make one large arena copy; default 2)\n"
            "         --listen PORT | --connect HOST:PORT (two hosts: no fork)\n"
            "         --await-write --loop-poll-ns N --think-ns N (pingpong)\n"
            "         --start-at NS (write: the timed part at this CLOCK_REALTIME time)\n"
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
        else if (!strcmp(a, "--start-at") && i + 1 < argc) o.start_at_ns = (int64_t)parse_size(argv[++i]);
        else if (!strcmp(a, "--loop-poll-ns") && i + 1 < argc) o.loop_poll_ns = parse_size(argv[++i]);
        else if (!strcmp(a, "--slots") && i + 1 < argc) o.slots = parse_size(argv[++i]);
        else if (!strcmp(a, "--batch") && i + 1 < argc) o.batch = parse_size(argv[++i]);
        else if (!strcmp(a, "--small-pages")) o.small_pages = 1;
        else if (!strcmp(a, "--arena")) o.arena = 1;
        else if (!strcmp(a, "--no-direct")) o.no_direct = 1;
        else if (!strcmp(a, "--copy-out")) o.copy_out = 1;
        else if (!strcmp(a, "--in-place")) o.in_place = 1;
        else if (!strcmp(a, "--sndbuf") && i + 1 < argc) {
            uint64_t v = parse_size(argv[++i]);
            if (v > INT32_MAX / 2) usage(); /* the kernel doubles it into an int */
            o.sndbuf = (int64_t)v;
        }
        else if (!strcmp(a, "--hand") && i + 1 < argc) o.hand = atoi(argv[++i]);
        else if (!strcmp(a, "--copy-threads") && i + 1 < argc) o.copy_threads = atoi(argv[++i]);
        else if (!strcmp(a, "--streams") && i + 1 < argc) o.streams = atoi(argv[++i]);
        else if (!strcmp(a, "--pollers") && i + 1 < argc) o.pollers = atoi(argv[++i]);
        else if (!strcmp(a, "--warmup") && i + 1 < argc) o.warmup = parse_size(argv[++i]);
        else if (!strcmp(a, "--msg-slots") && i + 1 < argc) o.msg_slots = parse_size(argv[++i]);
        else if (!strcmp(a, "--listen") && i + 1 < argc) o.listen_port = (int)parse_size(argv[++i]);
        else if (!strcmp(a, "--connect") && i + 1 < argc) o.connect = argv[++i];
        else if (!strcmp(a, "--senders") && i + 1 < argc) o.senders = atoi(argv[++i]);
        else if (!strcmp(a, "--receivers") && i + 1 < argc) o.receivers = atoi(argv[++i]);
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
    int sockets = !strcmp(o.mode, "sockets"), fan = !strcmp(o.mode, "fan");
    if (!strcmp(o.mode, "write") || !strcmp(o.mode, "read") || !strcmp(o.mode, "sendrecv") || sockets ||
        fan) {
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
    if (fan) {
        if (o.listen_port >= 0 || o.connect) usage();
        return run_fan(&o);
    }
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

