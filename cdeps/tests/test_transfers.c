/* Transfers between two engines of one process: writes of every size, immediates and their
 * weights, counters, reads, messages, large batches, racing groups, paged writes, invalid
 * posts, regions closed while busy. */
#include "harness.h"

int t_write_sizes(fix_t *f) {
    static const uint64_t sizes[] = {1,    2,     3,     7,     63,    64,      65,
                                     4095, 4096,  4097,  65535, 65536, 65537,   MiB - 1,
                                     MiB,  MiB + 7, 4 * MiB, 16 * MiB};
    eng_t *a = &f->a, *b = &f->b;
    for (unsigned i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        uint64_t len = sizes[i];
        uint64_t loff = (i * 13u) % 4096;
        uint64_t roff = (i * 29u + 5u) % 4096 + 1;
        uint32_t seed = 0x100 + i, imm = 0x1000 + i;
        fill(a->buf + loff, len, 0, seed);
        memset(b->buf + roff - 1, 0xEE, len + 2);
        aio_op_desc d = op_to(a, b, AIO_OP_WRITE, loff, roff, len, AIO_F_DATA, imm);
        if (run_group(a, &d, 1, NULL)) return -1;
        CHECK(wait_take(b, imm, U, TIMEOUT) == 0, "size %llu: no credit at the receiver",
              (unsigned long long)len);
        int64_t bad = verify(b->buf + roff, len, 0, seed);
        CHECK(bad < 0, "size %llu at offset %llu->%llu: byte %lld differs",
              (unsigned long long)len, (unsigned long long)loff, (unsigned long long)roff,
              (long long)bad);
        CHECK(b->buf[roff - 1] == 0xEE && b->buf[roff + len] == 0xEE,
              "size %llu: bytes outside the target range were written", (unsigned long long)len);
        CHECK(aio_counter_available(b->e, imm) == 0 && aio_counter_total(b->e, imm) == U,
              "size %llu: counter avail %llu total %llu", (unsigned long long)len,
              (unsigned long long)aio_counter_available(b->e, imm),
              (unsigned long long)aio_counter_total(b->e, imm));
    }
    CHECK(aio_mr_inflight(a->mr) == 0, "inflight %lld", (long long)aio_mr_inflight(a->mr));
    return 0;
}

int t_zero_byte_imm(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    uint32_t imm = 0x2000;
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 0, 0, AIO_F_DATA, imm);
    if (run_group(a, &d, 1, NULL)) return -1;
    CHECK(wait_total(b, imm, U, TIMEOUT) == 0, "0-byte write: no credit");
    sleep_us(20000);
    CHECK(aio_counter_total(b->e, imm) == U && aio_counter_available(b->e, imm) == U,
          "0-byte write credited %llu, want %llu", (unsigned long long)aio_counter_total(b->e, imm),
          (unsigned long long)U);
    /* three more, in one group */
    aio_op_desc ds[3] = {d, d, d};
    if (run_group(a, ds, 3, NULL)) return -1;
    CHECK(wait_take(b, imm, 4 * U, TIMEOUT) == 0, "0-byte writes: credits missing");
    CHECK(aio_counter_available(b->e, imm) == 0, "leftover credit");
    return 0;
}

int t_weight(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    CHECK(a->info.cq_data_size >= 8 && b->info.cq_data_size >= 8,
          "cq_data_size %u: no room for a weight field", b->info.cq_data_size);
    uint32_t imm = 0x2100;
    uint64_t w1 = 12345, w2 = U - w1;
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 64, 8, AIO_F_DATA, imm | (w1 << 32));
    if (run_group(a, &d, 1, NULL)) return -1;
    CHECK(wait_total(b, imm, w1, TIMEOUT) == 0, "weighted write: no credit");
    sleep_us(10000);
    CHECK(aio_counter_available(b->e, imm) == w1, "weight %llu credited %llu",
          (unsigned long long)w1, (unsigned long long)aio_counter_available(b->e, imm));
    CHECK(aio_counter_take(b->e, imm, U) == 0, "took a whole unit out of %llu",
          (unsigned long long)w1);
    d = op_to(a, b, AIO_OP_WRITE, 0, 64, 0, AIO_F_DATA, imm | (w2 << 32));
    if (run_group(a, &d, 1, NULL)) return -1;
    CHECK(wait_take(b, imm, U, TIMEOUT) == 0, "two shards did not add up to one unit");
    CHECK(aio_counter_available(b->e, imm) == 0 && aio_counter_total(b->e, imm) == U,
          "avail %llu total %llu", (unsigned long long)aio_counter_available(b->e, imm),
          (unsigned long long)aio_counter_total(b->e, imm));
    return 0;
}

