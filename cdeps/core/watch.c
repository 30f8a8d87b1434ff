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
 * under watch_mu (watch_mu -> ring_mu: internal.h). */
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

int aio_watch_add(aio_engine *e, const volatile uint64_t *word, uint64_t last, uint64_t token) {
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
    if (id >= e->watch_hi) e->watch_hi = id + 1;
    atomic_fetch_add(&e->nwatch, 1);
    pthread_mutex_unlock(&e->watch_mu);
    aio__kick_watcher(e); /* a sleeping poller must start reading it */
    return id;
}

int aio_watch_remove(aio_engine *e, int id) {
    if (id < 0 || id >= AIO_MAX_WATCHES) return -FI_EINVAL;
    pthread_mutex_lock(&e->watch_mu);
    if (!e->watches || !e->watches[id].word) {
        pthread_mutex_unlock(&e->watch_mu);
        return -FI_EINVAL;
    }
    e->watches[id].word = NULL;
    while (e->watch_hi > 0 && !e->watches[e->watch_hi - 1].word) e->watch_hi--;
    atomic_fetch_sub(&e->nwatch, 1);
    pthread_mutex_unlock(&e->watch_mu);
    return 0;
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
        w->last = v;
        aio_record rec = {.kind = AIO_REC_WATCH, .token = w->token, .a = v};
        aio__ring_push(e, &rec);
        got++;
    }
    pthread_mutex_unlock(&e->watch_mu);
    return got;
}
