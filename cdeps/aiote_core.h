/*
 * aiote C core: libfabric rails, a native completion poller, a completion ring
 * bridged to an event loop through an eventfd, and immediate counters.
 *
 * Threading model
 *   - One poller thread per engine drains every rail's completion queue. It spins
 *     for `spin_ns` after the last activity, then sleeps on the providers' wait
 *     objects (epoll over the CQ wait fds and a kick eventfd) with a timed fallback.
 *   - Every libfabric call on a rail is made under that rail's mutex
 *     (FI_THREAD_DOMAIN: we serialize), so posting threads and the poller never
 *     race inside the provider.
 *   - Completion records go into a ring that the event-loop side drains with
 *     aio_drain(). The poller signals the engine's eventfd only when the loop side
 *     declared itself idle with aio_arm() (one wake-up per drain cycle).
 *   - Nothing here takes the Python GIL; every function is safe to call with the
 *     GIL released.
 *
 * Return convention: 0 / positive on success, a negative libfabric or errno code
 * on failure (use aio_strerror). Functions that can fail for a reason worth
 * showing a user also fill `err` (NUL-terminated, truncated to errlen).
 */
#ifndef AIOTE_CORE_H
#define AIOTE_CORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define AIO_MAX_RAILS 16
#define AIO_MAX_ADDR 128
#define AIO_MAX_GATHER 16 /* local pieces one paged request may gather */
#define AIO_MAX_STRIDED 4096 /* pages one strided copy of a paged write to a direct route may take */
#define AIO_IN_PLACE_MIN 16384 /* Engine.send sends a bytes payload over this in place (aio_submit_sendv_ref) */

/* Credit unit of an immediate counter. A work request whose remote CQ data has a
 * zero weight field counts as one whole unit; a shard of a striped transfer carries
 * its share of AIO_CREDIT_UNIT in the upper 32 bits of the 64-bit CQ data, so that
 * the shards of one logical write add up to exactly one unit at the receiver. */
#define AIO_CREDIT_UNIT 65536ULL

/* The error (negated, as libfabric's) of a request the core refused because its same-host
 * (shm) peer's process is gone: nothing was posted. Private to aiote, outside libfabric's and
 * the system's error numbers, so that it is never confused with a provider's EHOSTDOWN. */
#define AIO_EPEERGONE 4095

/* record kinds */
#define AIO_REC_GROUP 1   /* a sealed group finished: token = group token, status */
#define AIO_REC_RECV 2    /* a message arrived: rail, a = slot, b = length, status */
#define AIO_REC_COUNTER 3 /* a counter watch is satisfied: token = imm */
#define AIO_REC_LINK 4    /* the link of a rail's interface changed: rail, a = 1 up / 0 down */
#define AIO_REC_SPACE 5   /* a request completed after aio_want_space: posting may resume */
#define AIO_REC_WATCH 6   /* a watched 64-bit word changed: token = watch token, a = new value */

typedef struct aio_record {
    uint64_t token;
    uint64_t a;
    uint64_t b;
    int32_t kind;
    int32_t status; /* 0, or a negative libfabric error code */
    int32_t rail;
    int32_t prov_errno;
} aio_record;

/* operation kinds for aio_post */
#define AIO_OP_WRITE 1
#define AIO_OP_READ 2

/* aio_op_desc.flags */
#define AIO_F_DATA 1 /* carry remote CQ data (write only) */

typedef struct aio_op_desc {
    void *mr;          /* local aio_mr (opaque) */
    uint64_t offset;   /* offset into the local region */
    uint64_t length;   /* bytes; 0 allowed for a data-carrying write */
    uint64_t peer;     /* fi_addr_t on the rail, from aio_av_insert */
    uint64_t raddr;    /* remote address as the remote provider expects it */
    uint64_t rkey;     /* remote key */
    uint64_t data;     /* remote CQ data (imm | weight << 32) */
    int32_t rail;
    int32_t op;        /* AIO_OP_WRITE / AIO_OP_READ */
    int32_t flags;
    int32_t direct;    /* 0: through the rail's provider; else AIO_DIRECT(attach, slot): a same-host
                          copy made by this engine (see "Direct same-host copies" below) */
} aio_op_desc;

