/* Watched words: 64-bit words in memory whose changes become records.
 *
 * Theory of operation. Some completions are not libfabric's: GPU completion flags and the UVM
 * watcher's slots are 64-bit words that change in memory, and nothing signals the change. So
 * they are read: while at least one
 * word is watched, poller 0 reads every watched word after each of its passes (and the loop
 * thread in aio_poll_ring after each of its own), and pushes one AIO_REC_WATCH record (the
 * watch's token, the new value) for each word that differs from the last value seen. So a
 * poller with watches sleeps at most cfg.watch_us at a time (poller.c); an engine with none
 * sleeps fully. A word written by this process (aio_word_store) kicks poller 0, which reads it
 * at once.
 *
 * The table is AIO_MAX_WATCHES slots, allocated at the first watch, under watch_mu, which the
 * reader holds through its whole pass: aio_watch_remove returns only once no pass reads the
 * word any more, so the caller may unmap it then. watch_hi bounds the slots in use, and nwatch
 * (read without the lock) says whether there is anything to read at all. A record is pushed
 * under watch_mu (watch_mu -> ring_mu: internal.h).
 *
 * Credit lanes. A lane (aio_lane_add) is a watched word too: its head, the count of credits a
 * peer's GPU stream has published into memory shared with this process (the CUDA-IPC rail:
 * the copy, then one kernel storing the entry and the head). A changed head is not a record:
 * the reader adds each new entry's credits to its counter (aio_counter_add: cnt_mu, then the
 * counter's record pushed after it) and advances the lane's DONE word, which the producer
 * reads before it reuses an entry. So a credit costs the reader one read of the head per
 * pass, and no message, no record of its own and no loop wake-up beyond the waiter's. While
 * a task awaits a counter (ncwant) and lanes are read, the poller reads them every LANE_WAIT_US
 * at least (poller.c): such a credit is what the task most likely awaits. Lanes alone keep no
 * poller from its long sleep: an engine with lanes and nothing awaited costs what it did.
 *
 * Expected changes. The GPU side knows roughly when a copy it enqueued ends (its bytes over
 * the link's rate, after the work already on that stream) and says so (aio_watch_soon): in
 * that window poller 0 reads every WATCH_FINE_US, and before it sleeps until the window
 * opens (at most watch_us). So a copy of milliseconds is seen done within microseconds,
 * where watch_us alone would add up to a whole interval. */
#include "internal.h"

#include "poller.h"
#include "ring.h"
#include "watch.h"

uint64_t aio_word_load(const volatile uint64_t *word) {
    return __atomic_load_n((const uint64_t *)word, __ATOMIC_ACQUIRE);
}

void aio_word_store(aio_engine *e, volatile uint64_t *word, uint64_t value) {
    __atomic_store_n((uint64_t *)word, value, __ATOMIC_RELEASE);
    aio__kick_watcher(e);
}

/* Adds a watch (lane: a credit lane whose head is `word`, or NULL); returns its id. */
static int watch_add(aio_engine *e, const volatile uint64_t *word, uint64_t last, uint64_t token,
                     volatile uint64_t *lane, uint32_t entries) {
    if (!word || ((uintptr_t)word & 7)) return -FI_EINVAL;
    pthread_mutex_lock(&e->watch_mu);
    if (!e->watches) {
        e->watches = calloc(AIO_MAX_WATCHES, sizeof(watch_slot));
        if (!e->watches) {
            pthread_mutex_unlock(&e->watch_mu);
            return -FI_ENOMEM;
        }
    }
    int id = -1;
    for (int i = 0; i < AIO_MAX_WATCHES; i++)
        if (!e->watches[i].word) {
            id = i;
            break;
        }
    if (id < 0) {
        pthread_mutex_unlock(&e->watch_mu);
        return -FI_ENOSPC;
    }
    e->watches[id].word = word;
    e->watches[id].last = last;
    e->watches[id].token = token;
    e->watches[id].lane = lane;
    e->watches[id].entries = entries;
    if (id >= e->watch_hi) e->watch_hi = id + 1;
    atomic_fetch_add(&e->nwatch, 1);
    if (lane) atomic_fetch_add(&e->nlane, 1);
    pthread_mutex_unlock(&e->watch_mu);
    aio__kick_watcher(e); /* a sleeping poller must start reading it */
    return id;
}

int aio_watch_add(aio_engine *e, const volatile uint64_t *word, uint64_t last, uint64_t token) {
    return watch_add(e, word, last, token, NULL, 0);
}

