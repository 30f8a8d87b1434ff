/* aiote_cbench's side of a run: one process's engine on the core, as aiote's Engine drives it.
 *
 * Theory of operation. Each process builds one engine (side_init) as aiote's Engine builds
 * its own: the same configuration (ring, spins, sleep), --streams rails on one provider and
 * NIC (message slots sized for the message modes), same-host direct copies on shm (unless
 * --no-direct), and one region registered for remote writes and reads: memory allocated as
 * NumPy allocates an array (region_alloc: huge pages from 4 MiB), or an arena the side
 * publishes (--arena, as Engine.alloc_host), touched before any timing. side_exchange swaps
 * the two sides' rail addresses and region descriptors (peer_info) over the control channel,
 * inserts the peer's addresses and attaches to its region table where both take direct
 * copies.
 *
 * Waiting follows aiote's event-loop bridge: drain the completion ring (side_drain: group
 * records count completions, counter records end a watch, received messages are counted and
 * their slot reposted at once), and when nothing came, arm and sleep on the engine's eventfd
 * (side_idle), or spin (--busy), or first wait in aio_poll_ring (--loop-poll-ns). Credits are
 * taken at once when there, else awaited through one counter watch (side_wait_credit).
 *
 * Requests: request k of a run goes on rail k % --streams (side_route); side_write and
 * side_read build its descriptor. Posting is by groups, as aiote posts a batch: side_post_n
 * puts requests into an open group until all of it is in, then seals it (a full queue leaves
 * the group open for the next try), and times each aio_post call. Messages go from the core's
 * send slots, one per group (side_send_one). The *_blocking forms retry until the request is
 * in (the first requests wait for the connection), for at most 30 s. */
#include "cbench.h"

#include <poll.h>
#include <sys/mman.h>

#include <rdma/fi_errno.h>

/* A benchmark region as NumPy allocates the arrays aiote's benches register: 4 MiB or more
 * asks for transparent huge pages (MADV_HUGEPAGE; granted where THP is "madvise" or
 * "always"), unless small_pages. */
uint8_t *region_alloc(uint64_t region, int small_pages) {
    int huge = region >= (4ULL << 20) && !small_pages;
    void *b = NULL;
    if (posix_memalign(&b, huge ? (2ULL << 20) : 4096, region))
        die("out of memory for %llu bytes", (unsigned long long)region);
    if (huge) (void)madvise(b, region, MADV_HUGEPAGE); /* a hint: refused is fine */
    return b;
}

/* Writes every 64th byte: first touch, before timing. */
void region_touch(uint8_t *b, uint64_t region) {
    for (uint64_t i = 0; i < region; i += 64) b[i] = (uint8_t)(i >> 6);
}