typedef struct aio_rail_info {
    char provider[64];
    char domain[64];
    char fabric[64];
    uint64_t mr_mode;
    uint64_t mode;
    uint64_t max_msg_size;
    uint64_t inject_size;
    uint64_t mr_key_size;
    uint32_t cq_data_size;
    int32_t has_wait_fd;
    uint32_t tx_size;
    uint32_t rx_size;
    uint32_t recv_slots;
    uint32_t pad;
    uint64_t slot_size;
    uint64_t caps;
    uint32_t addr_len;
    uint8_t addr[128]; /* AIO_MAX_ADDR */
} aio_rail_info;

typedef struct aio_engine aio_engine;
typedef struct aio_mr aio_mr;

typedef struct aio_engine_config {
    uint32_t ring_capacity;  /* completion records (power of two, >= 1024) */
    uint32_t max_ops;        /* work requests in flight, engine-wide */
    uint32_t max_groups;     /* groups (batches) in flight */
    uint32_t base_port;      /* tcp: the n-th interface rail listens on base_port + n (0: any) */
    int64_t spin_ns;         /* busy-poll after the last activity before sleeping */
    int32_t sleep_ms;        /* timed fallback of the sleeping poller */
    int32_t watch_us;        /* longest sleep of the poller while a word is watched (0: 100 us) */
    int64_t busy_spin_ns;    /* busy-poll budget while our work is in flight (0: 200 us) */
    int32_t follow_loop;     /* 1: poller 0 keeps to the CPU the loop last drained on (poller.c) */
    int32_t pad0;
} aio_engine_config;

const char *aio_strerror(int code);
uint32_t aio_fabric_version(void);

/* What a provider offers here (one entry per domain/NIC), with the hints aiote uses:
 * returns the number of entries (0: the provider is not usable here) or a negative error. */
typedef struct aio_probe_entry {
    char provider[64];
    char domain[64];
    char fabric[64];
    uint64_t caps;
    uint64_t mr_mode;
    uint64_t max_msg_size;
    uint64_t link_speed; /* bits/s when the provider knows it, else 0 */
    uint32_t cq_data_size;
    uint32_t hmem;
    uint32_t iov_limit;
    uint32_t pad;
} aio_probe_entry;
int aio_probe(const char *provider, aio_probe_entry *out, int max);

int aio_engine_create(const aio_engine_config *cfg, aio_engine **out, char *err, size_t errlen);
/* Send buffers of the tcp provider's connections. Loopback tcp queues as much as the kernel's
 * autotuning allows (4 MiB by default) on each connection, and the receiver then copies that
 * from memory rather than from cache: a fixed SO_SNDBUF of `bytes` (the kernel doubles it)
 * moved 16 MiB writes about a third faster here (docs/benchmarks.md). libfabric's tcp provider
 * has no such knob, so the core sets it on the provider's sockets itself: the listening socket
 * of each tcp rail (its accepted connections inherit it) and, at the first posts to each peer,
 * the connection to that peer's address. It touches only sockets whose local address is the
 * rail's listening address, or whose remote address is a peer in the rail's address vector.
 * all == 0: only same-host connections (local and remote IP equal; a listener only when it is
 * bound to a loopback address); 1: every connection of the rail. bytes == 0: leave the kernel's
 * autotuning. Default: AIO_TCP_SNDBUF_AUTO, same-host only. Before aio_engine_start; 0 or
 * -FI_EINVAL. */
#define AIO_TCP_SNDBUF_AUTO (512 * 1024)
int aio_engine_set_tcp_sndbuf(aio_engine *e, int32_t bytes, int all);
/* Poller threads. Each rail is driven by one poller thread: rail i by poller i % n, so an engine
 * with several rails (NICs, or connections per NIC) moves data on several cores at once (one
 * thread copies into one tcp connection at about one core's speed). Poller 0 also makes every
 * direct same-host copy and reads the watched words and the link monitor. Every thread spins only after activity on its own rails,
 * then sleeps. n: 1 (default) to AIO_MAX_RAILS; the engine runs min(n, rails) threads. Before
 * the first aio_engine_add_rail; 0 or -FI_EINVAL. */
int aio_engine_set_pollers(aio_engine *e, int n);
/* Threads that make one large same-host copy into or out of a peer's arena (8 MiB or more,
 * cut in parts of at least 4 MiB): poller 0 and n - 1 helper threads, started at the first
 * such copy, asleep between copies. 1..AIO_COPY_THREADS_MAX, default 2; before the start. */
