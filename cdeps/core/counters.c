/* Immediate counters: credits that remote writes carry in their CQ data.
 *
 * Theory of operation. A writer tells its target that bytes are placed by a 32-bit immediate
 * (remote CQ data) rather than by a message: the target's provider reports it with the write's
 * completion, after the bytes. completion.c turns each such completion into credits of counter
 * `imm` (AIO_CREDIT_UNIT for a whole write; a shard of a striped or gathered write carries its
 * share in the upper 32 bits, so the shards of one logical write add up to one unit), and tasks
 * of the loop take them (aio_counter_take) or wait for them (aio_counter_watch). Counters live
 * in an open-addressing hash table keyed by imm (linear probing, doubled when half full,
 * deleted by shifting the cluster back), all under cnt_mu: a credit is one lookup and an add,
 * made by a poller thread (or a thread driving a rail), and contention is with the loop's
 * takes only.
 *
 * A counter holds at most one armed watch: `want` units. The credit that reaches it clears
 * the watch and pushes one AIO_REC_COUNTER record (after cnt_mu is let go: the ring's lock is
 * never taken under it), so a waiting task is woken exactly when it can take. `nwant` counts
 * armed watches, and aio_waiters_add adds tasks awaiting a message: while it is not zero a
 * sleeping poller polls rails without a wait object (shm) every 50 us instead of every
 * millisecond (poller.c). A task that starts to await a message also kicks the poller of the
 * rail the last message came in on (its spin restarts: a stream of messages is read without a
 * sleep and a wake-up per message), and only that one: kicking every poller (two per engine on
 * tcp by default, streams=2) kept pollers spinning that no message would come through, and on
 * 2 vCPUs with two processes ping-ponging they took the CPUs the event loops needed (send/recv
 * one-way p50 38-139 us against 36-40 us). */
#include "internal.h"

#include "poller.h"
#include "ring.h"

/* An armed watch more or fewer: counted in nwant (with the tasks awaiting a message) and in
 * ncwant (watches alone: credit lanes, poller.c). Caller holds cnt_mu. */
static inline void watches_add(aio_engine *e, int32_t delta) {
    atomic_fetch_add(&e->nwant, delta);
    atomic_fetch_add(&e->ncwant, delta);
}

static inline uint32_t hash32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

static cslot *counter_find(aio_engine *e, uint32_t imm, int create) {
    uint32_t mask = e->ccap - 1;
    uint32_t i = hash32(imm) & mask;
    for (;;) {
        cslot *s = &e->cslots[i];
        if (!s->used) break;
        if (s->imm == imm) return s;
        i = (i + 1) & mask;
    }
    if (!create) return NULL;
    if ((e->cused + 1) * 2 > e->ccap) {
        uint32_t ncap = e->ccap * 2;
        cslot *ns = calloc(ncap, sizeof(cslot));
        if (!ns) return NULL;
        for (uint32_t k = 0; k < e->ccap; k++) {
            if (!e->cslots[k].used) continue;
            uint32_t j = hash32(e->cslots[k].imm) & (ncap - 1);
            while (ns[j].used) j = (j + 1) & (ncap - 1);
            ns[j] = e->cslots[k];
        }
        free(e->cslots);
        e->cslots = ns;
        e->ccap = ncap;
        mask = ncap - 1;
    }
    uint32_t i2 = hash32(imm) & mask;
    while (e->cslots[i2].used) i2 = (i2 + 1) & mask;
    cslot *s = &e->cslots[i2];
    memset(s, 0, sizeof(*s));
    s->used = 1;
    s->imm = imm;
    e->cused++;
    return s;
}

/* Adds credits (a refund does not count towards the total received) and fires the
 * armed watch once it is satisfied. */
static void counter_credit(aio_engine *e, uint32_t imm, uint64_t units, int received) {
    int fire = 0;
    pthread_mutex_lock(&e->cnt_mu);
    cslot *s = counter_find(e, imm, 1);
    if (s) {
        s->avail += units;
        if (received) s->total += units;
        if (s->want && s->avail >= s->want) {
            s->want = 0;
            watches_add(e, -1);
            fire = 1;
        }
    }
    pthread_mutex_unlock(&e->cnt_mu);
    if (fire) {
        aio_record r = {0};
        r.kind = AIO_REC_COUNTER;
        r.token = imm;
        r.rail = -1;
        aio__ring_push(e, &r);
    }
}

