/* aiote_cbench's throughput runs: write, read, paged, sendrecv.
 *
 * Theory of operation. Rank 0 (the parent, or --connect) moves the data and prints the run's
 * one JSON line; rank 1 (the forked peer, or --listen) takes its part and reports back over
 * the control channel (when it saw the last credit or message, its CPU time). Each run first
 * makes untimed warm-up requests (connection set-up, first touch) and resets its counts; then
 * come the timed ones.
 *
 *   write SIZE WINDOW TOTAL_BYTES
 *       one-sided writes with immediate data from the parent to the child, WINDOW in
 *       flight, each write its own group (--batch N: groups of N writes, each group posted
 *       with one aio_post call and posted again when it completes, as aiote bench drives
 *       its batches). The child counts credits (one counter watch
 *       for all of them). Reports GB/s (1e9 B/s) at the writer, from the first post
 *       to the last completion, and the time until the receiver saw every credit
 *       (both processes read CLOCK_MONOTONIC, which is system-wide).
 *   read SIZE WINDOW TOTAL_BYTES
 *       one-sided READs by the parent from the child's region, WINDOW in flight, each read
 *       its own group (--batch N: as for write; the child takes no part). Reports GB/s at
 *       the reader, from the first post to the last completion.
 *   paged PAGE_SIZE NPAGES CALLS
 *       paged writes (aio_post_paged) from the parent to the child: both register
 *       PAGE_SIZE*NPAGES bytes; each of CALLS calls opens one group, posts the NPAGES pages
 *       into it (identity source pages, a random permutation of destination pages, strides
 *       = PAGE_SIZE, each page carrying an imm), seals it and waits for its group record
 *       (one call in flight, as an awaited engine.write_paged). The child waits for
 *       NPAGES*CALLS credits. One untimed warm-up call first. When the queue is full the
 *       writer backs off as the engine does (50 us after progress, doubling while stalled,
 *       at most 10 ms). Reports GB/s (1e9 B/s) and pages/s at the writer, from the first
 *       post to the last group record, and the median time per call (call_us_p50).
 *       As the engine does, the pages are ordered by destination (once, untimed) and the
 *       core gathers adjacent destinations into one request; --no-gather posts page by
 *       page in the permuted order.
 *   sendrecv SIZE WINDOW TOTAL_BYTES
 *       two-sided messages of SIZE bytes (aio_post_send into the core's registered send
 *       slots; the receiver counts AIO_REC_RECV records and reposts each slot at once),
 *       WINDOW sends in flight (at most --msg-slots, 16 like the engine's default); with
 *       --copy-out the receiver copies each message into a fresh allocation first, as
 *       Engine.recv does (receiver_copied_bytes: what it copied). Reports
 *       GB/s from the first send to the receiver's report that every message arrived (read
 *       over the pipe/socket, so it holds across hosts too). */
#include "cbench.h"

/* The receiving side of a throughput run: waits for `units` credits of IMM_MAIN, reports
 * when they were complete, its CPU time and the warm-up credits, then waits for the bye. */
static void receive_all(side_t *s, uint64_t units) {
    double c0 = cpu_s();
    side_wait_credit(s, IMM_MAIN, units);
    int64_t t_recv = now_ns();
    double cpu = cpu_s() - c0;
    write_full(s->wfd, &t_recv, sizeof(t_recv));
    write_full(s->wfd, &cpu, sizeof(cpu));
    uint64_t warm_total = aio_counter_total(s->e, IMM_WARM);
    write_full(s->wfd, &warm_total, sizeof(warm_total));
    char bye;
    read_full(s->rfd, &bye, 1);
}

/* The writer's side of receive_all: reads the receiver's report and says bye. */
static void receiver_report(side_t *s, int64_t *t_recv, double *rcpu, uint64_t *warm_total) {
    read_full(s->rfd, t_recv, sizeof(*t_recv));
    read_full(s->rfd, rcpu, sizeof(*rcpu));
    read_full(s->rfd, warm_total, sizeof(*warm_total));
    char bye = 'x';
    write_full(s->wfd, &bye, 1);
}