#define AIO_COPY_THREADS_MAX 8
int aio_engine_set_copy_threads(aio_engine *e, int n);
/* The poller threads the engine runs (after aio_engine_start), or will run. */
int aio_engine_num_pollers(aio_engine *e);
/* Adds a rail (one libfabric domain + RDM endpoint). provider: "tcp", "shm",
 * "verbs", "efa" or a full libfabric provider string. nic: domain name or NULL.
 * Returns the rail index. Must be called before aio_engine_start. */
int aio_engine_add_rail(aio_engine *e, const char *provider, const char *nic,
                        uint32_t recv_slots, uint64_t slot_size, char *err, size_t errlen);
int aio_engine_start(aio_engine *e);
/* Stops the poller, cancels nothing in flight (the caller waits first), closes
 * every fabric object and frees the engine. Regions still registered are closed. */
void aio_engine_destroy(aio_engine *e);
int aio_engine_eventfd(aio_engine *e);
int aio_engine_num_rails(aio_engine *e);
int aio_rail_get_info(aio_engine *e, int rail, aio_rail_info *out);
/* 1 if the rail's interface has its link up (rails not bound to an interface: always 1).
 * Changes are reported as AIO_REC_LINK records (netlink, watched by the poller). */
int aio_rail_link_up(aio_engine *e, int rail);
/* Inserts a peer address into the rail's address vector. */
int aio_av_insert(aio_engine *e, int rail, const void *addr, size_t len, uint64_t *fi_addr);
int aio_av_remove(aio_engine *e, int rail, uint64_t fi_addr);

/* Memory: a region registered on every rail of the engine.
 * access: bit 0 remote write, bit 1 remote read. */
#define AIO_ACCESS_REMOTE_WRITE 1
#define AIO_ACCESS_REMOTE_READ 2
int aio_mr_register(aio_engine *e, void *buf, uint64_t len, uint32_t access, aio_mr **out,
                    char *err, size_t errlen);
uint64_t aio_mr_key(aio_mr *mr, int rail);
/* remote address base a peer must use for offset 0 (0 for offset-based providers) */
uint64_t aio_mr_remote_base(aio_mr *mr, int rail);
int64_t aio_mr_inflight(aio_mr *mr);
/* -EBUSY while work requests that touch the region are in flight, or while a same-host peer
 * is copying into or out of it directly (a microsecond-to-millisecond wait: call again; from
 * the first such call on, new direct copies into the region are refused). */
int aio_mr_close(aio_engine *e, aio_mr *mr);
/* After aio_mr_close said -EBUSY and the caller gives up: direct copies into and out of the
 * region are admitted again (the region stays registered and fully usable). 0. */
int aio_mr_reopen(aio_engine *e, aio_mr *mr);

/* Direct same-host copies.
 *
 * libfabric 1.17's shm provider carries a write out at the *target*: the target's progress
 * copies the bytes (process_vm_readv) while holding the lock its senders need to enqueue. A
 * direct copy is made by the *initiator's* poller instead (process_vm_readv for reads, memcpy
 * into and out of a peer's arena, below), the way UCX's same-host path works, and keeps the
 * target's checks: each engine that enables it
 * publishes a region table in shared memory (a memfd that peers open through /proc/<pid>/fd,
 * which takes the same permission as the copies themselves). A registered host region takes a
 * slot there holding its key, bounds and access rights. An initiator marks itself busy on
 * the slot, checks the key the descriptor carried, the bounds and the right, copies, and
 * clears its mark; the region's owner closing it clears the key first, then waits until no
 * mark is left (marks of peers whose process died are cleared). So a stale descriptor never
 * writes into memory its owner unregistered. An immediate follows the copy as a zero-byte
 * write through the shm rail, so the target's counters work as over the provider.
 *
 * aio_engine_enable_direct: creates the table (the engine needs an shm rail). 0 or negative.
 * aio_direct_info: what a peer needs to attach (-FI_ENODATA without a table).
 * aio_mr_direct_slot: the region's slot, or -1 (no table, device memory, no remote access,
 *   or the table is full: peers then go through the provider).
 * aio_direct_attach: maps a peer's table and checks that this process may copy into the
 *   peer's memory (a probe copy into the table); returns the attachment index (>= 0; the
 *   same peer gets the same index) or a negative error with `err` filled. */
