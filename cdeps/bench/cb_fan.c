/* aiote_cbench's fan run: several senders each writing to several receivers at once.
 *
 * Theory of operation. `fan SIZE WINDOW TOTAL_BYTES --senders S --receivers R` measures what
 * the C core moves in the pattern of a weight push (aiote.weights): S sending processes, R
 * receiving processes, every sender writing to every receiver at the same time. The first
 * process forks them all before any libfabric call and only coordinates, over pipes:
 *   1. each receiver opens its engine and region (room for every sender's writes) and hands
 *      its peer_info up; the coordinator passes all R of them to every sender;
 *   2. each sender opens its engine, inserts every receiver's rails, warms every (receiver,
 *      rail) pair up with one write, and reports ready;
 *   3. the coordinator picks a CLOCK_REALTIME instant 200 ms ahead and sends it to the
 *      senders, which start their timed part then: TOTAL_BYTES each, in SIZE writes carrying
 *      IMM_MAIN, request k to receiver (k + sender) % R (rotated, as a push's plan deals a
 *      sender's writes over its receivers), on rail (k / R) % --streams, at most WINDOW in
 *      flight per sender, posted in groups of --batch as the write run posts them;
 *   4. each receiver waits for every sender's share of credits and reports when it had
 *      them all; the coordinator prints one JSON line: all senders' bytes over the time from
 *      the instant to the last receiver's completion, and each receiver's own time.
 * A sender's and a receiver's engine are set up as the write run's (cb_side.c: side_init,
 * --streams, --pollers, --copy-threads, --arena); direct same-host copies are attached per
 * receiver where both sides offer them. */
#include "cbench.h"

#include <sys/wait.h>

#define MAX_FAN 16

typedef struct fan_peer {
    peer_info info;
    uint64_t fa[MAX_STREAMS]; /* the receiver's rails in the sender's address vectors */
    int32_t direct;           /* aio_op_desc.direct for writes to it (0: through the provider) */
} fan_peer;

/* What a sender's requests need: its receivers, its part of each one's region, its index. */
typedef struct fan_ctx {
    const opts_t *o;
    fan_peer *peers;
    uint64_t mine;
    int me;
} fan_ctx;

/* Request k to receiver (k + me) % R, on rail (k / R) % --streams, into this sender's part. */
static aio_op_desc fan_req(side_t *s, const void *ctx, uint64_t k, uint64_t off) {
    const fan_ctx *c = ctx;
    uint64_t nr = (uint64_t)c->o->receivers;
    const fan_peer *p = &c->peers[(k + (uint64_t)c->me) % nr];
    int rail = (int)((k / nr) % (uint64_t)s->nrails);
    return as_write(side_req_to(s, &p->info, p->fa, p->direct, rail, off, c->mine + off, c->o->size), IMM_MAIN);
}

/* A receiver: room for every sender's slots; reports its info, then when every credit came. */
static void fan_receiver(const opts_t *o, int rfd, int wfd, uint64_t n) {
    side_t s;
    memset(&s, 0, sizeof(s));
    s.rfd = rfd;
    s.wfd = wfd;
    side_init(&s, o, o->size * o->slots * (uint64_t)o->senders);
    peer_info mine = side_info(&s);
    write_full(wfd, &mine, sizeof(mine));
    side_wait_credit(&s, IMM_MAIN, n * (uint64_t)o->senders * U);
    int64_t t = realtime_ns();
    write_full(wfd, &t, sizeof(t));
    char bye;
    read_full(rfd, &bye, 1);
    side_free(&s);
}

/* Sender `me`: its share to every receiver, from the instant the coordinator sends. */
static void fan_sender(const opts_t *o, int rfd, int wfd, int me, uint64_t n) {
    side_t s;
    memset(&s, 0, sizeof(s));
    s.rfd = rfd;
    s.wfd = wfd;
    side_init(&s, o, o->size * o->slots);
    int nr = o->receivers;
    fan_peer peers[MAX_FAN];
    int direct_here = side_info(&s).direct_slot >= 0;
    for (int j = 0; j < nr; j++) {
        read_full(rfd, &peers[j].info, sizeof(peers[j].info));
        peers[j].direct = side_attach(&s, &peers[j].info, peers[j].fa, direct_here);
    }
    fan_ctx ctx = {o, peers, o->size * o->slots * (uint64_t)me, me}; /* mine: its part of each region */
    uint64_t warm = 0;
    for (int j = 0; j < nr; j++)
        for (int r = 0; r < s.nrails; r++, warm++) {
            aio_op_desc d = as_write(side_req_to(&s, &peers[j].info, peers[j].fa, peers[j].direct, r, 0,
                                                 ctx.mine, o->size), IMM_WARM);
            side_post_blocking(&s, 1ULL << 40 | warm, &d);
        }
    side_wait_groups(&s, warm);
    side_reset_counts(&s);
    char ready = 'r';
    write_full(wfd, &ready, 1);
    int64_t at;
    read_full(rfd, &at, sizeof(at));
    start_at(at);
    double c0 = cpu_s();
    run_requests(&s, o, n, fan_req, &ctx); /* as the write run posts: groups of --batch */
    int64_t t = realtime_ns();
    double cpu = cpu_s() - c0;
    write_full(wfd, &t, sizeof(t));
    write_full(wfd, &cpu, sizeof(cpu));
    char bye;
    read_full(rfd, &bye, 1);
    side_free(&s);
}

