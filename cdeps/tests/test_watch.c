/* Watched words: a store to a registered word becomes a counter record (aio_watch), the
 * hint that shortens the watch (aio_watch_soon), credit lanes. */
#include "harness.h"

/* ------------------------------------------------------------------ watched words */

typedef struct storer {
    aio_engine *e;
    volatile uint64_t *word;
    int n;
} storer_t;

static void *store_thread(void *arg) {
    storer_t *st = arg;
    for (int i = 1; i <= st->n; i++) {
        __atomic_store_n((uint64_t *)st->word, (uint64_t)i, __ATOMIC_RELEASE);
        sleep_us(5000); /* far slower than the poller's watch interval: most values are seen even on a busy VM */
    }
    return NULL;
}

int t_watch(fix_t *f) {
    eng_t *x = &f->a;
    static uint64_t words[3] __attribute__((aligned(8)));
    memset(words, 0, sizeof(words));
    CHECK(aio_watch_add(x->e, (const volatile uint64_t *)((char *)words + 4), 0, 1) == -FI_EINVAL,
          "a misaligned word was accepted");
    int id0 = aio_watch_add(x->e, &words[0], 0, 77);
    int id1 = aio_watch_add(x->e, &words[1], 5, 78);
    CHECK(id0 >= 0 && id1 >= 0 && id0 != id1, "aio_watch_add: %d %d", id0, id1);
    /* words[1] starts at 0 but the caller said it knew 5: the difference is reported */
    aio_record rec;
    CHECK(wait_rec(x, AIO_REC_WATCH, 78, 2.0, &rec) == 0, "no record for a word that differs");
    CHECK(rec.a == 0, "value %llu", (unsigned long long)rec.a);
    /* a GPU-like writer (another thread, no kick): every store seen, in order */
    storer_t st = {.e = x->e, .word = &words[0], .n = 20};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, store_thread, &st) == 0, "pthread_create");
    uint64_t last = 0;
    int seen = 0;
    double t0 = now_s();
    while (last < 20 && now_s() - t0 < 5.0) {
        if (wait_rec(x, AIO_REC_WATCH, 77, 5.0, &rec) != 0) break;
        CHECK(rec.a > last, "values out of order: %llu after %llu", (unsigned long long)rec.a,
              (unsigned long long)last);
        last = rec.a;
        seen++;
    }
    pthread_join(th, NULL);
    CHECK(last == 20, "last value seen %llu", (unsigned long long)last);
    CHECK(seen >= 10, "only %d of 20 changes reported", seen);
    /* host-side store: reported too */
    aio_word_store(x->e, &words[1], 9);
    CHECK(wait_rec(x, AIO_REC_WATCH, 78, 2.0, &rec) == 0 && rec.a == 9, "host store not reported");
    /* removed: no more records */
    CHECK_OK(aio_watch_remove(x->e, id0));
    CHECK(aio_watch_remove(x->e, id0) == -FI_EINVAL, "double remove accepted");
    words[0] = 1000;
    sleep_us(50000);
    pump(x);
    CHECK(count_rec(x, AIO_REC_WATCH, 77) == 0, "a removed watch still reported");
    CHECK(aio_word_load(&words[0]) == 1000, "aio_word_load");
    /* an armed watch with no change: the poller sleeps between reads (at most one read per
     * watch interval, 100 us by default), it does not spin */
    sleep_us(300000);
    aio_stats s0, s1;
    aio_get_stats(x->e, &s0);
    double c0 = cpu_s(), w0 = now_s();
    sleep_us(1000000);
    double dt = now_s() - w0;
    double pct = 100.0 * (cpu_s() - c0) / dt;
    aio_get_stats(x->e, &s1);
    double polls = (double)(s1.polls - s0.polls) / dt;
    printf("    (one armed watch, no change: %.2f%% CPU, %.0f polls/s, %.0f sleeps/s)\n", pct, polls,
           (double)(s1.sleeps - s0.sleeps) / dt);
    CHECK(polls < 15000, "the poller read %.0f times a second: it spins", polls);
    CHECK(pct < 40.0, "an armed watch cost %.2f%% CPU", pct);
    CHECK_OK(aio_watch_remove(x->e, id1));
    return 0;
}

/* Median of `n` latencies (ms) from a plain store into a watched word (no kick, as a GPU's) to
 * its record; `hint_ms` >= 0: each store is made inside a window announced with aio_watch_soon
 * that long before (the poller takes the hint at its next wake-up, within watch_us). */
static double store_to_record_ms(eng_t *x, volatile uint64_t *word, uint64_t token, int n, int hint_ms) {
    double lat[16];
    if (n > 16) n = 16;
    for (int i = 0; i < n; i++) {
        if (hint_ms >= 0) {
            aio_watch_soon(x->e, (int64_t)hint_ms * 1000000, 20 * 1000000LL);
            sleep_us((long)hint_ms * 1000 + 2000);
        } else {
            sleep_us(7000 + 3000 * i); /* anywhere in the poller's long steps */
        }
        __atomic_store_n((uint64_t *)word, (uint64_t)(i + 1), __ATOMIC_RELEASE);
        double t0 = now_s();
        aio_record rec;
        if (wait_rec(x, AIO_REC_WATCH, token, 2.0, &rec) != 0) return -1.0;
        lat[i] = (now_s() - t0) * 1e3;
    }
    for (int i = 1; i < n; i++) /* insertion sort: n is small */
        for (int j = i; j > 0 && lat[j] < lat[j - 1]; j--) {
            double t = lat[j];
            lat[j] = lat[j - 1];
            lat[j - 1] = t;
        }
    return lat[n / 2];
}