/* write, read: how many requests a run makes (TOTAL / SIZE, at least one, rounded down to
 * whole groups of --batch); the same on both sides. */
uint64_t transfer_count(const opts_t *o) {
    uint64_t n = o->total / o->size;
    n -= n % o->batch;
    return n ? n : o->batch;
}

/* The timed part of write, read and fan: `n` requests (whole groups of --batch), at most WINDOW
 * in flight, in groups of --batch requests, each group posted with one aio_post call (as
 * aiote's TransferBatch.submit posts a batch); a group goes out again as soon as one completes.
 * --batch 1: a request per group, re-posted as each completes. make(s, ctx, req, off) builds
 * request `req`, whose slot is at `off`. */
void run_requests(side_t *s, const opts_t *o, uint64_t n, req_fn make, const void *ctx) {
    uint64_t b = o->batch, ngroups = n / b, gmax = o->window / b;
    aio_op_desc d[MAX_BATCH];
    uint64_t posted = 0, in_group = 0; /* groups sealed; requests in of the open one */
    int64_t g = -1;
    while (s->groups_done < ngroups) {
        int progressed = 0;
        while (posted < ngroups && posted - s->groups_done < gmax) {
            for (uint64_t k = in_group; k < b; k++) {
                uint64_t req = posted * b + k;
                d[k] = make(s, ctx, req, (req % o->slots) * o->size);
            }
            uint64_t before = in_group;
            int sealed = side_post_n(s, &g, &in_group, b, posted, d + in_group, 0);
            if (sealed || in_group != before) progressed = 1;
            if (!sealed) break;
            posted++;
        }
        if (side_drain(s, 0, NULL) == 0 && !progressed) side_idle(s);
    }
}

static aio_op_desc write_req(side_t *s, const void *ctx, uint64_t req, uint64_t off) {
    return side_write(s, req, off, off, ((const opts_t *)ctx)->size, IMM_MAIN);
}

static aio_op_desc read_req(side_t *s, const void *ctx, uint64_t req, uint64_t off) {
    return side_read(s, req, off, off, ((const opts_t *)ctx)->size);
}

/* Sleeps until CLOCK_REALTIME `at_ns` (0: returns at once); how late past it this returned
 * (a warm-up that ended after `at_ns` starts at once, late by that much). */
int64_t start_at(int64_t at_ns) {
    if (at_ns <= 0) return 0;
    int64_t now = realtime_ns();
    if (now < at_ns) {
        struct timespec until = {.tv_sec = at_ns / 1000000000LL, .tv_nsec = at_ns % 1000000000LL};
        while (clock_nanosleep(CLOCK_REALTIME, TIMER_ABSTIME, &until, NULL) == EINTR) {}
        now = realtime_ns();
    }
    return now - at_ns;
}