int t_counters(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    uint32_t imm = 0x3000;
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 0, 0, AIO_F_DATA, imm);
    CHECK(aio_counter_available(b->e, imm) == 0 && aio_counter_total(b->e, imm) == 0, "fresh");
    CHECK(aio_counter_take(b->e, imm, 1) == 0, "took from an empty counter");
    CHECK(aio_counter_take(b->e, imm, 0) == 1, "taking 0 units must succeed");
    CHECK(aio_counter_watch(b->e, imm, 2 * U) == 0, "watch(2U) on an empty counter");
    if (run_group(a, &d, 1, NULL)) return -1;
    CHECK(wait_total(b, imm, U, TIMEOUT) == 0, "first credit");
    sleep_us(20000);
    pump(b);
    CHECK(count_rec(b, AIO_REC_COUNTER, imm) == 0, "watch fired at 1 of 2 units");
    if (run_group(a, &d, 1, NULL)) return -1;
    aio_record r;
    CHECK(wait_rec(b, AIO_REC_COUNTER, imm, TIMEOUT, &r) == 0, "watch did not fire");
    CHECK(r.status == 0 && r.token == imm, "record token %llu status %d",
          (unsigned long long)r.token, r.status);
    CHECK(aio_counter_available(b->e, imm) == 2 * U, "avail after watch");
    CHECK(aio_counter_take(b->e, imm, 2 * U) == 1, "take(2U)");
    CHECK(aio_counter_take(b->e, imm, 1) == 0, "took past zero");
    CHECK(aio_counter_total(b->e, imm) == 2 * U, "total");
    /* refund: back into available, not into total */
    aio_counter_refund(b->e, imm, U);
    CHECK(aio_counter_available(b->e, imm) == U && aio_counter_total(b->e, imm) == 2 * U,
          "refund: avail %llu total %llu", (unsigned long long)aio_counter_available(b->e, imm),
          (unsigned long long)aio_counter_total(b->e, imm));
    /* already satisfied: 1, nothing armed, no record */
    CHECK(aio_counter_watch(b->e, imm, U) == 1, "watch on a satisfied counter must return 1");
    sleep_us(10000);
    pump(b);
    CHECK(count_rec(b, AIO_REC_COUNTER, imm) == 0, "a satisfied watch pushed a record");
    /* a refund that satisfies a watch fires it */
    CHECK(aio_counter_watch(b->e, imm, 2 * U) == 0, "watch(2U) with U available");
    aio_counter_refund(b->e, imm, U);
    CHECK(wait_rec(b, AIO_REC_COUNTER, imm, TIMEOUT, &r) == 0, "refund did not fire the watch");
    CHECK(aio_counter_take(b->e, imm, 2 * U) == 1, "take after refund");
    /* a watch fires once: further credits push nothing */
    uint32_t imm2 = 0x3001;
    CHECK(aio_counter_watch(b->e, imm2, U) == 0, "watch imm2");
    aio_counter_add(b->e, imm2, U);
    CHECK(wait_rec(b, AIO_REC_COUNTER, imm2, TIMEOUT, NULL) == 0, "local add did not fire");
    aio_counter_add(b->e, imm2, U);
    d.data = imm2;
    if (run_group(a, &d, 1, NULL)) return -1;
    CHECK(wait_total(b, imm2, 3 * U, TIMEOUT) == 0, "imm2 credits");
    sleep_us(10000);
    pump(b);
    CHECK(count_rec(b, AIO_REC_COUNTER, imm2) == 0, "a watch fired twice");
    CHECK(aio_counter_take(b->e, imm2, 3 * U) == 1, "take imm2");
    /* counters of different imms do not mix */
    CHECK(aio_counter_available(b->e, imm) == 0 && aio_counter_available(b->e, imm2) == 0,
          "leftovers");
    CHECK(aio_counter_available(a->e, imm) == 0, "the writer got credits");
    return 0;
}

/* Releasing counters: many imms created and released keep the table consistent (probe
 * chains survive deletions), and a released counter starts again from zero. */
int t_counter_release(fix_t *f) {
    eng_t *b = &f->b;
    for (uint32_t k = 0; k < 5000; k++) aio_counter_add(b->e, 0x700000 + k * 7919u, AIO_CREDIT_UNIT * (k % 5 + 1));
    for (uint32_t k = 0; k < 5000; k += 2) CHECK(aio_counter_release(b->e, 0x700000 + k * 7919u) == 1, "release %u", k);
    for (uint32_t k = 0; k < 5000; k++) {
        uint64_t want = (k % 2) ? AIO_CREDIT_UNIT * (k % 5 + 1) : 0;
        CHECK(aio_counter_available(b->e, 0x700000 + k * 7919u) == want, "counter %u after releases", k);
    }
    CHECK(aio_counter_release(b->e, 0x7fffffff) == 0, "releasing an unknown counter");
    CHECK(aio_counter_watch(b->e, 0x700001, AIO_CREDIT_UNIT) == 0, "watch");
    CHECK(aio_counter_release(b->e, 0x700001) == -FI_EBUSY, "released a watched counter");
    aio_counter_add(b->e, 0x700001, AIO_CREDIT_UNIT);
    pump(b);
    for (uint32_t k = 1; k < 5000; k += 2) aio_counter_release(b->e, 0x700000 + k * 7919u);
    return 0;
}

