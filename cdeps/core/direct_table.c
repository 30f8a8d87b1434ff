/* Same-host direct copies, the tables: what a target publishes and an initiator attaches to.
 *
 * Theory of operation. libfabric 1.17's shm provider carries a write out at the target (the
 * target's progress copies the bytes while holding the lock its senders need), checks no key,
 * no bounds and no access right, and never fails a request to a process that died. So aiote
 * copies between same-host processes itself, from the initiator's poller (direct_copy.c), the
 * way UCX's same-host path works, and keeps the target's checks with a table the target
 * publishes: a memfd holding one slot per registered host region (key, base, length, access),
 * which peers open through /proc/<pid>/fd/<fd> (which takes the same permission as the copies
 * themselves) and map. The layout is fixed
 * (direct_table in internal.h, DIRECT_VERSION): processes built from different sources may
 * share it.
 *
 * A slot is published by writing base, length and access, then the key (seq_cst): a reader
 * that sees the key sees the rest. An initiator sets its busy bit in the slot, then reads the
 * key; the owner retiring a region clears the key, then reads the busy bits: either it sees
 * the mark and waits (aio__direct_retire, a bounded wait; aio_mr_close says -FI_EBUSY and is
 * called again), or the initiator sees the cleared key and does not copy. Marks of engines
 * whose process died are cleared (their pid is in the table's peers[], checked with kill 0).
 * So a stale descriptor never writes into memory its owner unregistered.
 *
 * Attaching (aio_direct_attach, from the loop, under dmu) maps the peer's table after checking
 * it is the one the peer published (magic, version, nonce, pid, not closed), claims a bit in
 * its peers[] (the busy bit), opens a pidfd to learn when the process exits (aio__peer_gone:
 * a poll, no wait), and proves with a one-word process_vm_readv of the table's nonce that this
 * process may copy from and into it. If the peer published an arena (a memfd the peer maps
 * and allocates buffers from: aio_engine_set_arena), it is mapped here as well, after its
 * device and inode are checked against the table's, and copies into it are a plain memcpy.
 * Attachments are entries of e->dpeers that only grow (ndpeers); the poller reads them
 * without dmu, which is safe because an entry is released (aio_direct_detach) and reused only
 * when its caller promises that nothing of it is queued or in flight. */
#include "internal.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>

#include "direct_table.h"

#define DIRECT_MAGIC 0x414d43455449414fULL /* "OAITECMA" */
#define DIRECT_VERSION 2

