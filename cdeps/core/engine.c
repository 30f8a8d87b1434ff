/* The engine: its life (create, start, destroy), and the errors it reports.
 *
 * Theory of operation. An engine is built on one thread (the event loop's, from Python with
 * the GIL released): aio_engine_create allocates the completion ring, the group table and the
 * counters, the eventfd the loop waits on, and poller 0's epoll set; the settings that shape
 * rails come next (aio_engine_set_pollers, aio_engine_set_tcp_sndbuf), then the rails
 * (aio_engine_add_rail: rail.c), and aio_engine_start starts one thread per poller that drives
 * a rail (poller.c) and the link monitor (link.c). From then on the engine is used from any
 * thread: the functions of the API are safe to call concurrently, with the GIL released, and
 * none of them takes it.
 *
 * Destruction assumes the caller waited for its work first (it cancels nothing in flight): the
 * pollers are stopped and joined, then every endpoint is closed before any memory is let go
 * (nothing can touch a region after that), regions still registered are closed (a same-host
 * peer copying into one is waited for up to 2 s), then the rails, the direct-copy tables and
 * the ring. */
#include "internal.h"

#include <stdarg.h>
#include <sys/eventfd.h>

#include "copier.h"
#include "direct_table.h"
#include "link.h"
#include "poller.h"
#include "rail.h"
#include "ring.h"

void aio__set_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || errlen == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

const char *aio_strerror(int code) {
    if (code < 0) code = -code;
    if (code == AIO_EPEERGONE) return "the same-host peer's process is gone";
    return fi_strerror(code);
}

uint32_t aio_fabric_version(void) { return fi_version(); }

int aio_engine_create(const aio_engine_config *cfg, aio_engine **out, char *err, size_t errlen) {
    aio_engine *e = calloc(1, sizeof(*e));
    if (!e) return -FI_ENOMEM;
    atomic_store(&e->loop_cpu, -1);
    atomic_store(&e->st_follow_cpu, -1);
    e->cfg = *cfg;
    e->sndbuf = AIO_TCP_SNDBUF_AUTO;
    if (e->cfg.ring_capacity < 1024) e->cfg.ring_capacity = 1024;
    uint32_t cap = 1;
    while (cap < e->cfg.ring_capacity) cap <<= 1;
    e->cfg.ring_capacity = cap;
    if (e->cfg.max_ops == 0) e->cfg.max_ops = 16384;
    if (e->cfg.max_groups == 0) e->cfg.max_groups = 16384;
    if (e->cfg.sleep_ms <= 0) e->cfg.sleep_ms = 100;
    if (e->cfg.busy_spin_ns <= 0) e->cfg.busy_spin_ns = 200000; /* 200 us: longer starves a 2-core box */
    if (e->cfg.watch_us <= 0) e->cfg.watch_us = 100;
    if (e->cfg.watch_us > 1000000) e->cfg.watch_us = 1000000;
    e->ring = calloc(cap, sizeof(aio_record));
    e->ovf_block = calloc(RING_RESERVE, sizeof(overflow_node));
    if (!e->ovf_block) goto fail;
    for (int i = 0; i < RING_RESERVE; i++) {
        e->ovf_block[i].reserve = 1;
        e->ovf_block[i].next = i + 1 < RING_RESERVE ? &e->ovf_block[i + 1] : NULL;
    }
    e->ovf_free = e->ovf_block;
    e->ring_mask = cap - 1;
    e->groups = calloc(e->cfg.max_groups, sizeof(aio_group));
    e->ccap = 1024;
    e->cslots = calloc(e->ccap, sizeof(cslot));
    if (!e->ring || !e->groups || !e->cslots) goto fail;
    for (uint32_t i = 0; i < e->cfg.max_groups; i++)
        e->groups[i].next_free = (i + 1 < e->cfg.max_groups) ? (int32_t)(i + 1) : -1;
    e->groups_free = 0;
    pthread_mutex_init(&e->ring_mu, NULL);
    pthread_mutex_init(&e->groups_mu, NULL);
    pthread_mutex_init(&e->cnt_mu, NULL);
    pthread_mutex_init(&e->mr_mu, NULL);
    pthread_mutex_init(&e->watch_mu, NULL);
    pthread_mutex_init(&e->fine_mu, NULL);
    pthread_mutex_init(&e->dmu, NULL);
    e->dfd = -1;
    e->afd = -1;
    e->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    e->nl_fd = -1;
    atomic_store(&e->want_below, -1);
    e->npollers_want = 1;
    e->copy_threads = 2;
    if (e->efd < 0 || aio__poller_open(e) != 0) {
        aio__set_err(err, errlen, "eventfd/epoll: %s", strerror(errno));
        goto fail;
    }
    *out = e;
    return 0;
fail:
    if (e->efd > 0) close(e->efd);
    free(e->ovf_block);
    free(e->ring);
    free(e->groups);
    free(e->cslots);
    free(e);
    return -FI_ENOMEM;
}