/* aio_watch_soon: with a 50 ms watch interval, a store outside any window is seen at the poller's
 * next long step (median of 5 well past 3 ms); inside a window announced with a hint (the
 * completion a GPU copy should reach then) it is seen within the fine steps' microseconds; once
 * the window is over the poller goes back to its long steps (it does not spin). */
int t_watch_soon(fix_t *f) {
    eng_t x;
    g_watch_us = 50000;
    int ret = eng_init(&x, f->prov, f->nic, 0);
    g_watch_us = 0;
    if (ret) return ret;
    static uint64_t word __attribute__((aligned(8)));
    word = 0;
    int id = aio_watch_add(x.e, &word, 0, 91);
    CHECK(id >= 0, "aio_watch_add: %d", id);
    sleep_us(100000); /* past the spin after the add's kick */
    double slow = store_to_record_ms(&x, &word, 91, 5, -1);
    double fast = store_to_record_ms(&x, &word, 91, 5, 60);
    printf("    (store to record, median of 5: %.2f ms without a hint, %.3f ms inside a window)\n", slow, fast);
    CHECK(slow > 3.0, "without a hint a store was seen in %.2f ms: the poller reads too often", slow);
    CHECK(fast >= 0 && fast < 3.0, "inside a window a store took %.2f ms to be seen", fast);
    sleep_us(100000); /* the last window (20 ms) is over */
    aio_stats s0, s1;
    aio_get_stats(x.e, &s0);
    double w0 = now_s();
    sleep_us(500000);
    aio_get_stats(x.e, &s1);
    double polls = (double)(s1.polls - s0.polls) / (now_s() - w0);
    CHECK(polls < 500, "after the window the poller read %.0f times a second", polls);
    CHECK_OK(aio_watch_remove(x.e, id));
    eng_free(&x);
    return 0;
}

/* Credit lanes: entries published by another thread (as a GPU stream would, no kick) are
 * credited to their counters, DONE follows the head, a waiting counter's record fires. */
int t_lane(fix_t *f) {
    eng_t *x = &f->a;
    const uint32_t n = 4;
    static uint64_t lane[AIO_LANE_ENTRY + 4] __attribute__((aligned(8)));
    memset(lane, 0, sizeof(lane));
    CHECK(aio_lane_add(x->e, lane, 0) == -FI_EINVAL, "a lane of 0 entries was accepted");
    int id = aio_lane_add(x->e, lane, n);
    CHECK(id >= 0, "aio_lane_add: %d", id);
    CHECK(aio_word_load(&lane[AIO_LANE_OPEN]) == 1, "OPEN not set");
    uint32_t imm = 0x5150;
    CHECK(aio_counter_watch(x->e, imm, 7 * U) == 0, "watch on an empty counter");
    /* 6 credits, past the 4 entries: the producer waits for DONE before reusing an entry */
    for (uint64_t s = 0; s < 6; s++) {
        double t0 = now_s();
        while (s - aio_word_load(&lane[AIO_LANE_DONE]) >= n && now_s() - t0 < 5.0) sleep_us(100);
        CHECK(s - aio_word_load(&lane[AIO_LANE_DONE]) < n, "DONE never advanced");
        uint64_t w = s == 5 ? 2 : 1; /* the last one worth 2 (a paged write of 2 pages) */
        __atomic_store_n(&lane[AIO_LANE_ENTRY + s % n], ((uint64_t)imm << 32) | w, __ATOMIC_RELEASE);
        __atomic_store_n(&lane[AIO_LANE_HEAD], s + 1, __ATOMIC_RELEASE);
    }
    aio_record rec;
    CHECK(wait_rec(x, AIO_REC_COUNTER, imm, 5.0, &rec) == 0, "the counter's watch did not fire");
    CHECK(aio_counter_available(x->e, imm) == 7 * U, "credits: %llu",
          (unsigned long long)aio_counter_available(x->e, imm));
    CHECK(aio_word_load(&lane[AIO_LANE_DONE]) == 6, "DONE %llu", (unsigned long long)lane[AIO_LANE_DONE]);
    CHECK(count_rec(x, AIO_REC_WATCH, ANY) == 0, "a lane pushed a watch record");
    CHECK_OK(aio_watch_remove(x->e, id));
    __atomic_store_n(&lane[AIO_LANE_ENTRY + 6 % n], ((uint64_t)imm << 32) | 1, __ATOMIC_RELEASE);
    __atomic_store_n(&lane[AIO_LANE_HEAD], 7, __ATOMIC_RELEASE);
    sleep_us(50000);
    CHECK(aio_counter_available(x->e, imm) == 7 * U, "a removed lane was still read");
    return 0;
}