static int pid_alive(int32_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

/* A free slot for a region (caller holds mr_mu), or -1 when the table is full. */
static int32_t direct_slot_get(aio_engine *e) {
    for (uint32_t k = 0; k < AIO_DIRECT_SLOTS; k++) {
        uint32_t i = (e->dhint + k) % AIO_DIRECT_SLOTS;
        if (!e->dused[i]) {
            e->dused[i] = 1;
            e->dhint = i + 1;
            return (int32_t)i;
        }
    }
    return -1;
}

/* Closes a slot to new copies and waits briefly for those under way: 0 when none is left,
 * -FI_EBUSY when an attached process that is alive still copies (the caller tries again later).
 * A mark whose engine detached or whose process died is cleared: it can copy no more. */
int aio__direct_retire(direct_table *t, int32_t idx, int64_t wait_ns) {
    direct_slot *s = &t->slots[idx];
    atomic_store(&s->key, 0); /* seq_cst, then busy is read: see aio__direct_copy */
    int64_t until = now_ns() + wait_ns;
    for (;;) {
        uint64_t b = atomic_load(&s->busy);
        if (!b) return 0;
        if (now_ns() >= until) {
            for (int p = 0; p < AIO_DIRECT_PEERS; p++) {
                if (!(b & (1ULL << p))) continue;
                int32_t pid = atomic_load(&t->peers[p]);
                if (!pid_alive(pid)) atomic_fetch_and(&s->busy, ~(1ULL << p));
            }
            return atomic_load(&s->busy) ? -FI_EBUSY : 0;
        }
        sched_yield();
    }
}

int aio_engine_enable_direct(aio_engine *e, char *err, size_t errlen) {
    if (e->dtab) return 0;
    int shm = 0;
    for (int i = 0; i < e->nrails; i++) shm |= e->rails[i]->is_shm;
    if (!shm) {
        aio__set_err(err, errlen, "direct same-host copies need an shm rail");
        return -FI_EINVAL;
    }
    int fd = memfd_create("aiote-direct", MFD_CLOEXEC);
    if (fd < 0) {
        aio__set_err(err, errlen, "memfd_create: %s", strerror(errno));
        return -errno;
    }
    if (ftruncate(fd, sizeof(direct_table)) != 0) {
        int en = errno;
        close(fd);
        aio__set_err(err, errlen, "ftruncate: %s", strerror(en));
        return -en;
    }
    void *p = mmap(NULL, sizeof(direct_table), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    uint8_t *used = calloc(AIO_DIRECT_SLOTS, 1);
    if (p == MAP_FAILED || !used) {
        int en = p == MAP_FAILED ? errno : ENOMEM;
        if (p != MAP_FAILED) munmap(p, sizeof(direct_table));
        free(used);
        close(fd);
        aio__set_err(err, errlen, "mapping the direct-copy table: %s", strerror(en));
        return -en;
    }
    direct_table *t = p; /* zero-filled by ftruncate */
    t->magic = DIRECT_MAGIC;
    t->version = DIRECT_VERSION;
    t->nslots = AIO_DIRECT_SLOTS;
    t->pid = (int32_t)getpid();
    while (getrandom(&t->nonce, sizeof(t->nonce), 0) != sizeof(t->nonce)) {
    }
    pthread_mutex_lock(&e->mr_mu);
    e->dused = used;
    e->dfd = fd;
    e->dtab = t;
    pthread_mutex_unlock(&e->mr_mu);
    return 0;
}

int aio_direct_info_get(aio_engine *e, aio_direct_info *out) {
    if (!e->dtab) return -FI_ENODATA;
    out->pid = e->dtab->pid;
    out->fd = e->dfd;
    out->nonce = e->dtab->nonce;
    out->table = (uint64_t)(uintptr_t)e->dtab;
    return 0;
}

int32_t aio_mr_direct_slot(aio_mr *m) { return m->direct_slot; }

int aio_engine_set_arena(aio_engine *e, int fd, void *base, uint64_t len, char *err, size_t errlen) {
    struct stat st;
    if (!e->dtab) {
        aio__set_err(err, errlen, "an arena needs the direct-copy table (aio_engine_enable_direct)");
        return -FI_EINVAL;
    }
    if (!base || len == 0 || (uintptr_t)base % 4096 || fd < 0 || fstat(fd, &st) != 0 ||
        !S_ISREG(st.st_mode) || (uint64_t)st.st_size < len) {
        aio__set_err(err, errlen, "the arena must be a page-aligned mapping of a memfd at least len long");
        return -FI_EINVAL;
    }
    pthread_mutex_lock(&e->mr_mu);
    int used = e->afd >= 0;
    for (uint32_t i = 0; i < AIO_DIRECT_SLOTS && !used; i++) used = e->dused[i];
    int dup_fd = used ? -1 : fcntl(fd, F_DUPFD_CLOEXEC, 0);
    int en = errno;
    if (used || dup_fd < 0) {
        pthread_mutex_unlock(&e->mr_mu);
        if (used) aio__set_err(err, errlen, "the arena is set before any region is registered, once");
        else aio__set_err(err, errlen, "dup: %s", strerror(en));
        return used ? -FI_EBUSY : -en;
    }
    e->afd = dup_fd;
    direct_table *t = e->dtab;
    t->arena_fd = dup_fd;
    t->arena_base = (uint64_t)(uintptr_t)base;
    t->arena_dev = (uint64_t)st.st_dev;
    t->arena_ino = (uint64_t)st.st_ino;
    atomic_store((_Atomic uint64_t *)&t->arena_len, len); /* before any slot's key: see aio__direct_publish */
    pthread_mutex_unlock(&e->mr_mu);
    return 0;
}

/* Publishes a new region in the table (caller holds mr_mu): its slot, or -1. */
int32_t aio__direct_publish(aio_engine *e, aio_mr *m) {
    int first = -1;
    for (int i = 0; i < m->nrails && first < 0; i++)
        if (e->rails[i]->is_shm) first = i;
    if (first < 0 || m->key[first] == 0) return -1;
    int32_t idx = direct_slot_get(e);
    if (idx < 0) return -1;
    direct_slot *s = &e->dtab->slots[idx];
    atomic_store_explicit(&s->base, (uint64_t)(uintptr_t)m->buf, memory_order_relaxed);
    atomic_store_explicit(&s->len, m->len, memory_order_relaxed);
    atomic_store_explicit(&s->access, m->access, memory_order_relaxed);
    atomic_store(&s->key, m->key[first]); /* publishes the fields above */
    return idx;
}

void aio__direct_unpublish(aio_engine *e, aio_mr *m) {
    pthread_mutex_lock(&e->mr_mu);
    e->dused[m->direct_slot] = 0;
    m->direct_slot = -1;
    pthread_mutex_unlock(&e->mr_mu);
}

/* The attachment to this peer's table (same pid and nonce) while it is alive, or -1. Caller
 * holds dmu. */
static int dpeer_find(aio_engine *e, const aio_direct_info *pi, int n) {
    for (int i = 0; i < n; i++) {
        direct_peer *p = &e->dpeers[i];
        if (p->t && p->pid == pi->pid && p->nonce == pi->nonce && !atomic_load(&p->dead)) return i;
    }
    return -1;
}

/* Opens and maps the peer's table, and checks it is the one the peer published (closed, or
 * another process's, it is not): 0, or a negative error with `err` filled. *fd and *t are set
 * as far as it got (the caller closes and unmaps them). */
static int table_open(const aio_direct_info *pi, int *fd, direct_table **t, char *err, size_t errlen) {
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)pi->pid, (int)pi->fd);
    *fd = open(path, O_RDWR | O_CLOEXEC);
    struct stat st;
    if (*fd < 0 || fstat(*fd, &st) != 0 || (uint64_t)st.st_size < sizeof(direct_table)) {
        int ret = *fd < 0 ? -errno : -FI_EINVAL;
        aio__set_err(err, errlen, "opening the peer's table %s: %s", path,
                     *fd < 0 ? strerror(errno) : "not a table");
        return ret;
    }
    *t = mmap(NULL, sizeof(direct_table), PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
    if (*t == MAP_FAILED) {
        int ret = -errno;
        aio__set_err(err, errlen, "mapping the peer's table: %s", strerror(errno));
        return ret;
    }
    direct_table *m = *t;
    if (m->magic != DIRECT_MAGIC || m->version != DIRECT_VERSION || m->nslots != AIO_DIRECT_SLOTS ||
        m->nonce != pi->nonce || m->pid != pi->pid || atomic_load(&m->closed)) {
        aio__set_err(err, errlen, "%s is not the table the peer published (closed, or another process)",
                     path);
        return -FI_EINVAL;
    }
    return 0;
}

/* Takes a place in the table's peers[] for this process (`me`): its index, our bit in the
 * slots' busy words, or -1 when every place is held by a living process. */
static int table_join(direct_table *t, int32_t me) {
    int index = -1;
    for (int p = 0; p < AIO_DIRECT_PEERS && index < 0; p++) {
        int32_t cur = atomic_load(&t->peers[p]);
        if (cur != 0 && pid_alive(cur)) continue;
        if (!atomic_compare_exchange_strong(&t->peers[p], &cur, me)) continue;
        index = p;
        if (cur != 0) /* the marks of an engine whose process died are void */
            for (int k = 0; k < AIO_DIRECT_SLOTS; k++) atomic_fetch_and(&t->slots[k].busy, ~(1ULL << p));
    }
    return index;
}

/* The probe: the table's nonce read through the peer's memory proves that this process may
 * copy from and into it (the same permission) and that the pid names the table's owner. 0, or
 * a negative error with `err` filled. */
static int table_probe(const aio_direct_info *pi, char *err, size_t errlen) {
    uint64_t v = 0;
    struct iovec lio = {.iov_base = &v, .iov_len = sizeof(v)};
    struct iovec rio = {.iov_base = (void *)(uintptr_t)(pi->table + offsetof(direct_table, nonce)),
                        .iov_len = sizeof(v)};
    ssize_t k = process_vm_readv((pid_t)pi->pid, &lio, 1, &rio, 1, 0);
    if (k != (ssize_t)sizeof(v) || v != pi->nonce) {
        int ret = k < 0 ? -errno : -FI_EINVAL;
        aio__set_err(err, errlen, "a probe copy from process %d %s", (int)pi->pid,
                     k < 0 ? strerror(errno) : "did not read its table");
        return ret;
    }
    return 0;
}

/* The peer's arena, if it has one: mapped here, after checking the file is the one it
 * published (its fd number names that file in its process, the device and inode say so).
 * 0 with *amap (NULL: no arena) and *alen, or -FI_EINVAL with `err` filled. */
static int arena_map(const aio_direct_info *pi, direct_table *t, char **amap, uint64_t *alen, char *err,
                     size_t errlen) {
    *amap = NULL;
    *alen = atomic_load((_Atomic uint64_t *)&t->arena_len);
    if (!*alen) return 0;
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)pi->pid, (int)t->arena_fd);
    int afd = open(path, O_RDWR | O_CLOEXEC);
    struct stat ast;
    void *am = MAP_FAILED;
    if (afd >= 0 && fstat(afd, &ast) == 0 && (uint64_t)ast.st_dev == t->arena_dev &&
        (uint64_t)ast.st_ino == t->arena_ino && (uint64_t)ast.st_size >= *alen)
        am = mmap(NULL, *alen, PROT_READ | PROT_WRITE, MAP_SHARED, afd, 0);
    if (afd >= 0) close(afd);
    if (am == MAP_FAILED) {
        aio__set_err(err, errlen, "mapping the peer's arena %s: %s", path,
                     afd < 0 ? strerror(errno) : "not the file it published");
        return -FI_EINVAL;
    }
    *amap = am;
    return 0;
}