int t_read(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    static const uint64_t sizes[] = {1, 4097, MiB + 3, 4 * MiB};
    for (unsigned i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        uint64_t len = sizes[i], roff = 100 + i * 7, loff = 4000 - i * 3;
        uint32_t seed = 0x400 + i;
        fill(b->buf + roff, len, 0, seed);
        memset(a->buf + loff - 1, 0xEE, len + 2);
        aio_op_desc d = op_to(a, b, AIO_OP_READ, loff, roff, len, 0, 0);
        if (run_group(a, &d, 1, NULL)) return -1;
        int64_t bad = verify(a->buf + loff, len, 0, seed);
        CHECK(bad < 0, "read of %llu: byte %lld differs", (unsigned long long)len, (long long)bad);
        CHECK(a->buf[loff - 1] == 0xEE && a->buf[loff + len] == 0xEE, "read overran");
    }
    /* several reads in one group */
    aio_op_desc ds[8];
    fill(b->buf, 8 * 65536, 0, 0x4ff);
    for (int i = 0; i < 8; i++) ds[i] = op_to(a, b, AIO_OP_READ, (uint64_t)i * 65536, (uint64_t)i * 65536, 65536, 0, 0);
    if (run_group(a, ds, 8, NULL)) return -1;
    CHECK(verify(a->buf, 8 * 65536, 0, 0x4ff) < 0, "grouped reads");
    CHECK(aio_counter_total(b->e, 0) == 0, "a read credited a counter");
    return 0;
}

int t_sendrecv(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    uint64_t slot = b->info.slot_size;
    CHECK(slot == SLOT_SIZE, "slot_size %llu", (unsigned long long)slot);
    static uint8_t big[SLOT_SIZE + 1];
    fill(big, sizeof(big), 0, 0x500);
    const uint64_t lens[3] = {0, 5, slot};
    const void *bufs[3] = {"", "hello", big};
    uint64_t tok = g_token++;
    int64_t g = aio_group_open(a->e, tok);
    CHECK(g >= 0, "group");
    for (int i = 0; i < 3; i++) {
        double t0 = now_s();
        int r;
        /* the slot-sized one in two parts (aio_post_sendv): head and body land back to back */
        while ((r = i < 2 ? aio_post_send(a->e, g, a->rail, a->peer, bufs[i], lens[i], 1000000)
                          : aio_post_sendv(a->e, g, a->rail, a->peer, big, 100, big + 100, slot - 100,
                                           1000000)) == 0) {
            CHECK(now_s() - t0 < TIMEOUT, "send of %llu never posted", (unsigned long long)lens[i]);
            sleep_us(50);
        }
        CHECK(r == 1, "aio_post_send(%llu) = %d (%s)", (unsigned long long)lens[i], r,
              aio_strerror(r));
    }
    CHECK_OK(aio_group_seal(a->e, g));
    aio_record r;
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0, "no send group record");
    CHECK(r.status == 0 && r.a == 3, "send group status %d a %llu", r.status,
          (unsigned long long)r.a);
    int seen[3] = {0, 0, 0};
    for (int k = 0; k < 3; k++) {
        CHECK(wait_rec(b, AIO_REC_RECV, ANY, TIMEOUT, &r) == 0, "only %d of 3 messages arrived", k);
        CHECK(r.status == 0, "recv status %d", r.status);
        CHECK(r.rail == b->rail && r.a < SLOTS, "recv rail %d slot %llu", r.rail,
              (unsigned long long)r.a);
        const uint8_t *p = aio_recv_slot(b->e, r.rail, (uint32_t)r.a);
        CHECK(p, "aio_recv_slot");
        int which = r.b == 0 ? 0 : r.b == 5 ? 1 : r.b == slot ? 2 : -1;
        CHECK(which >= 0 && !seen[which], "unexpected message length %llu", (unsigned long long)r.b);
        seen[which] = 1;
        if (which == 1) CHECK(memcmp(p, "hello", 5) == 0, "5-byte message content");
        if (which == 2) CHECK(verify(p, slot, 0, 0x500) < 0, "slot-size message content");
        CHECK_OK(aio_recv_repost(b->e, r.rail, (uint32_t)r.a));
    }
    /* one byte too many */
    tok = g_token++;
    g = aio_group_open(a->e, tok);
    CHECK(g >= 0, "group");
    int rs = aio_post_send(a->e, g, a->rail, a->peer, big, slot + 1, 1000000);
    CHECK(rs == -FI_EMSGSIZE, "send of slot_size+1 returned %d, want -FI_EMSGSIZE", rs);
    rs = aio_post_sendv(a->e, g, a->rail, a->peer, big, 1, big, slot, 1000000);
    CHECK(rs == -FI_EMSGSIZE, "sendv of 1 + slot_size returned %d, want -FI_EMSGSIZE", rs);
    CHECK(aio_group_pending(a->e, g) == 0, "the oversized send was posted");
    CHECK_OK(aio_group_seal(a->e, g));
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0 && r.a == 0 && r.status == 0,
          "an empty sealed group must complete at once");
    /* more messages than slots: reposting works */
    for (int i = 0; i < SLOTS + 16; i++) {
        uint64_t v = 0xabc00000ULL + (uint64_t)i;
        tok = g_token++;
        g = aio_group_open(a->e, tok);
        CHECK(g >= 0, "group");
        double t0 = now_s();
        int ps;
        while ((ps = aio_post_send(a->e, g, a->rail, a->peer, &v, 8, 1000000)) == 0) {
            CHECK(now_s() - t0 < TIMEOUT, "send never posted");
            sleep_us(50);
        }
        CHECK(ps == 1, "send %d: %s", i, aio_strerror(ps));
        CHECK_OK(aio_group_seal(a->e, g));
        CHECK(wait_rec(b, AIO_REC_RECV, ANY, TIMEOUT, &r) == 0, "message %d did not arrive", i);
        uint64_t got;
        memcpy(&got, aio_recv_slot(b->e, r.rail, (uint32_t)r.a), 8);
        CHECK(r.b == 8 && got == v, "message %d: len %llu value %llx", i, (unsigned long long)r.b,
              (unsigned long long)got);
        CHECK_OK(aio_recv_repost(b->e, r.rail, (uint32_t)r.a));
        CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0 && r.status == 0, "send %d group", i);
    }
    return 0;
}