void run_write(side_t *s, const opts_t *o, int rank) {
    uint64_t n = transfer_count(o);
    uint64_t slots = o->slots;
    uint64_t warm = n < o->window ? n : o->window;
    if (rank == 1) {
        /* receiver: one watch for every credit of the run */
        receive_all(s, n * U);
        return;
    }
    /* warm-up: connection set-up and first-touch, not timed */
    for (uint64_t i = 0; i < warm; i++) {
        aio_op_desc d = side_write(s, i, (i % slots) * o->size, (i % slots) * o->size, o->size, IMM_WARM);
        side_post_blocking(s, 1ULL << 40 | i, &d);
    }
    side_wait_groups(s, warm);
    side_reset_counts(s);
    aio_stats st0, st1;
    aio_get_stats(s->e, &st0);

    int64_t late_ns = start_at(o->start_at_ns);
    double c0 = cpu_s(), m0 = thread_cpu_s();
    int64_t t0 = now_ns();
    run_requests(s, o, n, write_req, o);
    int64_t t1 = now_ns();
    double cpu = cpu_s() - c0, main_cpu = thread_cpu_s() - m0;
    aio_get_stats(s->e, &st1);
    int64_t t_recv;
    double rcpu;
    uint64_t warm_total;
    receiver_report(s, &t_recv, &rcpu, &warm_total);
    double secs = (double)(t1 - t0) * 1e-9, rsecs = (double)(t_recv - t0) * 1e-9;
    double bytes = (double)n * (double)o->size;
    printf("{\"mode\":\"write\",\"provider\":\"%s\",\"nic\":\"%s\",\"size\":%llu,\"window\":%llu,"
           "\"batch\":%llu,\"slots\":%llu,\"writes\":%llu,\"total_bytes\":%.0f,\"gbps\":%.3f,\"seconds\":%.6f,"
           "\"recv_gbps\":%.3f,\"recv_seconds\":%.6f,\"wait\":\"%s\",\"spin_ns\":%lld,"
           "\"writer_cpu_s\":%.6f,\"writer_main_cpu_s\":%.6f,\"receiver_cpu_s\":%.6f,\"eventfd_polls\":%llu,"
           "\"eventfd_wakeups\":%llu,\"poller_sleeps\":%llu,\"poller_polls\":%llu,"
           "\"posts_handed\":%llu,\"post_calls\":%llu,\"post_us_mean\":%.2f,\"post_us_max\":%.1f,"
           "\"streams\":%d,\"pollers\":%d,\"start_late_us\":%.1f}\n",
           o->provider, o->nic ? o->nic : "", (unsigned long long)o->size,
           (unsigned long long)o->window, (unsigned long long)o->batch, (unsigned long long)slots,
           (unsigned long long)n, bytes,
           bytes / secs / 1e9, secs, bytes / rsecs / 1e9, rsecs, wait_name(o), (long long)o->spin_ns,
           cpu, main_cpu, rcpu, (unsigned long long)s->polls, (unsigned long long)s->wakeups,
           (unsigned long long)(st1.sleeps - st0.sleeps), (unsigned long long)(st1.polls - st0.polls),
           (unsigned long long)(st1.posts_handed - st0.posts_handed), (unsigned long long)s->post_calls,
           s->post_calls ? (double)s->post_ns / (double)s->post_calls / 1e3 : 0.0,
           (double)s->post_max_ns / 1e3, s->nrails, aio_engine_num_pollers(s->e),
           (double)late_ns / 1e3);
    if (warm_total != warm * U) fprintf(stderr, "warning: warm-up credits %llu, want %llu\n",
                                        (unsigned long long)(warm_total / U), (unsigned long long)warm);
}

/* One paged call: a group of every page, posted from `start` until all are in, sealed,
 * and waited for. Returns the number of aio_post_paged calls that posted nothing. */
static uint64_t paged_call(side_t *s, const aio_paged_desc *d, int64_t npages, uint64_t token) {
    int64_t g;
    while ((g = aio_group_open(s->e, token)) < 0) /* every group slot in flight */
        if (side_drain(s, 0, NULL) == 0) side_idle(s);
    uint64_t done0 = s->groups_done, stalls = 0;
    int64_t posted = 0;
    int attempt = 0;
    while (posted < npages) {
        int64_t t0 = now_ns();
        int64_t r = aio_post_paged(s->e, g, d, posted, npages, PAGED_BUDGET_NS);
        int64_t dt = now_ns() - t0;
        s->post_ns += dt;
        s->post_calls++;
        if (dt > s->post_max_ns) s->post_max_ns = dt;
        if (r < 0) die("aio_post_paged (page %lld): %s", (long long)posted, aio_strerror((int)r));
        posted += r;
        if (posted < npages) {
            /* queue full (or still connecting): back off while the poller progresses, with
             * the engine's schedule (50 us after progress, doubling while stalled, <= 10 ms) */
            attempt = r == 0 ? attempt + 1 : 0;
            stalls += r == 0;
            side_drain(s, 0, NULL);
            int sh = attempt < 8 ? attempt : 8;
            int64_t us = 50LL << sh;
            usleep((useconds_t)(us < 10000 ? us : 10000));
        }
    }
    int ret = aio_group_seal(s->e, g);
    if (ret) die("aio_group_seal: %s", aio_strerror(ret));
    while (s->groups_done == done0)
        if (side_drain(s, 0, NULL) == 0) side_idle(s);
    return stalls;
}