void side_init(side_t *s, const opts_t *o, uint64_t region) {
    char err[512] = "";
    aio_engine_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.ring_capacity = 8192;
    cfg.spin_ns = o->spin_ns;
    cfg.busy_spin_ns = o->busy_spin_ns;
    cfg.sleep_ms = 100;
    int ret = aio_engine_create(&cfg, &s->e, err, sizeof(err));
    if (ret) die("aio_engine_create: %s %s", aio_strerror(ret), err);
    if (o->hand && (ret = aio_engine_set_hand_posts(s->e, o->hand)))
        die("--hand %d: %s", o->hand, aio_strerror(ret));
    if (o->sndbuf >= 0 && (ret = aio_engine_set_tcp_sndbuf(s->e, (int32_t)o->sndbuf, 0)))
        die("aio_engine_set_tcp_sndbuf: %s", aio_strerror(ret));
    if (o->pollers && (ret = aio_engine_set_pollers(s->e, o->pollers)))
        die("--pollers %d: %s", o->pollers, aio_strerror(ret));
    if (o->copy_threads && (ret = aio_engine_set_copy_threads(s->e, o->copy_threads)))
        die("--copy-threads %d: %s", o->copy_threads, aio_strerror(ret));
    uint64_t slot_size = 4096;
    uint32_t nslots = 16;
    if (!strcmp(o->mode, "sendrecv") || !strcmp(o->mode, "msgpingpong")) {
        nslots = (uint32_t)o->msg_slots;
        if (o->size > slot_size) slot_size = o->size;
    }
    s->nrails = o->streams;
    for (int i = 0; i < s->nrails; i++) {
        ret = aio_engine_add_rail(s->e, o->provider, o->nic, nslots, slot_size, err, sizeof(err));
        if (ret < 0) die("aio_engine_add_rail: %s %s", aio_strerror(ret), err);
        if (ret != i) die("aio_engine_add_rail: rail %d, expected %d", ret, i);
    }
    s->rail = 0;
    if (!strcmp(o->provider, "shm") && !o->no_direct &&
        (ret = aio_engine_enable_direct(s->e, err, sizeof(err))))
        die("aio_engine_enable_direct: %s %s", aio_strerror(ret), err);
    if ((ret = aio_engine_start(s->e))) die("aio_engine_start: %s", aio_strerror(ret));
    s->efd = aio_engine_eventfd(s->e);
    s->busy = o->busy;
    s->copy_out = o->copy_out;
    s->in_place = o->in_place;
    s->loop_poll_ns = o->loop_poll_ns;
    /* region_alloc: huge pages as NumPy's arrays get them. The page size weighs on shm, whose
     * CMA copies pin the pages they touch one by one: with 4 KiB pages this core measured
     * about half of what the same code does on NumPy arrays. --small-pages: 4 KiB pages. */
    void *b = NULL;
    uint64_t alen = o->arena ? (region + 4095) & ~4095ULL : 0;
    if (alen) { /* as Engine.alloc_host: a memfd this process maps and publishes */
        int afd = memfd_create("aiote-arena", MFD_CLOEXEC);
        if (afd < 0 || ftruncate(afd, (off_t)alen) != 0) die("arena memfd: %s", strerror(errno));
        b = mmap(NULL, alen, PROT_READ | PROT_WRITE, MAP_SHARED, afd, 0);
        if (b == MAP_FAILED) die("arena mmap: %s", strerror(errno));
        if (!strcmp(o->provider, "shm") && !o->no_direct &&
            (ret = aio_engine_set_arena(s->e, afd, b, alen, err, sizeof(err))))
            die("aio_engine_set_arena: %s %s", aio_strerror(ret), err);
        close(afd); /* the core keeps its own; the mapping stays for the run */
    } else {
        b = region_alloc(region, o->small_pages);
    }
    s->buf = b;
    s->len = region;
    s->arena_len = alen;
    region_touch(s->buf, region);
    ret = aio_mr_register(s->e, s->buf, region, AIO_ACCESS_REMOTE_WRITE | AIO_ACCESS_REMOTE_READ,
                          &s->mr, err, sizeof(err));
    if (ret) die("aio_mr_register: %s %s", aio_strerror(ret), err);
}

/* What a peer needs of this side: its rails' addresses, its region's base and key on each,
 * and its direct-copy table where it has one. */
peer_info side_info(side_t *s) {
    peer_info mine;
    memset(&mine, 0, sizeof(mine));
    mine.nrails = s->nrails;
    for (int i = 0; i < s->nrails; i++) {
        aio_rail_info ri;
        aio_rail_get_info(s->e, i, &ri);
        mine.rail[i].addr_len = ri.addr_len;
        memcpy(mine.rail[i].addr, ri.addr, ri.addr_len);
        mine.rail[i].base = aio_mr_remote_base(s->mr, i);
        mine.rail[i].key = aio_mr_key(s->mr, i);
    }
    mine.len = s->len;
    mine.direct_slot = -1;
    if (aio_direct_info_get(s->e, &mine.direct) == 0) mine.direct_slot = aio_mr_direct_slot(s->mr);
    return mine;
}

/* Inserts the peer `p`'s rails into this side's address vectors (fa[i]: its rail i) and, where
 * this side takes direct copies too (direct_here), attaches its direct-copy table. Returns the
 * aio_op_desc.direct of requests to it (0: through the provider). */
int32_t side_attach(side_t *s, const peer_info *p, uint64_t *fa, int direct_here) {
    if (p->nrails != s->nrails) die("--streams: %d here, %d at the peer", s->nrails, p->nrails);
    for (int i = 0; i < s->nrails; i++) {
        const peer_rail *pr = &p->rail[i];
        int ret = aio_av_insert(s->e, i, pr->addr, pr->addr_len, &fa[i]);
        if (ret) die("aio_av_insert: %s", aio_strerror(ret));
    }
    if (!direct_here || p->direct_slot < 0) return 0; /* both sides take direct copies, or neither */
    char err[512] = "";
    int at = aio_direct_attach(s->e, &p->direct, err, sizeof(err));
    if (at >= 0) return AIO_DIRECT(at, p->direct_slot);
    fprintf(stderr, "direct copies unavailable (%s %s): requests go through the provider\n",
            aio_strerror(at), err);
    return 0;
}

/* both sides write first, then read: a pipe holds far more than one peer_info */
void side_exchange(side_t *s) {
    peer_info mine = side_info(s);
    write_full(s->wfd, &mine, sizeof(mine));
    read_full(s->rfd, &s->remote, sizeof(s->remote));
    s->direct = side_attach(s, &s->remote, s->peers, mine.direct_slot >= 0);
    s->peer = s->peers[0];
}

