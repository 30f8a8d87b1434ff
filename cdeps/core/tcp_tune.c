/* tcp send buffers: SO_SNDBUF on the tcp provider's own sockets.
 *
 * Theory of operation. Loopback tcp queues as much as the kernel's autotuning allows (4 MiB by
 * default) on each connection, and the receiver then copies that from memory rather than from
 * cache: a fixed SO_SNDBUF (aio_engine_set_tcp_sndbuf; the kernel doubles it) moved 16 MiB
 * writes about a third faster (docs/benchmarks.md). libfabric's tcp provider has no such knob
 * and hands out none of its sockets, so the core finds them and sets it itself: on the
 * listening socket of each tcp rail when the rail opens (its accepted connections inherit it),
 * and on the connection to each peer after the first posts to it (its connection is set up by
 * the provider then; a few scans per peer, TUNE_TRIES, since it may still be on its way).
 *
 * Which sockets are the rail's own (rail_sockets) is read from /proc: never a socket of the
 * application's or of another library, whatever its addresses. Among those, only the
 * listener and the connections it accepted (local address: the rail's) and the connection to
 * the peer (remote address: the peer's) are touched; by default only same-host ones (local and
 * remote IP equal; a listener only when bound to a loopback address). Scanning /proc/self/fd
 * costs a few system calls per open descriptor, on whichever thread posted (under the rail's
 * lock), a few times per peer. */
#include "internal.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/stat.h>

#include "tcp_tune.h"

#define TUNE_TRIES 3      /* scans per peer: its connection may still be on its way */
#define TUNE_MAX_ADDR 65536

int aio_engine_set_tcp_sndbuf(aio_engine *e, int32_t bytes, int all) {
    if (e->started || e->nrails || bytes < 0) return -FI_EINVAL;
    e->sndbuf = bytes;
    e->sndbuf_all = all ? 1 : 0;
    return 0;
}

/* The IP of an AF_INET/AF_INET6 address (len bytes at *ip), and its port; 0 for other families. */
static int sa_parts(const struct sockaddr *a, const void **ip, size_t *len, uint16_t *port) {
    if (a->sa_family == AF_INET) {
        const struct sockaddr_in *v = (const struct sockaddr_in *)(const void *)a;
        *ip = &v->sin_addr, *len = sizeof(v->sin_addr), *port = ntohs(v->sin_port);
        return 1;
    }
    if (a->sa_family == AF_INET6) {
        const struct sockaddr_in6 *v = (const struct sockaddr_in6 *)(const void *)a;
        *ip = &v->sin6_addr, *len = sizeof(v->sin6_addr), *port = ntohs(v->sin6_port);
        return 1;
    }
    return 0;
}

/* 1: same IP (and the same port when with_port); an unspecified IP in b matches any IP. */
static int sa_match(const struct sockaddr *a, const struct sockaddr *b, int with_port) {
    const void *ia, *ib;
    size_t la, lb;
    uint16_t pa, pb;
    if (!sa_parts(a, &ia, &la, &pa) || !sa_parts(b, &ib, &lb, &pb)) return 0;
    if (with_port && pa != pb) return 0;
    static const uint8_t zero[16];
    if (lb <= sizeof(zero) && !memcmp(ib, zero, lb)) return 1;
    return la == lb && !memcmp(ia, ib, la);
}

static int sa_loopback(const struct sockaddr *a) {
    if (a->sa_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)(const void *)a)->sin_addr.s_addr) >> 24) == 127;
    if (a->sa_family == AF_INET6)
        return IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)(const void *)a)->sin6_addr);
    return 0;
}

/* Which sockets are the rail's own. libfabric does not hand out its sockets, and addresses do
 * not tell them apart from the application's (a socket of the application connected to the
 * same peer port looks alike). But libfabric's tcp provider watches every socket of the rail
 * (its listener, the connections it made and accepted) in epoll sets that its CQ's wait object
 * (FI_GETWAIT: an epoll fd) holds, directly or through nested epoll sets. The kernel lists an
 * epoll set's members in /proc/self/fdinfo/<epfd> ("tfd: <fd> ... ino:<hex>"), with the inode
 * of the file registered, which tells a reused descriptor number apart. So the rail's sockets
 * are the inodes reached from its wait fd, and only those are ever tuned (aio__tcp_tune). Fills
 * `ino` (at most `max`), returns how many; 0 when the rail has no epoll wait object. */
#define RAIL_SOCKS_MAX 4096