/* aio_submit_sendparts: a head and three parts (one empty) arrive as one message, each part
 * behind its 4-byte little-endian length; n == 0 and an oversized body are refused, nothing
 * posted. */
int t_sendparts(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    uint64_t slot = b->info.slot_size;
    static uint8_t big[SLOT_SIZE];
    fill(big, 3000, 0, 0x700);
    const void *parts[3] = {"abc", "", big};
    const uint64_t lens[3] = {3, 0, 3000};
    int64_t out[4];
    uint64_t tok = g_token++;
    double t0 = now_s();
    int64_t k;
    while ((k = aio_submit_sendparts(a->e, tok, a->rail, a->peer, "HD", 2, parts, lens, 3, 1000000, out)) == 0) {
        if (out[0] >= 0) CHECK_OK(aio_group_seal(a->e, out[0]));
        CHECK(now_s() - t0 < TIMEOUT, "the framed send never posted");
        sleep_us(50);
        tok = g_token++;
    }
    CHECK(k == 1, "aio_submit_sendparts = %lld (%s)", (long long)k, aio_strerror((int)k));
    aio_record r;
    if (!out[1]) CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0 && r.status == 0, "framed send group");
    else CHECK(out[2] == 0, "framed send status %lld", (long long)out[2]);
    CHECK(wait_rec(b, AIO_REC_RECV, ANY, TIMEOUT, &r) == 0, "the framed message did not arrive");
    CHECK(r.b == 2 + 4 + 3 + 4 + 4 + 3000, "framed message length %llu", (unsigned long long)r.b);
    const uint8_t *p = aio_recv_slot(b->e, r.rail, (uint32_t)r.a);
    static const uint8_t want[] = {'H', 'D', 3, 0, 0, 0, 'a', 'b', 'c', 0, 0, 0, 0, 0xb8, 0x0b, 0, 0};
    CHECK(memcmp(p, want, sizeof(want)) == 0, "framed message head and lengths");
    CHECK(verify(p + sizeof(want), 3000, 0, 0x700) < 0, "framed message's last part");
    CHECK_OK(aio_recv_repost(b->e, r.rail, (uint32_t)r.a));
    /* refused before anything is opened or posted */
    CHECK(aio_submit_sendparts(a->e, g_token++, a->rail, a->peer, "HD", 2, parts, lens, 0, 1000000, out) ==
              -FI_EINVAL && out[0] == -1, "n == 0 must be refused");
    const void *over[2] = {big, big};
    const uint64_t olens[2] = {slot / 2, slot / 2}; /* with their lengths, past the slot */
    tok = g_token++;
    CHECK(aio_submit_sendparts(a->e, tok, a->rail, a->peer, "", 0, over, olens, 2, 1000000, out) == -FI_EMSGSIZE,
          "an oversized framed message must be refused");
    CHECK(out[0] >= 0 && aio_group_pending(a->e, out[0]) == 0, "the oversized framed message was posted");
    CHECK_OK(aio_group_seal(a->e, out[0]));
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0 && r.a == 0, "the empty group must complete");
    return 0;
}

