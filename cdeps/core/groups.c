/* Groups: a set of work requests that finishes as one AIO_REC_GROUP record.
 *
 * Theory of operation. A transfer is many requests (stripes over rails, pages, shards), and
 * the loop wants to learn once that all of it is done, with the first error if any: one record
 * and one wake-up per transfer rather than per request. A group is a slot of a fixed table
 * (cfg.max_groups), taken from a free list under groups_mu by aio_group_open and given back
 * when its record is pushed. Requests are posted into it over one or several calls
 * (aio_post, aio_post_paged, aio_post_sendv, from the posting thread), complete on whatever
 * thread reads their completion (a poller, or a posting thread driving its rail), and
 * aio_group_seal says no more will come. No lock is taken on that path: `outstanding` is
 * posted - done, plus one until sealed, and whichever thread brings it to zero finishes the
 * group (one atomic decides, so a stale read of a slot already reused cannot finish it twice;
 * `finished` is a second guard). The first failing request's status is kept (a compare and
 * swap on `status`). A group whose requests all completed on the posting thread before it was
 * sealed (a small shm message: the provider completes it as it takes it) may end in the seal
 * without a record (aio__group_seal_inline): the caller learns its status from the call, and
 * the loop is not woken for it. A quiet group (aio_submit_quiet, aio_group_quiet) pushes its record
 * without waking the loop: see ring.c. */
#include "internal.h"

#include "groups.h"
#include "ring.h"

int64_t aio_group_open(aio_engine *e, uint64_t token) {
    pthread_mutex_lock(&e->groups_mu);
    int32_t g = e->groups_free;
    if (g >= 0) {
        aio_group *gr = &e->groups[g];
        e->groups_free = gr->next_free;
        gr->in_use = 1;
        gr->token = token;
        atomic_store(&gr->posted, 0);
        atomic_store(&gr->done, 0);
        atomic_store(&gr->outstanding, 1);
        atomic_store(&gr->status, 0);
        atomic_store(&gr->prov_errno, 0);
        atomic_store(&gr->sealed, 0);
        atomic_store(&gr->finished, 0);
        gr->quiet = 0;
    }
    pthread_mutex_unlock(&e->groups_mu);
    return g >= 0 ? (int64_t)g : -FI_EAGAIN;
}

/* gives slot g back to the free list */
static void group_free(aio_engine *e, aio_group *gr, int64_t g) {
    pthread_mutex_lock(&e->groups_mu);
    gr->in_use = 0;
    gr->next_free = e->groups_free;
    e->groups_free = (int32_t)g;
    pthread_mutex_unlock(&e->groups_mu);
}

/* Pushes the record of g, whose `finished` the caller took, and frees its slot. */
static void group_record(aio_engine *e, int64_t g) {
    aio_group *gr = &e->groups[g];
    aio_record r = {0};
    r.kind = AIO_REC_GROUP;
    r.token = gr->token;
    r.status = atomic_load(&gr->status);
    r.prov_errno = atomic_load(&gr->prov_errno);
    r.a = (uint64_t)atomic_load(&gr->done);
    r.rail = -1;
    int quiet = gr->quiet; /* (read before the slot may be reused) */
    group_free(e, gr, g);
    aio__ring_put(e, &r, quiet);
}

/* Takes g's `finished`: 1 for the one caller that brings it to its end, 0 for any other. */
static int take_finished(aio_group *gr) {
    int expect = 0;
    return atomic_compare_exchange_strong(&gr->finished, &expect, 1) ? 1 : 0;
}

static void group_finish(aio_engine *e, int64_t g) {
    if (take_finished(&e->groups[g])) group_record(e, g);
}

void aio__group_op_done(aio_engine *e, int64_t g, int status, int prov_errno) {
    if (g < 0) return;
    aio_group *gr = &e->groups[g];
    if (status) {
        int32_t z = 0;
        if (atomic_compare_exchange_strong(&gr->status, &z, status))
            atomic_store(&gr->prov_errno, prov_errno);
    }
    atomic_fetch_add(&gr->done, 1);
    if (atomic_fetch_sub(&gr->outstanding, 1) == 1) group_finish(e, g);
}

/* Seals g: 1 when this brought it to its end (every request done; `finished` taken), 0 when a
 * completion ends it later, -FI_EINVAL when g is not open or already sealed. */
static int seal(aio_engine *e, int64_t g) {
    if (g < 0 || (uint32_t)g >= e->cfg.max_groups || !e->groups[g].in_use) return -FI_EINVAL;
    aio_group *gr = &e->groups[g];
    int32_t unsealed = 0;
    if (!atomic_compare_exchange_strong(&gr->sealed, &unsealed, 1)) return -FI_EINVAL;
    if (atomic_fetch_sub(&gr->outstanding, 1) != 1) return 0;
    return take_finished(gr);
}

int aio_group_seal(aio_engine *e, int64_t g) {
    int rc = seal(e, g);
    if (rc == 1) group_record(e, g);
    return rc < 0 ? rc : 0;
}

int aio__group_seal_inline(aio_engine *e, int64_t g, int32_t *status, int32_t *prov_errno) {
    int rc = seal(e, g);
    if (rc != 1) return rc;
    aio_group *gr = &e->groups[g];
    *status = atomic_load(&gr->status);
    *prov_errno = atomic_load(&gr->prov_errno);
    group_free(e, gr, g);
    return 1;
}

int64_t aio_group_pending(aio_engine *e, int64_t g) {
    if (g < 0 || (uint32_t)g >= e->cfg.max_groups) return -FI_EINVAL;
    return atomic_load(&e->groups[g].posted) - atomic_load(&e->groups[g].done);
}

int64_t aio_ops_in_flight(aio_engine *e) { return atomic_load(&e->ops_in_flight); }
int aio__group_postable(aio_engine *e, int64_t g) {
    return g >= 0 && (uint32_t)g < e->cfg.max_groups && e->groups[g].in_use &&
           !atomic_load(&e->groups[g].sealed);
}

int aio_group_quiet(aio_engine *e, int64_t g, int quiet) {
    if (g < 0 || (uint32_t)g >= e->cfg.max_groups || !e->groups[g].in_use || atomic_load(&e->groups[g].sealed))
        return -FI_EINVAL;
    e->groups[g].quiet = quiet ? 1 : 0;
    return 0;
}
