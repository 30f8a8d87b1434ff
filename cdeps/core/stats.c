/* Statistics: what an engine counted, for aio_get_stats.
 *
 * Theory of operation. The counters are fields of the engine (st_*: internal.h), each bumped
 * where its event happens, by whichever thread sees it, with an atomic add (mostly relaxed):
 * no lock, since they are read for diagnostics and benchmarks only. aio_get_stats
 * reads each on its own, so a snapshot taken while the engine runs is not consistent across
 * fields (completions may be ahead of polls). */
#include "internal.h"

uint64_t aio_loop_polls(aio_engine *e) { return atomic_load(&e->st_loop_polls); }

void aio_get_stats(aio_engine *e, aio_stats *o) {
    o->polls = atomic_load(&e->st_polls);
    o->sleeps = atomic_load(&e->st_sleeps);
    o->wakeups_sent = atomic_load(&e->st_wakeups);
    o->completions = atomic_load(&e->st_completions);
    o->remote_data = atomic_load(&e->st_remote);
    o->errors = atomic_load(&e->st_errors);
    o->spin_window_ns = (uint64_t)atomic_load(&e->st_adapt);
    o->direct_ops = atomic_load(&e->st_direct);
    o->direct_mapped = atomic_load(&e->st_mapped);
    o->tcp_tuned = atomic_load(&e->st_tuned);
    o->posts_handed = atomic_load(&e->st_handed);
    o->posts_handed_waited = atomic_load(&e->st_handed_waited);
    o->posts_peer_gone = atomic_load(&e->st_gone);
    o->direct_split = atomic_load(&e->st_split);
    o->follow_cpu = atomic_load(&e->st_follow_cpu);
    o->follow_moves = atomic_load(&e->st_follow_moves);
    o->sends_in_place = atomic_load(&e->st_in_place);
    o->bytes_inflight = 0; /* the rails' counters, which place whole transfers (rail.c) */
    for (int i = 0; i < e->nrails; i++)
        if (e->rails[i]) o->bytes_inflight += atomic_load_explicit(&e->rails[i]->bytes_inflight, memory_order_relaxed);
}