#define AIO_DIRECT_SLOTS 4096
#define AIO_DIRECT_PEERS 64   /* attached engines per table */
#define AIO_DIRECT_ATTACH 255 /* tables one engine attaches to */
#define AIO_DIRECT(attach, slot) ((int32_t)((((attach) + 1) << 16) | (slot)))
typedef struct aio_direct_info {
    int32_t pid;
    int32_t fd;
    uint64_t nonce;
    uint64_t table; /* the table's address in the owner's process */
} aio_direct_info;
int aio_engine_enable_direct(aio_engine *e, char *err, size_t errlen);
int aio_direct_info_get(aio_engine *e, aio_direct_info *out);
int32_t aio_mr_direct_slot(aio_mr *mr);
int aio_direct_attach(aio_engine *e, const aio_direct_info *peer, char *err, size_t errlen);
/* aio_direct_detach: lets go of an attached table (its entry is reused by a later attach);
 * the caller has nothing queued or in flight to it and posts no code naming it again.
 * aio_direct_gone: 1 when the peer's process exited or closed its table, 0 when not. Both
 * -FI_EINVAL for an index not attached. */
int aio_direct_detach(aio_engine *e, int attach);
int aio_direct_gone(aio_engine *e, int attach);
/* Arenas. An engine with a table may publish one arena: a memfd of `len` bytes that this
 * process maps (MAP_SHARED, page-aligned) at `base`. Peers that attach map it as well, and a
 * direct copy whose peer range lies in the arena is a memcpy by the initiator's poller, under
 * the same slot checks (key, bounds, right, busy mark) as the other direct copies.
 * Every write or read of one byte or more that carries a direct code is a direct copy
 * (process_vm_writev / process_vm_readv outside an arena): libfabric 1.17's shm checks no key,
 * no bounds and no access right, and never fails a request to a process that died, so the
 * same-host route keeps the target's checks and notices a dead peer only this way. A bare
 * immediate (zero bytes) with a direct code is checked in place (the slot's key and right, the
 * peer alive) and then posted to shm. AIO_DIRECT_WRITE_MIN is kept for compatibility.
 * The engine keeps a duplicate of fd until it is destroyed; the mapping stays the caller's.
 * Once, before any region is registered: 0, -FI_EBUSY, or -FI_EINVAL with `err` filled. */
#define AIO_DIRECT_WRITE_MIN 4096
int aio_engine_set_arena(aio_engine *e, int fd, void *base, uint64_t len, char *err, size_t errlen);
/* For tests: sets (on = 1) or clears this engine's busy mark on a slot of an attached peer's
 * table, as a copy under way does. 0 or -FI_EINVAL. */
int aio_direct_mark(aio_engine *e, int attach, int32_t slot, int on);

/* Groups: a set of work requests finished as one. Open a group, post into it
 * (possibly over several calls), seal it: one AIO_REC_GROUP record is pushed when
 * it is sealed and every posted request completed (status: the first error). */
int64_t aio_group_open(aio_engine *e, uint64_t token);
/* Posts up to n requests. Returns how many were posted (possibly fewer: the
 * transmit queue or the op table is full and `budget_ns` of self-driven progress
 * did not free it), or a negative error for items[returned] when nothing of it
 * was posted. Partial progress is never undone. */
int64_t aio_post(aio_engine *e, int64_t group, const aio_op_desc *items, int64_t n,
                 int64_t budget_ns);
/* Sends a message (copied into a registered send slot) to a peer on a rail. Returns
 * 1 if posted, 0 if no send slot or queue space is free now, negative on error. */
int aio_post_send(aio_engine *e, int64_t group, int rail, uint64_t peer, const void *buf,
                  uint64_t len, int64_t budget_ns);
/* aio_post_send of a message in two parts, head then body, copied one after the other into
 * one send slot (the copy is made without the rail's lock held). A message of up to 4 KiB
 * (head and body) is then looked for in the rail's completion queue once, on this thread
 * (shm completes it as it takes it, tcp once its socket took it); the rail's poller is woken only when the group still
 * has a request in flight. */
int aio_post_sendv(aio_engine *e, int64_t group, int rail, uint64_t peer, const void *head,
                   uint64_t hlen, const void *body, uint64_t blen, int64_t budget_ns);