int aio_direct_attach(aio_engine *e, const aio_direct_info *pi, char *err, size_t errlen) {
    pthread_mutex_lock(&e->dmu);
    int n = atomic_load(&e->ndpeers);
    int found = dpeer_find(e, pi, n);
    if (found >= 0) {
        pthread_mutex_unlock(&e->dmu);
        return found;
    }
    int slot = n; /* an entry freed by aio_direct_detach is reused first */
    for (int i = 0; i < n && slot == n; i++)
        if (e->dpeers && !e->dpeers[i].t) slot = i;
    int ret = 0;
    int fd = -1, pidfd = -1, index = -1;
    direct_table *t = MAP_FAILED;
    int32_t me = (int32_t)getpid();
    if (!e->dpeers && !(e->dpeers = calloc(AIO_DIRECT_ATTACH, sizeof(direct_peer)))) {
        ret = -FI_ENOMEM;
        goto out;
    }
    if (slot >= AIO_DIRECT_ATTACH) {
        aio__set_err(err, errlen, "this engine is attached to %d peers' tables already", n);
        ret = -FI_ENOSPC;
        goto out;
    }
    if ((ret = table_open(pi, &fd, &t, err, errlen))) goto out;
    pidfd = (int)syscall(SYS_pidfd_open, (pid_t)pi->pid, 0);
    if (pidfd < 0) {
        ret = -errno;
        aio__set_err(err, errlen, "pidfd_open(%d): %s", (int)pi->pid, strerror(errno));
        goto out;
    }
    index = table_join(t, me);
    if (index < 0) {
        aio__set_err(err, errlen, "the peer's table has %d attached engines already", AIO_DIRECT_PEERS);
        ret = -FI_ENOSPC;
        goto out;
    }
    char *amap = NULL;
    uint64_t alen = 0;
    if ((ret = table_probe(pi, err, errlen)) || (ret = arena_map(pi, t, &amap, &alen, err, errlen))) {
        atomic_store(&t->peers[index], 0);
        goto out;
    }
    direct_peer *p = &e->dpeers[slot];
    p->amap = amap;
    p->abase = t->arena_base;
    p->alen = alen;
    p->t = t;
    p->pid = pi->pid;
    p->pidfd = pidfd;
    p->nonce = pi->nonce;
    p->index = index;
    atomic_store(&p->dead, 0);
    p->checked = 0;
    close(fd);
    if (slot == n) atomic_store(&e->ndpeers, n + 1);
    pthread_mutex_unlock(&e->dmu);
    return slot;
out:
    if (fd >= 0) close(fd);
    if (pidfd >= 0) close(pidfd);
    if (t != MAP_FAILED) munmap(t, sizeof(direct_table));
    pthread_mutex_unlock(&e->dmu);
    return ret;
}

