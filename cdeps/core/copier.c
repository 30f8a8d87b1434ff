/* Large same-host copies in parts: poller 0 and the engine's helper threads.
 *
 * Theory of operation. A direct copy into or out of a peer's arena is a memcpy by poller 0
 * (direct_copy.c). Past the caches one thread's memcpy leaves memory bandwidth unused that
 * other cores take (on the 2-vCPU VM, AMD EPYC: 8 MiB at 32 GB/s alone, 54 GB/s in two
 * halves; 16 MiB 22 against 40; 64 MiB 14.5 against 18; 4 MiB and less no gain, since the
 * hand-over costs what the second core saves). So a copy of AIO_SPLIT_MIN bytes or more is
 * cut into parts of at least AIO_PART_MIN bytes, one per copying thread at most
 * (aio_engine_set_copy_threads: poller 0 and threads - 1 helpers; 2 by default): the helpers
 * copy the later parts while poller 0 copies the first, and poller 0 waits for theirs before
 * it goes on (the fence, the busy mark's clearing, the completion): to everyone else the
 * copy ends as one memcpy would have. The caller says how to copy a part (aio_part_fn); an
 * error in any part is the copy's (the first part's, else the lowest helper's). Copies the
 * kernel makes between address spaces (process_vm_writev, outside an arena) are not split:
 * in two halves they measured no faster (16 MiB: 11.5-12.8 GB/s either way).
 *
 * The helpers are threads of the engine, started together at the first such copy (by poller
 * 0, the only thread that copies, so one job at a time and no race to start them), asleep on
 * a condition variable between jobs: they never spin, and an engine that never copies 8 MiB
 * at once never has one. Helper i takes part i + 1 of a job (a job's generation tells it a
 * new one came); helpers that cannot be started leave fewer parts (none: poller 0 copies
 * alone). They are stopped and joined after the pollers, in aio_engine_destroy. */
#include "internal.h"

#include "copier.h"

#define AIO_SPLIT_MIN (8u << 20)
#define AIO_PART_MIN (4u << 20)

typedef struct {
    uint64_t off, len;
    int rc;
} copy_part;

typedef struct {
    aio_copier *c;
    int idx; /* the helper's index: it takes part idx + 1 of a job */
} helper_arg;

struct aio_copier {
    pthread_mutex_t mu;
    pthread_cond_t job_cv;  /* the helpers wait for a job or stop */
    pthread_cond_t done_cv; /* poller 0 waits for the helpers' parts */
    pthread_t th[AIO_COPY_THREADS_MAX - 1];
    int nth; /* helpers running */
    int stop;
    uint64_t gen; /* the job's generation: each helper takes its part once per job */
    int nparts;   /* helper parts of the current job (parts 1..nparts) */
    int pending;  /* of those, not done yet */
    aio_part_fn fn;
    void *ctx;
    copy_part part[AIO_COPY_THREADS_MAX - 1];
    helper_arg arg[AIO_COPY_THREADS_MAX - 1];
};

static void *copier_main(void *arg) {
    helper_arg a = *(helper_arg *)arg;
    aio_copier *c = a.c;
    uint64_t seen = 0;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->stop && !(c->gen != seen && a.idx < c->nparts)) pthread_cond_wait(&c->job_cv, &c->mu);
        if (c->stop) break;
        seen = c->gen;
        aio_part_fn fn = c->fn;
        void *ctx = c->ctx;
        uint64_t off = c->part[a.idx].off, len = c->part[a.idx].len;
        pthread_mutex_unlock(&c->mu);
        int rc = fn(ctx, off, len);
        pthread_mutex_lock(&c->mu);
        c->part[a.idx].rc = rc;
        if (--c->pending == 0) pthread_cond_signal(&c->done_cv);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* The engine's helpers, started on first use; NULL when none can be (poller 0 only). */
static aio_copier *copier_get(aio_engine *e) {
    if (e->copier || e->copier_failed) return e->copier;
    aio_copier *c = calloc(1, sizeof(*c));
    if (!c) {
        e->copier_failed = 1;
        return NULL;
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->job_cv, NULL);
    pthread_cond_init(&c->done_cv, NULL);
    for (int i = 0; i < e->copy_threads - 1; i++) {
        c->arg[i] = (helper_arg){c, i};
        if (pthread_create(&c->th[i], NULL, copier_main, &c->arg[i]) != 0) break;
        pthread_setname_np(c->th[i], "aiote-copy");
        c->nth++;
    }
    if (!c->nth) {
        pthread_cond_destroy(&c->done_cv);
        pthread_cond_destroy(&c->job_cv);
        pthread_mutex_destroy(&c->mu);
        free(c);
        e->copier_failed = 1;
        return NULL;
    }
    e->copier = c;
    return c;
}

int aio__split(aio_engine *e, uint64_t n, aio_part_fn fn, void *ctx) {
    aio_copier *c = n >= AIO_SPLIT_MIN && e->copy_threads > 1 ? copier_get(e) : NULL;
    if (!c) return fn(ctx, 0, n);
    uint64_t parts = n / AIO_PART_MIN;
    if (parts > (uint64_t)c->nth + 1) parts = (uint64_t)c->nth + 1;
    uint64_t each = (n / parts) & ~(uint64_t)63;
    pthread_mutex_lock(&c->mu);
    c->fn = fn;
    c->ctx = ctx;
    for (uint64_t i = 1; i < parts; i++) {
        c->part[i - 1].off = i * each;
        c->part[i - 1].len = i + 1 < parts ? each : n - i * each;
        c->part[i - 1].rc = 0;
    }
    c->nparts = c->pending = (int)parts - 1;
    c->gen++;
    pthread_cond_broadcast(&c->job_cv);
    pthread_mutex_unlock(&c->mu);
    int rc = fn(ctx, 0, each);
    pthread_mutex_lock(&c->mu);
    while (c->pending) pthread_cond_wait(&c->done_cv, &c->mu);
    for (int i = 0; i < c->nparts && !rc; i++) rc = c->part[i].rc;
    c->nparts = 0;
    pthread_mutex_unlock(&c->mu);
    atomic_fetch_add_explicit(&e->st_split, 1, memory_order_relaxed);
    return rc;
}

int aio_engine_set_copy_threads(aio_engine *e, int n) {
    if (e->started || n < 1 || n > AIO_COPY_THREADS_MAX) return -FI_EINVAL;
    e->copy_threads = n;
    return 0;
}

void aio__copier_free(aio_engine *e) {
    aio_copier *c = e->copier;
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    pthread_cond_broadcast(&c->job_cv);
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < c->nth; i++) pthread_join(c->th[i], NULL);
    pthread_cond_destroy(&c->done_cv);
    pthread_cond_destroy(&c->job_cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
    e->copier = NULL;
}