/* aio_group_open + aio_post_sendv + aio_group_seal in one call, as aio_submit: out[0] is the
 * group opened (negative: every group slot in flight, nothing else done); returns what
 * aio_post_sendv returned, the group sealed only when the message was posted (1). A small
 * message the provider completed by then (shm always, tcp when its socket took it) ends its
 * group in this call: then
 * out[1] is 1, out[2] the status (0, or the negative error), out[3] the provider's errno, and
 * no record of the group comes (its slot is free again); otherwise out[1] is 0 and the
 * group's record comes as for any group. out has 4 elements. */
int64_t aio_submit_sendv(aio_engine *e, uint64_t token, int rail, uint64_t peer, const void *head,
                         uint64_t hlen, const void *body, uint64_t blen, int64_t budget_ns,
                         int64_t *out);
/* aio_submit_sendv / aio_post_sendv with the body sent from where it lies, not copied into
 * the send slot (only the head is): the caller keeps the body's bytes alive and unchanged
 * until the group's completion. Where the rail's provider needs a descriptor for local
 * memory (FI_MR_LOCAL: verbs, efa), or takes one piece per send, the body is copied as by
 * aio_submit_sendv. */
int64_t aio_submit_sendv_ref(aio_engine *e, uint64_t token, int rail, uint64_t peer, const void *head,
                             uint64_t hlen, const void *body, uint64_t blen, int64_t budget_ns,
                             int64_t *out);
int aio_post_sendv_ref(aio_engine *e, int64_t group, int rail, uint64_t peer, const void *head,
                       uint64_t hlen, const void *body, uint64_t blen, int64_t budget_ns);
/* aio_submit_sendv of a combined message: the body is the n parts (n >= 1), each behind its
 * length (4 bytes, little-endian), copied by the core straight into the send slot (no staging
 * copy). -FI_EINVAL for n == 0 (nothing opened: out[0] is -1), -FI_EMSGSIZE when head and
 * framed parts pass the slot size; otherwise as aio_submit_sendv. */
int64_t aio_submit_sendparts(aio_engine *e, uint64_t token, int rail, uint64_t peer, const void *head,
                             uint64_t hlen, const void *const *parts, const uint64_t *lens, uint32_t n,
                             int64_t budget_ns, int64_t *out);
/* Paged writes: page k (start <= k < n) copies page_size bytes from the local region at
 * src_offset + src_stride*src_pages[k] to the remote region at
 * dst_offset + dst_stride*dst_pages[k], over routes[(first_route + k) % nroutes]. Each page
 * carries `data` as remote CQ data when flags has AIO_F_DATA. With `gather`, consecutive
 * pages whose destinations follow each other (dst_stride == page_size, adjacent indices) go
 * as one request gathering their sources, up to the rail's iov limit; it carries their
 * credits as one weight (k pages: k * AIO_CREDIT_UNIT), so gathering with AIO_F_DATA needs
 * 64-bit CQ data and is skipped otherwise. To a direct route (a same-host copy), such pages
 * whose sources are evenly spaced and ascending (src_pages[k+1] - src_pages[k] constant, >= 0)
 * go as one strided copy of up to AIO_MAX_STRIDED pages, with no staging and one system call
 * per 512 pages (a memcpy per page into an arena); sources a page apart make it one plain
 * copy. The route advances per request. Pages are checked against
 * both regions (remote_len) as they are posted: -FI_EINVAL for page `start + returned`.
 * Returns the number of pages posted from `start` (fewer when the queue stays full for
 * budget_ns), or a negative error when none was. */
typedef struct aio_route {
    int32_t rail;     /* local rail */
    int32_t direct;   /* 0, or AIO_DIRECT(attach, slot): pages to this route are direct copies */
    uint64_t peer;    /* fi_addr_t of the remote NIC on that rail */
    uint64_t rbase;   /* remote address of offset 0 on that NIC */
    uint64_t rkey;    /* remote key on that NIC */
} aio_route;

typedef struct aio_paged_desc {
    void *mr;
    const int64_t *src_pages;
    const int64_t *dst_pages;
    uint64_t page_size;
    uint64_t src_stride;
    uint64_t dst_stride;
    uint64_t src_offset;
    uint64_t dst_offset;
    uint64_t remote_len;
    uint64_t data;
    int32_t flags;
    int32_t nroutes;
    int32_t first_route;
    int32_t gather;   /* 1: pages with consecutive destinations may go as one request */
    aio_route routes[16]; /* AIO_MAX_RAILS */
} aio_paged_desc;