void run_paged(side_t *s, const opts_t *o, int rank) {
    int64_t np = (int64_t)o->npages;
    uint64_t credits = o->npages * o->calls;
    if (rank == 1) {
        receive_all(s, credits * U);
        return;
    }
    int64_t *src = malloc((size_t)np * sizeof(int64_t)), *dst = malloc((size_t)np * sizeof(int64_t));
    if (!src || !dst) die("out of memory");
    for (int64_t k = 0; k < np; k++) src[k] = dst[k] = k;
    uint64_t x = 0x9E3779B97F4A7C15ULL; /* xorshift64, fixed seed: Fisher-Yates of dst */
    for (int64_t k = np - 1; k > 0; k--) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        int64_t j = (int64_t)(x % (uint64_t)(k + 1)), t = dst[k];
        dst[k] = dst[j];
        dst[j] = t;
    }
    if (!o->no_gather) {
        /* what the engine does for a call: order the pages by destination (dst is a
         * permutation here, so that is a placement) and let the core gather runs of
         * adjacent destinations into one request. Done once, outside the timed calls. */
        int64_t *s2 = malloc((size_t)np * sizeof(int64_t));
        if (!s2) die("out of memory");
        for (int64_t k = 0; k < np; k++) s2[dst[k]] = src[k];
        for (int64_t k = 0; k < np; k++) {
            src[k] = s2[k];
            dst[k] = k;
        }
        free(s2);
    }
    aio_paged_desc d;
    memset(&d, 0, sizeof(d));
    d.gather = !o->no_gather;
    d.mr = s->mr;
    d.src_pages = src;
    d.dst_pages = dst;
    d.page_size = d.src_stride = d.dst_stride = o->page_size;
    d.remote_len = s->remote.len;
    d.flags = AIO_F_DATA;
    d.nroutes = 1;
    d.routes[0].rail = s->rail;
    d.routes[0].peer = s->peer;
    d.routes[0].rbase = s->remote.rail[0].base;
    d.routes[0].rkey = s->remote.rail[0].key;
    /* warm-up: connection set-up and first touch, not timed */
    d.data = IMM_WARM;
    paged_call(s, &d, np, 1ULL << 40);
    side_reset_counts(s);
    d.data = IMM_MAIN;
    uint64_t stalls = 0;
    int64_t *call_ns = calloc(o->calls, sizeof(int64_t));
    if (!call_ns) die("out of memory");
    double c0 = cpu_s();
    int64_t t0 = now_ns(), tc = t0;
    for (uint64_t c = 0; c < o->calls; c++) {
        stalls += paged_call(s, &d, np, c);
        int64_t t = now_ns();
        call_ns[c] = t - tc;
        tc = t;
    }
    int64_t t1 = tc;
    double cpu = cpu_s() - c0;
    int64_t t_recv;
    double rcpu;
    uint64_t warm_total;
    receiver_report(s, &t_recv, &rcpu, &warm_total);
    double secs = (double)(t1 - t0) * 1e-9, rsecs = (double)(t_recv - t0) * 1e-9;
    double pages = (double)credits, bytes = pages * (double)o->page_size;
    qsort(call_ns, o->calls, sizeof(int64_t), cmp_i64);
    printf("{\"mode\":\"paged\",\"provider\":\"%s\",\"nic\":\"%s\",\"page_size\":%llu,\"pages\":%llu,"
           "\"calls\":%llu,\"total_bytes\":%.0f,\"gbps\":%.3f,\"pages_per_s\":%.0f,\"seconds\":%.6f,"
           "\"call_us_mean\":%.1f,\"call_us_p50\":%.1f,\"call_us_min\":%.1f,\"recv_gbps\":%.3f,\"recv_seconds\":%.6f,\"wait\":\"%s\","
           "\"spin_ns\":%lld,\"writer_cpu_s\":%.3f,\"receiver_cpu_s\":%.3f,\"eventfd_polls\":%llu,"
           "\"eventfd_wakeups\":%llu,\"post_calls\":%llu,\"post_stalls\":%llu,"
           "\"post_us_mean\":%.2f,\"post_us_max\":%.1f}\n",
           o->provider, o->nic ? o->nic : "", (unsigned long long)o->page_size,
           (unsigned long long)o->npages, (unsigned long long)o->calls, bytes, bytes / secs / 1e9,
           pages / secs, secs, secs * 1e6 / (double)o->calls, (double)call_ns[o->calls / 2] / 1e3,
           (double)call_ns[0] / 1e3, bytes / rsecs / 1e9, rsecs,
           wait_name(o), (long long)o->spin_ns, cpu, rcpu, (unsigned long long)s->polls,
           (unsigned long long)s->wakeups, (unsigned long long)s->post_calls,
           (unsigned long long)stalls,
           s->post_calls ? (double)s->post_ns / (double)s->post_calls / 1e3 : 0.0,
           (double)s->post_max_ns / 1e3);
    if (warm_total != o->npages * U)
        fprintf(stderr, "warning: warm-up credits %llu, want %llu\n",
                (unsigned long long)(warm_total / U), (unsigned long long)o->npages);
    free(call_ns);
    free(src);
    free(dst);
}