void side_free(side_t *s) {
    int ret;
    int64_t t0 = now_ns();
    while ((ret = aio_mr_close(s->e, s->mr)) == -FI_EBUSY) {
        if (now_ns() - t0 > 10000000000LL) break;
        usleep(100);
    }
    aio_engine_destroy(s->e);
    if (s->arena_len) munmap(s->buf, s->arena_len);
    else free(s->buf);
}

/* Handles the records of one drain; returns how many there were. A counter record
 * for `imm` sets *hit. */
int side_drain(side_t *s, uint32_t imm, int *hit) {
    aio_record rec[NREC];
    int n = aio_drain(s->e, rec, NREC);
    for (int i = 0; i < n; i++) {
        if (rec[i].kind == AIO_REC_GROUP) {
            if (rec[i].status)
                die("a group failed: %s (prov_errno %d)", aio_strerror(rec[i].status),
                    rec[i].prov_errno);
            s->groups_done++;
        } else if (rec[i].kind == AIO_REC_COUNTER) {
            if (hit && rec[i].token == imm) *hit = 1;
        } else if (rec[i].kind == AIO_REC_RECV) {
            if (rec[i].status)
                die("a receive failed: %s (prov_errno %d)", aio_strerror(rec[i].status),
                    rec[i].prov_errno);
            s->msgs++;
            s->msg_bytes += rec[i].b;
            if (s->copy_out && rec[i].b) {
                const uint8_t *slot = aio_recv_slot(s->e, rec[i].rail, (uint32_t)rec[i].a);
                uint8_t *copy = malloc(rec[i].b);
                if (!slot || !copy) die("no message copy");
                memcpy(copy, slot, rec[i].b);
                s->copy_sum += copy[rec[i].b - 1];
                s->copied += rec[i].b;
                free(copy);
            }
            int r = aio_recv_repost(s->e, rec[i].rail, (uint32_t)rec[i].a);
            if (r) die("aio_recv_repost: %s", aio_strerror(r));
        }
    }
    return n;
}

/* Nothing was ready: sleep on the eventfd (the event-loop protocol) or spin. */
void side_idle(side_t *s) {
    if (s->busy) return;
    if (s->loop_poll_ns > 0 && aio_poll_ring(s->e, s->loop_poll_ns)) return;
    if (aio_arm(s->e)) return; /* records arrived meanwhile: drain again */
    struct pollfd p = {.fd = s->efd, .events = POLLIN};
    s->polls++;
    int r = poll(&p, 1, 1000);
    if (r > 0) {
        s->wakeups++;
        aio_clear_eventfd(s->e);
    }
}

/* Waits until `n` groups of this side have completed. */
void side_wait_groups(side_t *s, uint64_t n) {
    while (s->groups_done < n)
        if (side_drain(s, 0, NULL) == 0) side_idle(s);
}

/* Waits until `units` of counter `imm` can be taken, and takes them. */
void side_wait_credit(side_t *s, uint32_t imm, uint64_t units) {
    if (aio_counter_take(s->e, imm, units)) return;
    if (s->busy) {
        while (!aio_counter_take(s->e, imm, units)) side_drain(s, 0, NULL);
        return;
    }
    int r = aio_counter_watch(s->e, imm, units);
    if (r < 0) die("aio_counter_watch: %s", aio_strerror(r));
    int hit = r == 1;
    while (!hit)
        if (side_drain(s, imm, &hit) == 0 && !hit) side_idle(s);
    if (!aio_counter_take(s->e, imm, units)) die("counter watch fired but take failed");
}

/* A request of len bytes at loff here, at roff of the peer `p` (its rails in fa, its direct
 * code `direct`: see side_attach), on rail `rail`. */
aio_op_desc side_req_to(side_t *s, const peer_info *p, const uint64_t *fa, int32_t direct, int rail,
                        uint64_t loff, uint64_t roff, uint64_t len) {
    aio_op_desc d;
    memset(&d, 0, sizeof(d));
    d.mr = s->mr;
    d.offset = loff;
    d.length = len;
    d.rail = rail;
    d.peer = fa[rail];
    d.raddr = p->rail[rail].base + roff;
    d.rkey = p->rail[rail].key;
    d.direct = direct;
    return d;
}

/* Request k's common part: len bytes at loff here, at roff there, on request k's rail (--streams:
 * k % N). */
static aio_op_desc side_req(side_t *s, uint64_t k, uint64_t loff, uint64_t roff, uint64_t len) {
    int rail = (int)(k % (uint64_t)s->nrails);
    return side_req_to(s, &s->remote, s->peers, s->direct, rail, loff, roff, len);
}