int64_t aio_post_paged(aio_engine *e, int64_t group, const aio_paged_desc *d, int64_t start,
                       int64_t n, int64_t budget_ns);
int aio_group_seal(aio_engine *e, int64_t group);
/* aio_group_open + aio_post + aio_group_seal in one call (one crossing from Python instead of
 * three): *group is the group opened (negative: -FI_EAGAIN, every group slot in flight, and
 * nothing else was done). Returns what aio_post returned; the group is sealed only when all
 * n requests were posted, else it stays open for the caller to continue with aio_post and seal. */
int64_t aio_submit(aio_engine *e, uint64_t token, const aio_op_desc *items, int64_t n,
                   int64_t budget_ns, int64_t *group);
/* aio_submit, the group's completion quiet: its record goes into the ring without waking the
 * event loop (the next drain, whatever woke it, reads it), unless a task waits for a quiet
 * record (aio_quiet_waiters) or the ring is half full. For work posted now and awaited later:
 * no wake-up for a completion nobody waits for yet. */
int64_t aio_submit_quiet(aio_engine *e, uint64_t token, const aio_op_desc *items, int64_t n,
                         int64_t budget_ns, int64_t *group);
/* Makes an open, unsealed group's completion quiet (1) or not (0); -FI_EINVAL for a sealed
 * or free group. */
int aio_group_quiet(aio_engine *e, int64_t group, int quiet);
/* Adds `delta` (1: a task starts waiting for a quiet group's record, -1: it stopped) to the
 * engine's quiet waiters, while some are counted every quiet record signals as usual.
 * Returns 1 when records are waiting in the ring: the caller drains them before it sleeps
 * (one pushed before the count went up did not signal). */
int aio_quiet_waiters(aio_engine *e, int delta);
/* After a post returned short (queue or op table full): asks for one AIO_REC_SPACE record
 * once at most `below` requests of the engine are in flight, so the loop can wait for room
 * instead of a timer (and post a large part of a queue per wake-up). */
void aio_want_space(aio_engine *e, int64_t below);
/* number of posted, unfinished requests in a group (for diagnostics) */
int64_t aio_group_pending(aio_engine *e, int64_t group);
int64_t aio_ops_in_flight(aio_engine *e);
/* Of the n rails in `rails`, the index (0..n-1) of the one with the fewest bytes of this
 * engine's writes and reads posted and not completed; ties go to the first from `start % n`
 * on (round robin among idle rails). -1 for n < 1 or a rail out of range. Reads n atomics. */
int aio_least_loaded(aio_engine *e, const int32_t *rails, int n, int64_t start);

/* Receive slots */
void *aio_recv_slot(aio_engine *e, int rail, uint32_t slot);
int aio_recv_repost(aio_engine *e, int rail, uint32_t slot);

/* Immediate counters (values in credit sub-units, see AIO_CREDIT_UNIT). */
/* Takes `units` if available: 1 taken, 0 not enough. */
int aio_counter_take(aio_engine *e, uint32_t imm, uint64_t units);
/* Arms a watch: an AIO_REC_COUNTER record is pushed once `available >= units`.
 * Returns 1 (and arms nothing) if that already holds. */
int aio_counter_watch(aio_engine *e, uint32_t imm, uint64_t units);
void aio_counter_refund(aio_engine *e, uint32_t imm, uint64_t units);
/* Forgets a counter (its credits and totals): 1 removed, 0 there was none, -FI_EBUSY while
 * a watch is armed. Credits arriving later start it again from zero. */
int aio_counter_release(aio_engine *e, uint32_t imm);
uint64_t aio_counter_available(aio_engine *e, uint32_t imm);
uint64_t aio_counter_total(aio_engine *e, uint32_t imm);
/* Adds units locally (loopback of the engine's own imm, used by tests and by
 * rails that complete outside libfabric). */
void aio_counter_add(aio_engine *e, uint32_t imm, uint64_t units);