/* Runs READs of `size` bytes, `window` in flight, from the remote region; rank 1 only waits. */
void run_read(side_t *s, const opts_t *o, int rank) {
    uint64_t n = transfer_count(o);
    uint64_t slots = o->slots;
    char bye = 'x';
    if (rank == 1) {
        read_full(s->rfd, &bye, 1);
        return;
    }
    uint64_t warm = n < o->window ? n : o->window;
    for (uint64_t i = 0; i < warm; i++) {
        aio_op_desc d = side_read(s, i, (i % slots) * o->size, (i % slots) * o->size, o->size);
        side_post_blocking(s, 1ULL << 40 | i, &d);
    }
    side_wait_groups(s, warm);
    side_reset_counts(s);
    double c0 = cpu_s();
    int64_t t0 = now_ns();
    run_requests(s, o, n, read_req, o);
    int64_t t1 = now_ns();
    double cpu = cpu_s() - c0;
    write_full(s->wfd, &bye, 1);
    double secs = (double)(t1 - t0) * 1e-9, bytes = (double)n * (double)o->size;
    printf("{\"mode\":\"read\",\"provider\":\"%s\",\"nic\":\"%s\",\"size\":%llu,\"window\":%llu,"
           "\"batch\":%llu,\"slots\":%llu,\"reads\":%llu,\"total_bytes\":%.0f,\"gbps\":%.3f,\"seconds\":%.6f,"
           "\"wait\":\"%s\",\"spin_ns\":%lld,\"reader_cpu_s\":%.3f,\"eventfd_polls\":%llu,"
           "\"eventfd_wakeups\":%llu,\"post_calls\":%llu,\"post_us_mean\":%.2f}\n",
           o->provider, o->nic ? o->nic : "", (unsigned long long)o->size,
           (unsigned long long)o->window, (unsigned long long)o->batch, (unsigned long long)slots,
           (unsigned long long)n, bytes,
           bytes / secs / 1e9, secs, wait_name(o), (long long)o->spin_ns, cpu,
           (unsigned long long)s->polls, (unsigned long long)s->wakeups,
           (unsigned long long)s->post_calls,
           s->post_calls ? (double)s->post_ns / (double)s->post_calls / 1e3 : 0.0);
}

