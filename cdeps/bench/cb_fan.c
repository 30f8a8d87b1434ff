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

static int64_t realtime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void attach(side_t *s, fan_peer *p, int direct_here) {
    if (p->info.nrails != s->nrails) die("--streams: %d here, %d at a receiver", s->nrails, p->info.nrails);
    for (int i = 0; i < s->nrails; i++) {
        peer_rail *pr = &p->info.rail[i];
        int ret = aio_av_insert(s->e, i, pr->addr, pr->addr_len, &p->fa[i]);
        if (ret) die("aio_av_insert: %s", aio_strerror(ret));
    }
    p->direct = 0;
    if (direct_here && p->info.direct_slot >= 0) {
        char err[512] = "";
        int at = aio_direct_attach(s->e, &p->info.direct, err, sizeof(err));
        if (at >= 0) p->direct = AIO_DIRECT(at, p->info.direct_slot);
        else fprintf(stderr, "direct copies unavailable (%s %s)\n", aio_strerror(at), err);
    }
}

static aio_op_desc fan_write(side_t *s, const fan_peer *p, uint64_t k, uint64_t loff, uint64_t roff,
                             uint64_t len, uint32_t imm, int nrecv) {
    aio_op_desc d;
    memset(&d, 0, sizeof(d));
    int rail = (int)((k / (uint64_t)nrecv) % (uint64_t)s->nrails);
    d.mr = s->mr;
    d.offset = loff;
    d.length = len;
    d.rail = rail;
    d.peer = p->fa[rail];
    d.raddr = p->info.rail[rail].base + roff;
    d.rkey = p->info.rail[rail].key;
    d.direct = p->direct;
    d.data = imm;
    d.op = AIO_OP_WRITE;
    d.flags = AIO_F_DATA;
    return d;
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
    int direct_here = aio_direct_info_get(s.e, &(aio_direct_info){0}) == 0;
    for (int j = 0; j < nr; j++) {
        read_full(rfd, &peers[j].info, sizeof(peers[j].info));
        attach(&s, &peers[j], direct_here);
    }
    uint64_t mine = o->size * o->slots * (uint64_t)me; /* this sender's part of each region */
    uint64_t warm = 0;
    for (int j = 0; j < nr; j++)
        for (int r = 0; r < s.nrails; r++, warm++) {
            aio_op_desc d = fan_write(&s, &peers[j], (uint64_t)(r * nr), 0, mine, o->size, IMM_WARM, nr);
            side_post_blocking(&s, 1ULL << 40 | warm, &d);
        }
    side_wait_groups(&s, warm);
    side_reset_counts(&s);
    char ready = 'r';
    write_full(wfd, &ready, 1);
    int64_t at;
    read_full(rfd, &at, sizeof(at));
    while (realtime_ns() < at) {
        struct timespec until = {.tv_sec = at / 1000000000LL, .tv_nsec = at % 1000000000LL};
        clock_nanosleep(CLOCK_REALTIME, TIMER_ABSTIME, &until, NULL);
    }
    double c0 = cpu_s();
    uint64_t b = o->batch, ngroups = n / b, gmax = o->window / b, posted = 0, in_group = 0;
    aio_op_desc d[MAX_BATCH];
    int64_t g = -1;
    while (s.groups_done < ngroups) { /* as run_window: groups of --batch, one aio_post each */
        int progressed = 0;
        while (posted < ngroups && posted - s.groups_done < gmax) {
            for (uint64_t k = in_group; k < b; k++) {
                uint64_t req = posted * b + k, off = (req % o->slots) * o->size;
                const fan_peer *p = &peers[(req + (uint64_t)me) % (uint64_t)nr];
                d[k] = fan_write(&s, p, req, off, mine + off, o->size, IMM_MAIN, nr);
            }
            uint64_t before = in_group;
            int sealed = side_post_n(&s, &g, &in_group, b, posted, d + in_group, 0);
            if (sealed || in_group != before) progressed = 1;
            if (!sealed) break;
            posted++;
        }
        if (side_drain(&s, 0, NULL) == 0 && !progressed) side_idle(&s);
    }
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