/* Event-loop side of the ring. */
int aio_drain(aio_engine *e, aio_record *out, int max);
/* Declares the loop side idle: returns 1 if records are waiting (the caller must
 * drain again instead of sleeping), 0 if the next record will signal the eventfd. */
int aio_arm(aio_engine *e);
/* Low-latency wait of the event-loop thread (call it with the GIL released): drives every
 * rail's completion queue itself (a rail the poller holds at that moment is skipped: the
 * poller pushes what it reads) and reads the watched words, until a record is waiting in the
 * ring or `budget_ns` passed. It polls for 30 us, yielding the CPU between polls, then sleeps
 * on the rails' wait objects and the (armed) eventfd in steps of at most 1 ms. Returns 1 if
 * records are waiting, 0 after the budget. The poller thread is not affected. On return the
 * eventfd is disarmed and clear: the caller must aio_drain and aio_arm (as after any
 * wake-up) before it sleeps. A counter waiter arms its watch first (aio_counter_watch), so
 * that the counter reaching it pushes a record. */
int aio_poll_ring(aio_engine *e, int64_t budget_ns);
/* How many aio_poll_ring calls the engine has seen. */
uint64_t aio_loop_polls(aio_engine *e);
/* Clears the eventfd (non-blocking). */
void aio_clear_eventfd(aio_engine *e);

/* Watched words (GPU completion flags, UVM watcher slots): while at least one is added, the
 * poller reads each after every poll and, when its value differs from the last one seen,
 * pushes one AIO_REC_WATCH record (token, new value). While watches exist the poller sleeps
 * at most cfg.watch_us between reads (an idle engine with no watch still sleeps fully).
 * The word must stay mapped until aio_watch_remove returns (which waits out a poll in
 * progress). Returns a watch id >= 0, or -FI_ENOSPC / -FI_EINVAL. `last` is the value the
 * caller already knows (a change from it is reported). */
#define AIO_MAX_WATCHES 4096
int aio_watch_add(aio_engine *e, const volatile uint64_t *word, uint64_t last, uint64_t token);
int aio_watch_remove(aio_engine *e, int id);
/* A watched word is expected to change in about `after_ns` from now (a GPU copy of known size
 * just enqueued): from then, for `window_ns`, poller 0 reads the watched words every few
 * microseconds instead of every cfg.watch_us, so the completion is seen soon after it
 * happens, without reading finely through the whole copy. A hint given while another window
 * is still to come or under way merges with it into one (the earliest start, the latest end:
 * copies queued back to back are read finely from the first's end to the last's); a change
 * seen ends nothing early. Poller 0 takes the
 * hint at its next wake-up (within cfg.watch_us): no kick, so a hint costs two atomic
 * updates, and a wrong guess only the fine reads of its window. */
void aio_watch_soon(aio_engine *e, int64_t after_ns, int64_t window_ns);
/* Credit lanes: a ring of credits in memory this process shares with a peer process, whose
 * GPU stream (the CUDA-IPC rail: the copy's stream, right after the copy) publishes them, so
 * that a credit needs no message. Layout, in 64-bit words: [AIO_LANE_HEAD] credits published
 * (the producer's, written after the entry), [AIO_LANE_DONE] credits taken (ours),
 * [AIO_LANE_OPEN] 1 while this engine reads the lane (ours), [AIO_LANE_PID] the reading
 * process (written by the caller), then `entries` entries from [AIO_LANE_ENTRY]: credit s
 * is entry s % entries, (imm << 32) | weight, worth weight * AIO_CREDIT_UNIT. A producer
 * publishes credit s only once s - DONE < entries. The lane is watched like a word (the
 * poller reads its head at the watch interval, and the loop's aio_poll_ring too): each new
 * credit is added to its counter (aio_counter_add), then DONE is advanced. aio_lane_add sets
 * DONE to the head and OPEN to 1 and returns a watch id (aio_watch_remove ends it; the caller
 * clears OPEN); -FI_EINVAL for a bad lane, -FI_ENOSPC. */
#define AIO_LANE_HEAD 0
#define AIO_LANE_DONE 8
#define AIO_LANE_OPEN 9
#define AIO_LANE_PID 10
#define AIO_LANE_ENTRY 16
#define AIO_LANE_MAX 65536
int aio_lane_add(aio_engine *e, volatile uint64_t *lane, uint32_t entries);
/* A task of the loop starts (+1) or stops (-1) waiting for something a rail without a wait
 * object (shm) reports only when polled (a message): while any waits and work of ours is in
 * flight on such a rail, the poller polls it every 50 us instead of every millisecond. With
 * nothing of ours in flight it sleeps: aiote peers wake it when they post to it (see
 * core/shm_wake.c). Counter watches count by themselves. */