static int rail_sockets(aio_rail *r, uint64_t *ino, int max) {
    if (r->wait_fd < 0) return 0;
    enum { MAX_EP = 64 };
    int ep[MAX_EP], nep = 0, n = 0;
    ep[nep++] = r->wait_fd;
    for (int k = 0; k < nep; k++) {
        char path[64], link[64];
        snprintf(path, sizeof(path), "/proc/self/fd/%d", ep[k]);
        ssize_t ll = readlink(path, link, sizeof(link) - 1);
        if (ll <= 0) continue;
        link[ll] = 0;
        if (strcmp(link, "anon_inode:[eventpoll]")) continue;
        snprintf(path, sizeof(path), "/proc/self/fdinfo/%d", ep[k]);
        FILE *f = fopen(path, "re");
        if (!f) continue;
        char line[256];
        while (fgets(line, sizeof(line), f)) {
            int tfd;
            if (sscanf(line, "tfd: %d", &tfd) != 1) continue;
            const char *ip = strstr(line, "ino:");
            unsigned long long want = ip ? strtoull(ip + 4, NULL, 16) : 0;
            snprintf(path, sizeof(path), "/proc/self/fd/%d", tfd);
            ll = readlink(path, link, sizeof(link) - 1);
            if (ll <= 0) continue;
            link[ll] = 0;
            if (!strcmp(link, "anon_inode:[eventpoll]")) {
                int seen = 0;
                for (int j = 0; j < nep; j++) seen |= ep[j] == tfd;
                if (!seen && nep < MAX_EP) ep[nep++] = tfd;
                continue;
            }
            unsigned long long si;
            if (sscanf(link, "socket:[%llu]", &si) != 1 || !want || si != want) continue;
            if (n < max) ino[n++] = si;
        }
        fclose(f);
    }
    return n;
}

/* Sets e->sndbuf on the rail's sockets (see aio_engine_set_tcp_sndbuf): among those that are
 * the rail's own (rail_sockets: never a socket of the application's, whatever its addresses),
 * those whose local address is the rail's listening address (the listener and the connections
 * it accepted), and the connection to `peer` (its remote address is the peer's listening
 * address); same-host ones only unless sndbuf_all. Walks /proc/self/fd: a few system calls per
 * open descriptor. Returns 1 when it saw the connection to `peer`. */
int aio__tcp_tune(aio_engine *e, aio_rail *r, const struct sockaddr *peer) {
    uint64_t *own = malloc(RAIL_SOCKS_MAX * sizeof(uint64_t));
    if (!own) return 0;
    int nown = rail_sockets(r, own, RAIL_SOCKS_MAX);
    DIR *d = nown ? opendir("/proc/self/fd") : NULL;
    if (!d) {
        free(own);
        return 0;
    }
    struct sockaddr_storage mine_ss;
    memset(&mine_ss, 0, sizeof(mine_ss));
    memcpy(&mine_ss, r->addr, r->addr_len < sizeof(mine_ss) ? r->addr_len : sizeof(mine_ss));
    const struct sockaddr *me = (const struct sockaddr *)&mine_ss;
    int want = e->sndbuf, found = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] < '0' || de->d_name[0] > '9') continue;
        int fd = atoi(de->d_name), v = 0;
        socklen_t l = sizeof(v);
        if (fd == dirfd(d) || getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &v, &l) || v != IPPROTO_TCP) continue;
        struct stat st;
        int owned = 0;
        if (fstat(fd, &st) == 0)
            for (int k = 0; k < nown && !owned; k++) owned = own[k] == (uint64_t)st.st_ino;
        if (!owned) continue; /* not the rail's: the application's, or another library's */
        struct sockaddr_storage loc, rem;
        socklen_t ll = sizeof(loc), rl = sizeof(rem);
        if (getsockname(fd, (struct sockaddr *)&loc, &ll)) continue;
        int connected = getpeername(fd, (struct sockaddr *)&rem, &rl) == 0;
        int mine = sa_match((struct sockaddr *)&loc, me, 1); /* the listener or one it accepted */
        int to_peer = connected && peer && sa_match((struct sockaddr *)&rem, peer, 1);
        if (!mine && !to_peer) continue;
        if (to_peer) found = 1;
        if (!e->sndbuf_all && (connected ? !sa_match((struct sockaddr *)&loc, (struct sockaddr *)&rem, 0)
                                         : !sa_loopback((struct sockaddr *)&loc)))
            continue; /* another host's connection (or a listener that may accept one) */
        /* done already: the kernel reports twice the size asked, or what it gave an earlier
         * socket (it caps the size at net.core.wmem_max) */
        l = sizeof(v);
        int had = getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, &l) ? -1 : v;
        if (had == 2 * want || (had > 0 && had == atomic_load(&e->sndbuf_got))) continue;
        if (setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof(want))) continue;
        atomic_fetch_add(&e->st_tuned, 1);
        l = sizeof(v);
        if (!getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, &l)) atomic_store(&e->sndbuf_got, v);
    }
    closedir(d);
    free(own);
    return found;
}

/* After a post to `fa` on a tcp rail: the first posts to a peer set up its connection; tune it
 * (at most TUNE_TRIES scans per peer). Caller holds r->mu. */
void aio__tcp_tune_peer(aio_engine *e, aio_rail *r, fi_addr_t fa) {
    if (fa >= TUNE_MAX_ADDR) return;
    if (fa >= r->tune_cap) {
        uint32_t cap = r->tune_cap ? r->tune_cap : 64;
        while (cap <= fa) cap *= 2;
        uint8_t *t = realloc(r->tune_tries, cap);
        if (!t) return;
        memset(t + r->tune_cap, 0, cap - r->tune_cap);
        r->tune_tries = t, r->tune_cap = cap;
    }
    if (r->tune_tries[fa] >= TUNE_TRIES) return;
    r->tune_tries[fa]++;
    struct sockaddr_storage pa;
    size_t pl = sizeof(pa);
    if (fi_av_lookup(r->av, fa, &pa, &pl) == 0 && pl <= sizeof(pa) &&
        aio__tcp_tune(e, r, (struct sockaddr *)&pa))
        r->tune_tries[fa] = TUNE_TRIES;
}