/* aio_submit_sendv_ref / aio_post_sendv_ref: the body sent from where it lies (tcp and shm
 * read local memory without a descriptor), behind a head copied into the slot or alone; it
 * arrives byte for byte, each counted in sends_in_place, and an oversized one is refused
 * with nothing posted. */
int t_sendref(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    uint64_t slot = b->info.slot_size;
    uint8_t *body = malloc(slot + 1);
    CHECK(body, "oom");
    fill(body, slot + 1, 0, 0x720);
    aio_stats st0, st1;
    aio_get_stats(a->e, &st0);
    int64_t out[4];
    uint64_t tok = g_token++;
    double t0 = now_s();
    int64_t k;
    while ((k = aio_submit_sendv_ref(a->e, tok, a->rail, a->peer, "HEAD", 4, body, slot - 4, 1000000, out)) == 0) {
        if (out[0] >= 0) CHECK_OK(aio_group_seal(a->e, out[0]));
        if (now_s() - t0 > TIMEOUT) free(body);
        CHECK(now_s() - t0 < TIMEOUT, "the in-place send never posted");
        sleep_us(50);
        tok = g_token++;
    }
    if (k != 1) free(body);
    CHECK(k == 1, "aio_submit_sendv_ref = %lld (%s)", (long long)k, aio_strerror((int)k));
    aio_record r;
    if (!out[1]) CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0 && r.status == 0, "in-place send group");
    else CHECK(out[2] == 0, "in-place send status %lld", (long long)out[2]);
    /* no head: the body alone, in a group of its own */
    tok = g_token++;
    int64_t g = aio_group_open(a->e, tok);
    CHECK(g >= 0, "group");
    int ps;
    t0 = now_s();
    while ((ps = aio_post_sendv_ref(a->e, g, a->rail, a->peer, NULL, 0, body + 1, slot, 1000000)) == 0) {
        CHECK(now_s() - t0 < TIMEOUT, "the headless in-place send never posted");
        sleep_us(50);
    }
    CHECK(ps == 1, "aio_post_sendv_ref = %d (%s)", ps, aio_strerror(ps));
    CHECK_OK(aio_group_seal(a->e, g));
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0 && r.status == 0, "headless send group");
    int seen[2] = {0, 0};
    for (int m = 0; m < 2; m++) {
        CHECK(wait_rec(b, AIO_REC_RECV, ANY, TIMEOUT, &r) == 0, "only %d of 2 in-place messages arrived", m);
        CHECK(r.status == 0 && r.b == slot, "in-place message status %d length %llu", r.status,
              (unsigned long long)r.b);
        const uint8_t *p = aio_recv_slot(b->e, r.rail, (uint32_t)r.a);
        int headed = memcmp(p, "HEAD", 4) == 0;
        CHECK(!seen[headed], "the %s message came twice", headed ? "headed" : "headless");
        seen[headed] = 1;
        CHECK(verify(p + (headed ? 4 : 0), slot - (headed ? 4 : 0), headed ? 0 : 1, 0x720) < 0,
              "in-place message content (%s)", headed ? "headed" : "headless");
        CHECK_OK(aio_recv_repost(b->e, r.rail, (uint32_t)r.a));
    }
    aio_get_stats(a->e, &st1);
    CHECK(st1.sends_in_place - st0.sends_in_place == 2, "sends_in_place counted %llu, want 2",
          (unsigned long long)(st1.sends_in_place - st0.sends_in_place));
    /* past the slot: refused, nothing posted */
    tok = g_token++;
    int64_t rk = aio_submit_sendv_ref(a->e, tok, a->rail, a->peer, "H", 1, body, slot, 1000000, out);
    free(body);
    CHECK(rk == -FI_EMSGSIZE, "an oversized in-place send returned %lld", (long long)rk);
    CHECK(out[0] >= 0 && aio_group_pending(a->e, out[0]) == 0, "the oversized in-place send was posted");
    CHECK_OK(aio_group_seal(a->e, out[0]));
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &r) == 0 && r.a == 0, "the empty group must complete");
    aio_get_stats(a->e, &st0);
    CHECK(st0.sends_in_place == st1.sends_in_place, "a refused send was counted");
    return 0;
}