/* Lets go of a peer's table: our busy marks and our place in it, its mappings and its pidfd.
 * The entry is reused by a later attach. Caller's promise: nothing of ours to that peer is
 * queued or in flight, and no direct code naming it will be posted again. */
static void dpeer_release(direct_peer *p) {
    int32_t me = (int32_t)getpid();
    for (int k = 0; k < AIO_DIRECT_SLOTS; k++) atomic_fetch_and(&p->t->slots[k].busy, ~(1ULL << p->index));
    atomic_compare_exchange_strong(&p->t->peers[p->index], &me, 0);
    munmap(p->t, sizeof(direct_table));
    if (p->amap) munmap(p->amap, p->alen);
    close(p->pidfd);
    p->t = NULL, p->amap = NULL, p->pid = 0, p->pidfd = -1;
}

int aio_direct_detach(aio_engine *e, int attach) {
    pthread_mutex_lock(&e->dmu);
    int ret = -FI_EINVAL;
    if (attach >= 0 && attach < atomic_load(&e->ndpeers) && e->dpeers[attach].t) {
        dpeer_release(&e->dpeers[attach]);
        ret = 0;
    }
    pthread_mutex_unlock(&e->dmu);
    return ret;
}

int aio_direct_gone(aio_engine *e, int attach) {
    pthread_mutex_lock(&e->dmu);
    int ret = -FI_EINVAL;
    if (attach >= 0 && attach < atomic_load(&e->ndpeers) && e->dpeers[attach].t)
        ret = aio__peer_gone(&e->dpeers[attach]);
    pthread_mutex_unlock(&e->dmu);
    return ret;
}

