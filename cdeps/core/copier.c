/* Large same-host copies in two halves: poller 0 and a helper thread.
 *
 * Theory of operation. A direct copy into or out of a peer's arena is a memcpy by poller 0
 * (direct_copy.c). Past the caches one thread's memcpy leaves memory bandwidth unused that a
 * second core takes (on the 2-vCPU VM, AMD EPYC: 8 MiB at 32 GB/s alone, 54 GB/s in two
 * halves; 16 MiB 22 against 40; 64 MiB 14.5 against 18; 4 MiB and less no gain, since the
 * hand-over costs what the second core saves). So a copy of AIO_SPLIT_MIN bytes or more is
 * cut in two: the helper copies the second half while poller 0 copies the first, and poller 0
 * waits for the helper's half before it goes on (the fence, the busy mark's clearing, the
 * completion): to everyone else the copy ends as one memcpy would have. The caller says how
 * to copy a part (aio_part_fn); an error in either half is the copy's. Copies the kernel
 * makes between address spaces (process_vm_writev, outside an arena) are not split: in two
 * halves they measured no faster (16 MiB: 11.5-12.8 GB/s either way).
 *
 * The helper is a thread of the engine, started at the first such copy (by poller 0, the
 * only thread that copies, so one job at a time and no race to start it), asleep on a
 * condition variable between jobs: it never spins, and an engine that never copies 8 MiB at
 * once never has one. A helper that cannot be started leaves poller 0 copying alone. It is
 * stopped and joined after the pollers, in aio_engine_destroy. */
#include "internal.h"

#include "copier.h"

#define AIO_SPLIT_MIN (8u << 20)

struct aio_copier {
    pthread_mutex_t mu;
    pthread_cond_t job_cv;  /* the helper waits for a job or stop */
    pthread_cond_t done_cv; /* poller 0 waits for the helper's half */
    pthread_t th;
    int stop;
    int pending; /* a job is the helper's until it clears this */
    aio_part_fn fn;
    void *ctx;
    uint64_t off, len;
    int rc;
};

static void *copier_main(void *arg) {
    aio_copier *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->pending && !c->stop) pthread_cond_wait(&c->job_cv, &c->mu);
        if (c->stop) break;
        aio_part_fn fn = c->fn;
        void *ctx = c->ctx;
        uint64_t off = c->off, len = c->len;
        pthread_mutex_unlock(&c->mu);
        int rc = fn(ctx, off, len);
        pthread_mutex_lock(&c->mu);
        c->rc = rc;
        c->pending = 0;
        pthread_cond_signal(&c->done_cv);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* The engine's helper, started on first use; NULL when it cannot be (poller 0 only). */
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
    if (pthread_create(&c->th, NULL, copier_main, c) != 0) {
        pthread_cond_destroy(&c->done_cv);
        pthread_cond_destroy(&c->job_cv);
        pthread_mutex_destroy(&c->mu);
        free(c);
        e->copier_failed = 1;
        return NULL;
    }
    pthread_setname_np(c->th, "aiote-copy");
    e->copier = c;
    return c;
}

int aio__split(aio_engine *e, uint64_t n, aio_part_fn fn, void *ctx) {
    aio_copier *c = n >= AIO_SPLIT_MIN ? copier_get(e) : NULL;
    if (!c) return fn(ctx, 0, n);
    uint64_t half = (n / 2) & ~(uint64_t)63;
    pthread_mutex_lock(&c->mu);
    c->fn = fn;
    c->ctx = ctx;
    c->off = half;
    c->len = n - half;
    c->pending = 1;
    pthread_cond_signal(&c->job_cv);
    pthread_mutex_unlock(&c->mu);
    int rc = fn(ctx, 0, half);
    pthread_mutex_lock(&c->mu);
    while (c->pending) pthread_cond_wait(&c->done_cv, &c->mu);
    int rc2 = c->rc;
    pthread_mutex_unlock(&c->mu);
    atomic_fetch_add_explicit(&e->st_split, 1, memory_order_relaxed);
    return rc ? rc : rc2;
}

void aio__copier_free(aio_engine *e) {
    aio_copier *c = e->copier;
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    pthread_cond_signal(&c->job_cv);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->th, NULL);
    pthread_cond_destroy(&c->done_cv);
    pthread_cond_destroy(&c->job_cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
    e->copier = NULL;
}