int t_batch10k(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    enum { N = 10000, SZ = 16 };
    uint32_t imm = 0x5000;
    uint64_t rbase = MiB;
    aio_op_desc *ds = calloc(N, sizeof(*ds));
    CHECK(ds, "oom");
    fill(a->buf, (uint64_t)N * SZ, 0, 0x600);
    memset(b->buf + rbase, 0, (uint64_t)N * SZ);
    for (int i = 0; i < N; i++)
        ds[i] = op_to(a, b, AIO_OP_WRITE, (uint64_t)i * SZ, rbase + (uint64_t)i * SZ, SZ,
                      AIO_F_DATA, imm);
    uint64_t tok = g_token++;
    int64_t g = aio_group_open(a->e, tok);
    if (g < 0) free(ds);
    CHECK(g >= 0, "group");
    int64_t done = 0, calls = 0;
    double t0 = now_s();
    int err = 0;
    while (done < N) {
        int64_t r = aio_post(a->e, g, ds + done, N - done, 1000000);
        calls++;
        if (r < 0) {
            err = (int)r;
            break;
        }
        done += r;
        if (r == 0) {
            if (now_s() - t0 > TIMEOUT) {
                err = -FI_ETIMEDOUT;
                break;
            }
            sleep_us(50);
        }
    }
    free(ds);
    CHECK(err == 0, "posting stopped at %lld: %s", (long long)done, aio_strerror(err));
    CHECK_OK(aio_group_seal(a->e, g));
    aio_record r;
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, 60, &r) == 0, "no group record");
    CHECK(r.status == 0 && r.a == N, "group status %d a %llu", r.status, (unsigned long long)r.a);
    CHECK(wait_take(b, imm, (uint64_t)N * U, 60) == 0, "receiver got %llu of %d credits",
          (unsigned long long)(aio_counter_total(b->e, imm) / U), N);
    CHECK(verify(b->buf + rbase, (uint64_t)N * SZ, 0, 0x600) < 0, "batch bytes");
    sleep_us(200000);
    pump(a);
    CHECK(count_rec(a, AIO_REC_GROUP, tok) == 0, "the group record came twice");
    CHECK(aio_ops_in_flight(a->e) == 0, "ops in flight %lld", (long long)aio_ops_in_flight(a->e));
    CHECK(aio_counter_total(b->e, imm) == (uint64_t)N * U, "extra credits");
    printf("    (%lld aio_post calls for %d writes)\n", (long long)calls, N);
    return 0;
}

/* Groups of one write, sealed only once the write has completed (pending == 0), the
 * next group opened as soon as the record is drained (it reuses the slot). Every
 * record must carry its own token and a == 1. A completion racing with the seal of
 * the previous group must not finish the next group that reuses its slot. */
int t_group_race(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 0, 8, 0, 0);
    const int max_iters = 50000;
    double t0 = now_s();
    int i, bad = 0;
    aio_record r;
    memset(&r, 0, sizeof(r));
    while (pump(a)) {
    }
    a->ninbox = 0;
    for (i = 0; i < max_iters && now_s() - t0 < 4.0; i++) {
        uint64_t tok = g_token++;
        int64_t g = aio_group_open(a->e, tok);
        CHECK(g >= 0, "group");
        CHECK(post_all(a, g, &d, 1, TIMEOUT) == 0, "post");
        double t1 = now_s();
        while (aio_group_pending(a->e, g) != 0)
            CHECK(now_s() - t1 < TIMEOUT, "write %d never completed", i);
        int sr = aio_group_seal(a->e, g);
        int n;
        t1 = now_s();
        while ((n = aio_drain(a->e, &r, 1)) == 0)
            CHECK(now_s() - t1 < TIMEOUT, "no record for group %d", i);
        if (sr != 0 || r.kind != AIO_REC_GROUP || r.token != tok || r.a != 1 || r.status != 0) {
            bad = 1;
            fail_msg(__FILE__, __LINE__,
                     "iteration %d: seal %d; record kind %d token %llu (want %llu) a %llu status %d",
                     i, sr, r.kind, (unsigned long long)r.token, (unsigned long long)tok,
                     (unsigned long long)r.a, r.status);
            break;
        }
    }
    /* let whatever is left settle, then forget it */
    sleep_us(100000);
    while (pump(a)) {
    }
    a->ninbox = 0;
    if (bad) return -1;
    printf("    (%d groups)\n", i);
    return 0;
}

/* Paged writes: reversed and repeated page indices with strides larger than the page,
 * each page carrying the imm; a page past the remote region is refused before posting. */