int aio_lane_add(aio_engine *e, volatile uint64_t *lane, uint32_t entries) {
    if (!lane || ((uintptr_t)lane & 7) || entries == 0 || entries > AIO_LANE_MAX) return -FI_EINVAL;
    uint64_t head = __atomic_load_n((uint64_t *)&lane[AIO_LANE_HEAD], __ATOMIC_ACQUIRE);
    __atomic_store_n((uint64_t *)&lane[AIO_LANE_DONE], head, __ATOMIC_RELEASE);
    int id = watch_add(e, &lane[AIO_LANE_HEAD], head, 0, lane, entries);
    if (id < 0) return id;
    __atomic_store_n((uint64_t *)&lane[AIO_LANE_OPEN], 1, __ATOMIC_RELEASE);
    return id;
}

/* Credits a lane's entries [w->last, head) and hands them back to the producer (DONE). */
static int lane_drain(aio_engine *e, watch_slot *w, uint64_t head) {
    volatile uint64_t *b = w->lane;
    uint64_t from = w->last;
    if (head - from > w->entries) from = head - w->entries; /* overrun: a producer's bug */
    for (uint64_t s = from; s < head; s++) {
        uint64_t ent = __atomic_load_n((uint64_t *)&b[AIO_LANE_ENTRY + s % w->entries], __ATOMIC_ACQUIRE);
        aio_counter_add(e, (uint32_t)(ent >> 32), (ent & 0xffffffffULL) * AIO_CREDIT_UNIT);
    }
    w->last = head;
    __atomic_store_n((uint64_t *)&b[AIO_LANE_DONE], head, __ATOMIC_RELEASE);
    return (int)(head - from);
}

int aio_watch_remove(aio_engine *e, int id) {
    if (id < 0 || id >= AIO_MAX_WATCHES) return -FI_EINVAL;
    pthread_mutex_lock(&e->watch_mu);
    if (!e->watches || !e->watches[id].word) {
        pthread_mutex_unlock(&e->watch_mu);
        return -FI_EINVAL;
    }
    if (e->watches[id].lane) atomic_fetch_sub(&e->nlane, 1);
    e->watches[id].word = NULL;
    e->watches[id].lane = NULL;
    while (e->watch_hi > 0 && !e->watches[e->watch_hi - 1].word) e->watch_hi--;
    atomic_fetch_sub(&e->nwatch, 1);
    pthread_mutex_unlock(&e->watch_mu);
    return 0;
}

void aio_watch_soon(aio_engine *e, int64_t after_ns, int64_t window_ns) {
    if (after_ns < 0) after_ns = 0;
    if (window_ns < 0) window_ns = 0;
    int64_t now = now_ns(), from = now + after_ns, until = from + window_ns;
    /* writers one at a time (fine_mu, their own: not watch_mu, which poller 0 holds while it
     * reads the words, every few microseconds in a window; it reads these two without a
     * lock); a window still to come or under way merges with this one into one (the earliest
     * start, the latest end), one already over is replaced. The end is stored first, so a
     * reader that sees the new start never pairs it with an old end that is over. */
    pthread_mutex_lock(&e->fine_mu);
    int64_t f = atomic_load(&e->fine_from), u = atomic_load(&e->fine_until);
    int open = u > now;
    atomic_store(&e->fine_until, open && u > until ? u : until);
    atomic_store(&e->fine_from, open && f < from ? f : from);
    pthread_mutex_unlock(&e->fine_mu);
}

/* Reads every watched word; one record per change. Returns the number of changes. */
int aio__poll_watches(aio_engine *e) {
    if (atomic_load_explicit(&e->nwatch, memory_order_relaxed) == 0) return 0;
    int got = 0;
    pthread_mutex_lock(&e->watch_mu);
    for (int i = 0; i < e->watch_hi; i++) {
        watch_slot *w = &e->watches[i];
        if (!w->word) continue;
        uint64_t v = __atomic_load_n((const uint64_t *)w->word, __ATOMIC_ACQUIRE);
        if (v == w->last) continue;
        if (w->lane) {
            got += lane_drain(e, w, v);
            continue;
        }
        w->last = v;
        aio_record rec = {.kind = AIO_REC_WATCH, .token = w->token, .a = v};
        aio__ring_push(e, &rec);
        got++;
    }
    pthread_mutex_unlock(&e->watch_mu);
    return got;
}