void aio_counter_add(aio_engine *e, uint32_t imm, uint64_t units) { counter_credit(e, imm, units, 1); }

int aio_counter_take(aio_engine *e, uint32_t imm, uint64_t units) {
    int ok = 0;
    pthread_mutex_lock(&e->cnt_mu);
    cslot *s = counter_find(e, imm, 0);
    if (units == 0) ok = 1;
    else if (s && s->avail >= units) {
        s->avail -= units;
        ok = 1;
    }
    pthread_mutex_unlock(&e->cnt_mu);
    return ok;
}

int aio_counter_release(aio_engine *e, uint32_t imm) {
    pthread_mutex_lock(&e->cnt_mu);
    cslot *s = counter_find(e, imm, 0);
    if (!s) {
        pthread_mutex_unlock(&e->cnt_mu);
        return 0;
    }
    if (s->want) {
        pthread_mutex_unlock(&e->cnt_mu);
        return -FI_EBUSY;
    }
    /* linear probing: delete by shifting later entries of the cluster back */
    uint32_t mask = e->ccap - 1;
    uint32_t i = (uint32_t)(s - e->cslots);
    uint32_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!e->cslots[j].used) break;
        uint32_t home = hash32(e->cslots[j].imm) & mask;
        /* entry j may move to i if its home is not cyclically in (i, j] */
        int in_range = (i <= j) ? (home > i && home <= j) : (home > i || home <= j);
        if (!in_range) {
            e->cslots[i] = e->cslots[j];
            i = j;
        }
    }
    memset(&e->cslots[i], 0, sizeof(cslot));
    e->cused--;
    pthread_mutex_unlock(&e->cnt_mu);
    return 1;
}

int aio_counter_watch(aio_engine *e, uint32_t imm, uint64_t units) {
    int ready = 0;
    pthread_mutex_lock(&e->cnt_mu);
    cslot *s = counter_find(e, imm, 1);
    if (!s) ready = -FI_ENOMEM;
    else if (s->avail >= units) {
        if (s->want) watches_add(e, -1);
        s->want = 0;
        ready = 1;
    } else {
        if (!s->want) watches_add(e, 1);
        s->want = units;
    }
    pthread_mutex_unlock(&e->cnt_mu);
    /* credit lanes are read: the poller reads them more often now (poller.c) */
    if (ready == 0 && atomic_load(&e->nlane) > 0) aio__kick_watcher(e);
    return ready;
}

#ifdef AIO_TEST_HOOKS
/* tests: the kicks poller `q` was given (its post_seq), and the rail of the last message */
uint64_t aio_test_kicks(aio_engine *e, int q) { return atomic_load(&e->pollers[q].post_seq); }
int32_t aio_test_msg_rail(aio_engine *e) { return atomic_load(&e->msg_rail); }
#endif

void aio_waiters_add(aio_engine *e, int32_t delta) {
    /* the poller the next message most likely comes through (see above): its spin restarts */
    if (atomic_fetch_add(&e->nwant, delta) + delta > 0)
        aio__kick_rails(e, 1u << atomic_load_explicit(&e->msg_rail, memory_order_relaxed));
}

void aio_counter_refund(aio_engine *e, uint32_t imm, uint64_t units) {
    counter_credit(e, imm, units, 0);
}

uint64_t aio_counter_available(aio_engine *e, uint32_t imm) {
    pthread_mutex_lock(&e->cnt_mu);
    cslot *s = counter_find(e, imm, 0);
    uint64_t v = s ? s->avail : 0;
    pthread_mutex_unlock(&e->cnt_mu);
    return v;
}

uint64_t aio_counter_total(aio_engine *e, uint32_t imm) {
    pthread_mutex_lock(&e->cnt_mu);
    cslot *s = counter_find(e, imm, 0);
    uint64_t v = s ? s->total : 0;
    pthread_mutex_unlock(&e->cnt_mu);
    return v;
}