int t_paged(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    enum { NP = 300, PS = 1000, SS = 1536, DS = 2048 };
    int64_t sp[NP], dp[NP];
    for (int k = 0; k < NP; k++) {
        sp[k] = k % 7 == 3 ? 5 : k;  /* repeated source pages */
        dp[k] = NP - 1 - k;          /* reversed destinations */
    }
    fill(a->buf, (uint64_t)SS * NP + 64, 0, 77);
    memset(b->buf, 0, (uint64_t)DS * NP + 64);
    aio_paged_desc d;
    memset(&d, 0, sizeof(d));
    d.mr = a->mr;
    d.src_pages = sp;
    d.dst_pages = dp;
    d.page_size = PS;
    d.src_stride = SS;
    d.dst_stride = DS;
    d.src_offset = 64;
    d.dst_offset = 32;
    d.remote_len = b->len;
    d.data = 0x5150;
    d.flags = AIO_F_DATA;
    d.nroutes = 1;
    d.first_route = 0;
    d.routes[0].rail = a->rail;
    d.routes[0].peer = a->peer;
    d.routes[0].rbase = aio_mr_remote_base(b->mr, b->rail);
    d.routes[0].rkey = aio_mr_key(b->mr, b->rail);
    aio_record rec;
    CHECK_OK(paged_group(a, &d, NP, &rec));
    CHECK(rec.status == 0 && rec.a == NP, "group status %d, %llu ops", rec.status,
          (unsigned long long)rec.a);
    CHECK(wait_take(b, 0x5150, (uint64_t)NP * AIO_CREDIT_UNIT, TIMEOUT) == 0, "imm credits");
    for (int k = 0; k < NP; k++) {
        const uint8_t *want = a->buf + 64 + (uint64_t)sp[k] * SS;
        const uint8_t *got = b->buf + 32 + (uint64_t)dp[k] * DS;
        CHECK(memcmp(want, got, PS) == 0, "page %d differs", k);
    }
    /* gathering: contiguous destinations, scattered sources, one weighted credit per
     * request that adds up to one unit per page */
    for (int k = 0; k < NP; k++) {
        sp[k] = (k * 37) % NP;
        dp[k] = k < NP / 2 ? k : k + 3; /* two contiguous runs with a gap */
    }
    memset(b->buf, 0, (uint64_t)DS * NP + 64);
    d.gather = 1;
    d.dst_stride = PS;
    d.data = 0x5151;
    CHECK_OK(paged_group(a, &d, NP, &rec));
    CHECK(rec.status == 0, "gather group status %d", rec.status);
    CHECK(rec.a < NP, "gathering formed no multi-page request (%llu requests)", (unsigned long long)rec.a);
    CHECK(wait_take(b, 0x5151, (uint64_t)NP * AIO_CREDIT_UNIT, TIMEOUT) == 0, "gather credits");
    sleep_us(20000);
    CHECK(aio_counter_available(b->e, 0x5151) == 0, "extra credits after gathering");
    for (int k = 0; k < NP; k++) {
        const uint8_t *want = a->buf + 64 + (uint64_t)sp[k] * SS;
        const uint8_t *got = b->buf + 32 + (uint64_t)dp[k] * PS;
        CHECK(memcmp(want, got, PS) == 0, "gathered page %d differs", k);
    }
    d.gather = 0;
    d.dst_stride = DS;
    for (int k = 0; k < NP; k++) dp[k] = NP - 1 - k;
    /* a destination page past the remote region: refused, nothing posted */
    dp[0] = (int64_t)(b->len / DS);
    int64_t g = aio_group_open(a->e, g_token++);
    CHECK(g >= 0, "aio_group_open");
    CHECK(aio_post_paged(a->e, g, &d, 0, NP, 1000000) == -FI_EINVAL, "bad page accepted");
    dp[0] = -1;
    CHECK(aio_post_paged(a->e, g, &d, 0, NP, 1000000) == -FI_EINVAL, "negative page accepted");
    CHECK(aio_group_pending(a->e, g) == 0, "something was posted");
    CHECK_OK(aio_group_seal(a->e, g));
    return 0;
}

int t_post_invalid(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    uint64_t tok = g_token++;
    int64_t g = aio_group_open(a->e, tok);
    CHECK(g >= 0, "group");
    int64_t before = aio_ops_in_flight(a->e);
    struct {
        uint64_t off, len;
    } bad[] = {{REGION_LEN + 1, 0},  {REGION_LEN - 4, 8}, {0, REGION_LEN + 1},
               {UINT64_MAX - 2, 8}, {8, UINT64_MAX - 4}, {REGION_LEN, 1}};
    for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        for (int op = AIO_OP_WRITE; op <= AIO_OP_READ; op++) {
            aio_op_desc d = op_to(a, b, op, bad[i].off, 0, bad[i].len, 0, 0);
            int64_t r = aio_post(a->e, g, &d, 1, 0);
            CHECK(r == -FI_EINVAL, "offset %llu length %llu op %d: aio_post = %lld, want -FI_EINVAL",
                  (unsigned long long)bad[i].off, (unsigned long long)bad[i].len, op, (long long)r);
        }
    }
    aio_op_desc d = op_to(a, b, AIO_OP_WRITE, 0, 0, 8, 0, 0);
    d.rail = 7;
    CHECK(aio_post(a->e, g, &d, 1, 0) == -FI_EINVAL, "bad rail accepted");
    d = op_to(a, b, 9, 0, 0, 8, 0, 0);
    CHECK(aio_post(a->e, g, &d, 1, 0) == -FI_EINVAL, "bad op accepted");
    CHECK(aio_group_pending(a->e, g) == 0, "something was posted");
    CHECK(aio_ops_in_flight(a->e) == before, "ops in flight changed");
    CHECK(aio_mr_inflight(a->mr) == 0, "region in flight");
    /* the region's end exactly is fine */
    aio_op_desc ok = op_to(a, b, AIO_OP_WRITE, REGION_LEN - 8, REGION_LEN - 8, 8, 0, 0);
    CHECK(post_all(a, g, &ok, 1, TIMEOUT) == 0, "write ending at the region's end");
    /* [valid, invalid]: the valid one is posted, then the error */
    aio_op_desc two[2] = {op_to(a, b, AIO_OP_WRITE, 0, 0, 8, 0, 0),
                          op_to(a, b, AIO_OP_WRITE, REGION_LEN, 0, 8, 0, 0)};
    int64_t r = aio_post(a->e, g, two, 2, 1000000000);
    CHECK(r == 1, "[valid, invalid] posted %lld, want 1", (long long)r);
    r = aio_post(a->e, g, two + 1, 1, 0);
    CHECK(r == -FI_EINVAL, "invalid item alone: %lld", (long long)r);
    CHECK_OK(aio_group_seal(a->e, g));
    aio_record rec;
    CHECK(wait_rec(a, AIO_REC_GROUP, tok, TIMEOUT, &rec) == 0, "no group record");
    CHECK(rec.status == 0 && rec.a == 2, "status %d a %llu", rec.status, (unsigned long long)rec.a);
    /* a finished group takes nothing more */
    CHECK(aio_post(a->e, g, &ok, 1, 0) == -FI_EINVAL, "post into a finished group");
    CHECK(aio_group_seal(a->e, g) == -FI_EINVAL, "seal of a finished group");
    return 0;
}