/* Request k, a READ of len bytes at roff into loff, on request k's rail. */
aio_op_desc side_read(side_t *s, uint64_t k, uint64_t loff, uint64_t roff, uint64_t len) {
    aio_op_desc d = side_req(s, k, loff, roff, len);
    d.op = AIO_OP_READ;
    return d;
}

/* `d` as a write carrying imm. */
aio_op_desc as_write(aio_op_desc d, uint32_t imm) {
    d.data = imm;
    d.op = AIO_OP_WRITE;
    d.flags = AIO_F_DATA;
    return d;
}

/* Request k, a write of len bytes from loff to roff carrying imm, on request k's rail. */
aio_op_desc side_write(side_t *s, uint64_t k, uint64_t loff, uint64_t roff, uint64_t len, uint32_t imm) {
    return as_write(side_req(s, k, loff, roff, len), imm);
}

/* Forgets the warm-up's counts (groups done, polls, wake-ups, posting time) before a timed part. */
void side_reset_counts(side_t *s) {
    s->groups_done = 0;
    s->polls = s->wakeups = 0;
    s->post_ns = s->post_max_ns = 0;
    s->post_calls = 0;
}

/* Posts requests `d[0..n)` into the open group *g (opened first if none), the rest of a group
 * of `total` requests of which `*in_group` are in already; seals the group once all `total`
 * are in (then *g = -1, *in_group = 0). Returns 1 when the group was sealed, 0 when it is not
 * complete yet (no group free, or no room now). */
int side_post_n(side_t *s, int64_t *g, uint64_t *in_group, uint64_t total, uint64_t token,
                const aio_op_desc *d, int64_t budget_ns) {
    if (*g < 0) {
        *g = aio_group_open(s->e, token);
        if (*g < 0) return 0; /* all groups in flight */
        *in_group = 0;
    }
    int64_t t0 = now_ns();
    int64_t r = aio_post(s->e, *g, d, (int64_t)(total - *in_group), budget_ns);
    int64_t dt = now_ns() - t0;
    s->post_ns += dt;
    s->post_calls++;
    if (dt > s->post_max_ns) s->post_max_ns = dt;
    if (r < 0) die("aio_post: %s", aio_strerror((int)r));
    *in_group += (uint64_t)r;
    if (*in_group < total) return 0;
    int ret = aio_group_seal(s->e, *g);
    if (ret) die("aio_group_seal: %s", aio_strerror(ret));
    *g = -1;
    *in_group = 0;
    return 1;
}

/* One request in a group of its own. Returns 1 posted, 0 not now (queue full,
 * connecting): the group stays open in *g for the retry. */
static int side_post_one(side_t *s, int64_t *g, uint64_t token, const aio_op_desc *d,
                         int64_t budget_ns) {
    uint64_t in_group = 0;
    return side_post_n(s, g, &in_group, 1, token, d, budget_ns);
}

/* Posts one write, retrying (connection setup) until it is in. */
void side_post_blocking(side_t *s, uint64_t token, const aio_op_desc *d) {
    int64_t g = -1, t0 = now_ns();
    while (!side_post_one(s, &g, token, d, 1000000)) {
        side_drain(s, 0, NULL);
        if (now_ns() - t0 > 30000000000LL) die("a write could not be posted for 30 s");
        usleep(20);
    }
}

/* One message in a group of its own: 1 posted, 0 not now (no free send slot, connecting). */
int side_send_one(side_t *s, int64_t *g, uint64_t token, uint64_t len, int64_t budget_ns) {
    if (*g < 0) {
        *g = aio_group_open(s->e, token);
        if (*g < 0) return 0;
    }
    /* --in-place: as Engine.send sends a bytes payload over 16 KiB */
    int r = s->in_place && len > AIO_IN_PLACE_MIN
                ? aio_post_sendv_ref(s->e, *g, s->rail, s->peer, NULL, 0, s->buf, len, budget_ns)
                : aio_post_send(s->e, *g, s->rail, s->peer, s->buf, len, budget_ns);
    s->post_calls++;
    if (r < 0) die("aio_post_send: %s", aio_strerror(r));
    if (r == 0) return 0;
    int ret = aio_group_seal(s->e, *g);
    if (ret) die("aio_group_seal: %s", aio_strerror(ret));
    *g = -1;
    return 1;
}

void side_send_blocking(side_t *s, uint64_t token, uint64_t len) {
    int64_t g = -1, t0 = now_ns();
    while (!side_send_one(s, &g, token, len, 1000000)) {
        if (side_drain(s, 0, NULL) == 0) usleep(20);
        if (now_ns() - t0 > 30000000000LL) die("a message could not be sent for 30 s");
    }
}

void side_wait_msgs(side_t *s, uint64_t n) {
    while (s->msgs < n)
        if (side_drain(s, 0, NULL) == 0 && s->msgs < n) side_idle(s);
}