void aio_waiters_add(aio_engine *e, int32_t delta);

/* Memory interfaces for aio_mr_register_dev. */
#define AIO_HMEM_SYSTEM 0
#define AIO_HMEM_CUDA 1
/* Whether a rail's provider registers device memory (FI_HMEM: verbs/efa built with CUDA). */
int aio_rail_hmem(aio_engine *e, int rail);
/* aio_mr_register for memory of `iface` (AIO_HMEM_CUDA: a CUDA device pointer on GPU `device`),
 * on every rail; -FI_EOPNOTSUPP unless every rail has FI_HMEM (AIO_HMEM_SYSTEM: host memory). */
int aio_mr_register_dev(aio_engine *e, void *buf, uint64_t len, uint32_t access, int iface,
                        int device, aio_mr **out, char *err, size_t errlen);

/* Reads a watched word (or any 64-bit word) with acquire ordering. */
uint64_t aio_word_load(const volatile uint64_t *word);
/* Stores a 64-bit word with release ordering, then kicks the poller (host-side signal). */
void aio_word_store(aio_engine *e, volatile uint64_t *word, uint64_t value);

/* statistics */
typedef struct aio_stats {
    uint64_t polls;
    uint64_t sleeps;
    uint64_t wakeups_sent;
    uint64_t completions;
    uint64_t remote_data;
    uint64_t errors;
    uint64_t spin_window_ns; /* the poller's adaptive spin window now: 0 = the base (spin_ns) */
    uint64_t direct_ops;     /* direct same-host copies made (writes and reads) */
    uint64_t direct_mapped;  /* ... of which into or out of a peer's arena (memcpy) */
    uint64_t tcp_tuned;      /* tcp sockets whose send buffer the core set (aio_engine_set_tcp_sndbuf) */
    uint64_t posts_handed;   /* requests aio_post handed to the poller to post (below) */
    uint64_t posts_handed_waited; /* ... of which their connection's queue was full at first */
    uint64_t direct_split;   /* arena copies made in parts, by poller 0 and helper threads */
    uint64_t posts_peer_gone; /* requests not posted: their shm peer's process is gone (-FI_EHOSTDOWN) */
    int64_t follow_cpu;      /* the CPU poller 0 keeps to (follow_loop), -1: none */
    uint64_t follow_moves;   /* times poller 0 moved to the loop's CPU */
    uint64_t bytes_inflight; /* bytes of our writes and reads posted and not completed, all rails */
    uint64_t sends_in_place; /* messages posted with their body sent from where it lies (aio_submit_sendv_ref) */
} aio_stats;
void aio_get_stats(aio_engine *e, aio_stats *out);

/* Handing requests to the poller. A write or read that aio_post (or aio_submit) finds its rail
 * busy for (the poller holds the rail's lock while the provider moves data) is not waited for:
 * it is counted in flight, queued, and posted by the poller as soon as it lets go of the rail,
 * so the posting thread neither sleeps on the lock nor copies into sockets. Only for peers whose
 * connection carried a request since its last failure, and never for direct copies or gathered
 * pages. A handed request that the provider still refuses for room after 1 s, or whose peer's
 * connection failed meanwhile, completes with -FI_ETIMEDOUT (the caller's retry policy posts it
 * anew). While it waits, later handed requests to the same connection (rail and peer) wait
 * behind it, in order; the poller's other work (other rails, other peers, direct copies) goes
 * on (aio_stats.posts_handed_waited counts the requests that waited). mode: 0 (default) on
 * tcp rails: every eligible write of 16 KiB or more (its bytes are copied into the socket by
 * the poller, never by the posting thread), and smaller requests when the rail is busy; on shm
 * rails requests under 16 KiB when the rail is busy, and those behind handed ones; 1 hand
 * over every eligible request, on any rail (tests); -1 never. -FI_EINVAL for another mode. */
int aio_engine_set_hand_posts(aio_engine *e, int mode);

#ifdef __cplusplus
}
#endif
#endif