int t_mr_close_busy(fix_t *f) {
    eng_t *a = &f->a, *b = &f->b;
    /* 32 writes of 16 MiB (512 MiB, tens of milliseconds over loopback) with remote CQ data,
     * so that the peer's progress is needed (shm completes a plain CMA write inside the post
     * call). Closing the region right after posting must be refused. On a loaded machine the
     * posting thread can lose the CPU while the pollers move everything: a close that then
     * succeeds is right (nothing was in flight; checked below) but proves nothing, so the
     * scenario runs again, up to 3 times. */
    enum { NW = 32, ATTEMPTS = 3 };
    uint64_t len = 16 * MiB;
    uint32_t imm = 0x6100;
    int busy = -1, refused_once = 0;
    for (int attempt = 0; attempt < ATTEMPTS && !refused_once; attempt++) {
        void *p = NULL;
        CHECK(posix_memalign(&p, 4096, len) == 0, "oom");
        memset(p, 0x5a, len);
        aio_mr *mr = NULL;
        char err[256];
        int ret = aio_mr_register(a->e, p, len, 0, &mr, err, sizeof(err));
        if (ret) free(p);
        CHECK(ret == 0, "register: %s", err);
        aio_op_desc ds[NW];
        for (int i = 0; i < NW; i++) {
            ds[i] = op_to(a, b, AIO_OP_WRITE, 0, 0, len, AIO_F_DATA, imm);
            ds[i].mr = mr;
        }
        uint64_t tok = g_token++;
        int64_t g = aio_group_open(a->e, tok);
        int posted = g >= 0 && post_all(a, g, ds, NW, TIMEOUT) == 0;
        busy = posted ? aio_mr_close(a->e, mr) : -1;
        int64_t infl = busy == -FI_EBUSY ? aio_mr_inflight(mr) : -1;
        if (busy == 0) mr = NULL; /* closed: every write had completed (the in-flight count was 0) */
        if (g >= 0) aio_group_seal(a->e, g);
        aio_record r;
        int got = wait_rec(a, AIO_REC_GROUP, tok, 60, &r);
        int64_t infl_after = mr ? aio_mr_inflight(mr) : -1;
        int closed = (mr && got == 0) ? aio_mr_close(a->e, mr) : -1;
        if (closed == 0 || !mr) free(p);
        wait_take(b, imm, NW * U, TIMEOUT);
        CHECK(posted, "posting the big writes failed");
        CHECK(got == 0 && r.status == 0, "big writes did not complete");
        CHECK(r.a == NW, "the group counted %llu writes done, want %d", (unsigned long long)r.a, NW);
        if (busy == 0) {
            printf("    (attempt %d: every write had landed before the close: again)\n", attempt + 1);
            continue;
        }
        CHECK(busy == -FI_EBUSY, "aio_mr_close with writes in flight = %d, want -FI_EBUSY", busy);
        CHECK(infl >= 1, "aio_mr_inflight %lld", (long long)infl);
        CHECK(infl_after == 0, "inflight after completion %lld", (long long)infl_after);
        CHECK(closed == 0, "aio_mr_close after completion = %d", closed);
        refused_once = 1;
    }
    CHECK(refused_once, "no attempt closed the region while its writes were in flight");
    return 0;
}