/* Two-sided throughput: rank 0 sends, rank 1 counts messages and reposts its slots. */
void run_sendrecv(side_t *s, const opts_t *o, int rank) {
    uint64_t n = o->total / o->size;
    if (n == 0) n = 1;
    uint64_t window = o->window < o->msg_slots ? o->window : o->msg_slots;
    uint64_t warm = n < window ? n : window;
    if (rank == 1) {
        side_wait_msgs(s, warm);
        double c0 = cpu_s();
        side_wait_msgs(s, warm + n);
        double cpu = cpu_s() - c0;
        write_full(s->wfd, &cpu, sizeof(cpu));
        uint64_t bytes = s->msg_bytes;
        write_full(s->wfd, &bytes, sizeof(bytes));
        uint64_t copied[2] = {s->copied, s->copy_sum};
        write_full(s->wfd, copied, sizeof(copied));
        char bye;
        read_full(s->rfd, &bye, 1);
        return;
    }
    for (uint64_t i = 0; i < warm; i++) side_send_blocking(s, 1ULL << 40 | i, o->size);
    side_wait_groups(s, warm);
    side_reset_counts(s);
    double c0 = cpu_s();
    int64_t t0 = now_ns();
    uint64_t posted = 0;
    int64_t g = -1;
    while (s->groups_done < n) {
        int progressed = 0;
        while (posted < n && posted - s->groups_done < window) {
            if (!side_send_one(s, &g, posted, o->size, 0)) break;
            posted++;
            progressed = 1;
        }
        if (side_drain(s, 0, NULL) == 0 && !progressed) side_idle(s);
    }
    int64_t t_sent = now_ns();
    double cpu = cpu_s() - c0, rcpu;
    uint64_t rbytes;
    read_full(s->rfd, &rcpu, sizeof(rcpu)); /* the receiver saw every message */
    int64_t t1 = now_ns();
    read_full(s->rfd, &rbytes, sizeof(rbytes));
    uint64_t copied[2];
    read_full(s->rfd, copied, sizeof(copied));
    char bye = 'x';
    write_full(s->wfd, &bye, 1);
    double secs = (double)(t1 - t0) * 1e-9, bytes = (double)n * (double)o->size;
    if (rbytes != (warm + n) * o->size)
        die("the receiver got %llu bytes, want %llu", (unsigned long long)rbytes,
            (unsigned long long)((warm + n) * o->size));
    printf("{\"mode\":\"sendrecv\",\"provider\":\"%s\",\"nic\":\"%s\",\"size\":%llu,\"window\":%llu,"
           "\"msg_slots\":%llu,\"messages\":%llu,\"total_bytes\":%.0f,\"gbps\":%.3f,\"seconds\":%.6f,"
           "\"send_gbps\":%.3f,\"wait\":\"%s\",\"spin_ns\":%lld,\"sender_cpu_s\":%.3f,"
           "\"receiver_cpu_s\":%.3f,\"eventfd_polls\":%llu,\"eventfd_wakeups\":%llu,"
           "\"post_calls\":%llu,\"receiver_copied_bytes\":%llu}\n",
           o->provider, o->nic ? o->nic : "", (unsigned long long)o->size, (unsigned long long)window,
           (unsigned long long)o->msg_slots, (unsigned long long)n, bytes, bytes / secs / 1e9, secs,
           bytes / ((double)(t_sent - t0) * 1e-9) / 1e9, wait_name(o), (long long)o->spin_ns, cpu,
           rcpu, (unsigned long long)s->polls, (unsigned long long)s->wakeups,
           (unsigned long long)s->post_calls, (unsigned long long)copied[0]);
}