int aio_direct_mark(aio_engine *e, int attach, int32_t slot, int on) {
    if (attach < 0 || attach >= atomic_load(&e->ndpeers) || slot < 0 || slot >= AIO_DIRECT_SLOTS ||
        !e->dpeers[attach].t)
        return -FI_EINVAL;
    direct_peer *p = &e->dpeers[attach];
    if (on) atomic_fetch_or(&p->t->slots[slot].busy, 1ULL << p->index);
    else atomic_fetch_and(&p->t->slots[slot].busy, ~(1ULL << p->index));
    return 0;
}

/* Whether an attached peer's process exited or closed its table (its pidfd is readable):
 * marks it dead for good. A poll of the pidfd, no wait. */
int aio__peer_gone(direct_peer *p) {
    if (atomic_load(&p->dead)) return 1;
    struct pollfd pf = {.fd = p->pidfd, .events = POLLIN};
    if (poll(&pf, 1, 0) > 0 || atomic_load(&p->t->closed)) {
        atomic_store(&p->dead, 1);
        return 1;
    }
    return 0;
}

void aio__direct_destroy(aio_engine *e) {
    for (int i = 0; i < atomic_load(&e->ndpeers); i++)
        if (e->dpeers[i].t) dpeer_release(&e->dpeers[i]);
    free(e->dpeers);
    if (e->dtab) { /* closed since aio_engine_destroy began */
        munmap(e->dtab, sizeof(direct_table));
        close(e->dfd);
        free(e->dused);
    }
    if (e->afd >= 0) close(e->afd);
}