typedef struct child {
    pid_t pid;
    int rfd, wfd; /* the coordinator's ends */
} child;

static child spawn(const opts_t *o, int role, int index, uint64_t n) {
    int down[2], up[2];
    if (pipe(down) || pipe(up)) die("pipe: %s", strerror(errno));
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) die("fork: %s", strerror(errno));
    if (pid == 0) {
        close(down[1]);
        close(up[0]);
        g_role = role ? "sender" : "receiver";
        if (role) fan_sender(o, down[0], up[1], index, n);
        else fan_receiver(o, down[0], up[1], n / (uint64_t)o->receivers);
        _exit(0);
    }
    close(down[0]);
    close(up[1]);
    return (child){pid, up[0], down[1]};
}

int run_fan(const opts_t *o) {
    int ns = o->senders, nr = o->receivers;
    if (ns < 1 || nr < 1 || ns > MAX_FAN || nr > MAX_FAN) die("--senders and --receivers: 1 to %d", MAX_FAN);
    uint64_t n = o->total / o->size; /* per sender: whole rounds over the receivers, whole groups */
    n -= n % ((uint64_t)nr * o->batch);
    if (n == 0) die("TOTAL_BYTES is less than one write per receiver");
    child rx[MAX_FAN], tx[MAX_FAN];
    for (int j = 0; j < nr; j++) rx[j] = spawn(o, 0, j, n);
    for (int i = 0; i < ns; i++) tx[i] = spawn(o, 1, i, n);
    peer_info info[MAX_FAN];
    for (int j = 0; j < nr; j++) read_full(rx[j].rfd, &info[j], sizeof(info[j]));
    for (int i = 0; i < ns; i++)
        for (int j = 0; j < nr; j++) write_full(tx[i].wfd, &info[j], sizeof(info[j]));
    for (int i = 0; i < ns; i++) {
        char ready;
        read_full(tx[i].rfd, &ready, 1);
    }
    int64_t at = realtime_ns() + 200000000LL;
    for (int i = 0; i < ns; i++) write_full(tx[i].wfd, &at, sizeof(at));
    int64_t t_rx[MAX_FAN], t_tx[MAX_FAN], last = at;
    double cpu_tx = 0;
    for (int j = 0; j < nr; j++) {
        read_full(rx[j].rfd, &t_rx[j], sizeof(t_rx[j]));
        if (t_rx[j] > last) last = t_rx[j];
    }
    for (int i = 0; i < ns; i++) {
        double c;
        read_full(tx[i].rfd, &t_tx[i], sizeof(t_tx[i]));
        read_full(tx[i].rfd, &c, sizeof(c));
        cpu_tx += c;
    }
    char bye = 'x';
    for (int i = 0; i < ns; i++) write_full(tx[i].wfd, &bye, 1);
    for (int j = 0; j < nr; j++) write_full(rx[j].wfd, &bye, 1);
    int bad = 0;
    for (int i = 0; i < ns; i++) bad |= wait_peer(tx[i].pid);
    for (int j = 0; j < nr; j++) bad |= wait_peer(rx[j].pid);
    double bytes = (double)n * (double)o->size * ns, secs = (double)(last - at) * 1e-9;
    printf("{\"mode\":\"fan\",\"provider\":\"%s\",\"nic\":\"%s\",\"size\":%llu,\"window\":%llu,"
           "\"senders\":%d,\"receivers\":%d,\"writes_per_sender\":%llu,\"total_bytes\":%.0f,"
           "\"gbps\":%.3f,\"seconds\":%.6f,\"senders_cpu_s\":%.3f,\"streams\":%d,\"receiver_seconds\":[",
           o->provider, o->nic ? o->nic : "", (unsigned long long)o->size,
           (unsigned long long)o->window, ns, nr, (unsigned long long)n, bytes, bytes / secs / 1e9,
           secs, cpu_tx, o->streams);
    for (int j = 0; j < nr; j++) printf("%s%.6f", j ? "," : "", (double)(t_rx[j] - at) * 1e-9);
    printf("],\"sender_seconds\":[");
    for (int i = 0; i < ns; i++) printf("%s%.6f", i ? "," : "", (double)(t_tx[i] - at) * 1e-9);
    printf("]}\n");
    return bad;
}