int aio_engine_start(aio_engine *e) {
    if (e->started) return 0;
    if (e->nrails == 0) return -FI_EINVAL;
    if (e->nl_fd < 0) aio__open_netlink(e);
    int ret = aio__pollers_start(e);
    if (ret) return ret;
    e->started = 1;
    return 0;
}

int aio_engine_num_rails(aio_engine *e) { return e->nrails; }

void aio_engine_destroy(aio_engine *e) {
    if (!e) return;
    aio__pollers_join(e);
    aio__copier_free(e); /* no poller copies any more */
    /* endpoints first: nothing can touch memory after this */
    for (int i = 0; i < e->nrails; i++) {
        aio_rail *r = e->rails[i];
        if (r->ep) {
            fi_close(&r->ep->fid);
            r->ep = NULL;
        }
    }
    if (e->dtab) atomic_store(&e->dtab->closed, 1);
    pthread_mutex_lock(&e->mr_mu);
    aio_mr *m = e->mrs;
    while (m) {
        aio_mr *nx = m->next;
        /* peers copying now finish first (a live process stopped mid-copy: give up after 2 s) */
        if (m->direct_slot >= 0) aio__direct_retire(e->dtab, m->direct_slot, 2000000000LL);
        for (int i = 0; i < m->nrails; i++)
            if (m->mr[i]) fi_close(&m->mr[i]->fid);
        free(m);
        m = nx;
    }
    e->mrs = NULL;
    pthread_mutex_unlock(&e->mr_mu);
    for (int i = 0; i < e->nrails; i++) aio__rail_free(e->rails[i]);
    aio__direct_destroy(e);
    while (e->ovf_head) {
        overflow_node *x = e->ovf_head;
        e->ovf_head = x->next;
        if (!x->reserve) free(x);
    }
    free(e->ovf_block);
    close(e->efd);
    for (int i = 0; i < e->npollers; i++) {
        close(e->pollers[i].kick_fd);
        close(e->pollers[i].epfd);
        pthread_mutex_destroy(&e->pollers[i].qmu);
        free(e->pollers[i].stash);
    }
    if (e->nl_fd >= 0) close(e->nl_fd);
    free(e->ring);
    free(e->groups);
    free(e->cslots);
    free(e->watches);
    pthread_mutex_destroy(&e->watch_mu);
    pthread_mutex_destroy(&e->fine_mu);
    pthread_mutex_destroy(&e->ring_mu);
    pthread_mutex_destroy(&e->groups_mu);
    pthread_mutex_destroy(&e->cnt_mu);
    pthread_mutex_destroy(&e->mr_mu);
    pthread_mutex_destroy(&e->dmu);
    free(e);
}

int aio_engine_set_hand_posts(aio_engine *e, int mode) {
    if (mode < -1 || mode > 1) return -FI_EINVAL;
    atomic_store(&e->hand_posts, mode);
    return 0;
}
