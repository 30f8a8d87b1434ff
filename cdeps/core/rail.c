/* Rails: one libfabric domain and RDM endpoint each, and what the engine keeps per rail.
 *
 * Theory of operation. A rail is one NIC as libfabric opens it (a domain of a provider: an
 * interface for tcp, a device for verbs or efa, the host for shm): its fabric, domain,
 * completion queue (with a wait fd where the provider gives one: the poller sleeps on it),
 * address vector (FI_AV_TABLE: a peer is an index) and RDM endpoint. An engine has up to
 * AIO_MAX_RAILS of them, added before it starts (aio_engine_add_rail, from the thread that
 * builds it) and kept until it is destroyed. Every libfabric call on a rail is made under the
 * rail's lock, r->mu: the domain is opened FI_THREAD_DOMAIN, so posting threads, the rail's
 * poller and the loop in aio_poll_ring never meet inside the provider.
 *
 * Besides its fabric objects a rail owns its message slots (recv_slots buffers of slot_size
 * bytes to receive into, registered and posted when it opens and reposted by the loop once it
 * has read a message, and as many to send from), its op pool (cfg.max_ops ops: the contexts of
 * our requests), and per peer address what the other parts keep: how to wake it (shm_wake.c),
 * how often its tcp connection was looked for (tcp_tune.c), whether requests to it may be
 * handed over (handoff.c). That state is reset when an address is removed from the address
 * vector, or when libfabric hands out a removed address again. It also counts the bytes of our
 * writes and reads posted on it and not completed (op_start adds, aio__complete_op takes
 * away): aio_least_loaded picks the stream of a NIC that has the fewest.
 *
 * A tcp rail on a named interface is pinned to it by its address (ofi_rxm ignores the domain
 * name in the hints), listens on base_port + its index among such rails when a base port is
 * set, and has its link watched (link.c). A rail asks for device memory (FI_HMEM) first where
 * the provider may have it. Rail i is driven by poller i % npollers (poller.c). */
#include "internal.h"

#include <arpa/inet.h>
#include <net/if.h>
#include <sys/epoll.h>

#include "completion.h"
#include "fabric.h"
#include "handoff.h"
#include "link.h"
#include "memory.h"
#include "poller.h"
#include "rail.h"
#include "shm_wake.h"
#include "tcp_tune.h"

void aio__rail_free(aio_rail *r) {
    if (!r) return;
    if (r->ep) fi_close(&r->ep->fid);
    if (r->recv_mr) fi_close(&r->recv_mr->fid);
    if (r->send_mr) fi_close(&r->send_mr->fid);
    if (r->av) fi_close(&r->av->fid);
    if (r->cq) fi_close(&r->cq->fid);
    if (r->domain) fi_close(&r->domain->fid);
    if (r->fabric) fi_close(&r->fabric->fid);
    if (r->info) fi_freeinfo(r->info);
    free(r->ops);
    free(r->recv_ops);
    free(r->recv_buf);
    free(r->send_buf);
    free(r->send_free);
    free(r->tune_tries);
    for (int i = 0; i < DEFER_PEERS / DEFER_CHUNK; i++) free((void *)atomic_load(&r->defer_ok[i]));
    aio__shm_own_release(r); /* after the endpoint's own file is gone (fi_close above) */
    pthread_mutex_destroy(&r->mu);
    pthread_mutex_destroy(&r->pool_mu);
    free(r);
}

/* A new rail, nothing opened yet: its locks, its index, what kind of provider it is, and for tcp
 * on a named interface the address (`node`) and port (`service`) its endpoint is pinned to, and
 * its link watch. NULL: out of memory. */
static aio_rail *rail_new(aio_engine *e, const char *provider, const char *nic, char *node, size_t nodelen,
                          char *service, size_t servicelen) {
    aio_rail *r = calloc(1, sizeof(*r));
    if (!r) return NULL;
    pthread_mutex_init(&r->mu, NULL);
    pthread_mutex_init(&r->pool_mu, NULL);
    r->index = e->nrails;
    r->wait_fd = -1;
    r->wake_fd = -1;
    int by_addr = strncmp(aio__map_provider(provider), "tcp", 3) == 0 && aio__nic_address(nic, node, nodelen);
    if (by_addr) { /* an interface: watch its link */
        r->ifindex = (int)if_nametoindex(nic);
        atomic_store(&r->link_up, r->ifindex ? aio__iface_up(r->ifindex) : 1);
    } else {
        atomic_store(&r->link_up, 1);
    }
    if (by_addr && e->cfg.base_port) {
        int n = 0;
        for (int i = 0; i < e->nrails; i++)
            if (e->rails[i]->ifindex || e->rails[i]->by_addr) n++;
        snprintf(service, servicelen, "%u", (unsigned)(e->cfg.base_port + (uint32_t)n));
    }
    r->by_addr = by_addr;
    r->is_shm = strcmp(aio__map_provider(provider), "shm") == 0;
    r->is_tcp = strncmp(aio__map_provider(provider), "tcp", 3) == 0;
    return r;
}

/* fi_getinfo for the rail, into r->info: what fi_getinfo said (r->info NULL unless 0), or 1
 * when there was no memory for the hints. Device memory (FI_HMEM) first where a provider may
 * have it; Debian's socket-based and shared-memory providers are built without CUDA, so they
 * are not asked (it costs a probe). */
static int rail_getinfo(aio_rail *r, const char *provider, const char *nic, const char *node,
                        const char *service) {
    int ret = 0;
    const char *mp = aio__map_provider(provider);
    int try_hmem = strncmp(mp, "tcp", 3) && strcmp(mp, "shm") && strcmp(mp, "sockets") &&
                   strncmp(mp, "udp", 3) && !getenv("AIOTE_NO_HMEM");
    for (int pass = try_hmem ? 0 : 1; pass < 2; pass++) {
        struct fi_info *hints = aio__make_hints(provider, r->by_addr ? NULL : nic);
        if (!hints) return 1;
        if (pass == 0) {
            hints->caps |= FI_HMEM;
            hints->domain_attr->mr_mode |= FI_MR_HMEM;
        }
        ret = fi_getinfo(FI_VERSION(1, 9), r->by_addr ? node : NULL, service[0] ? service : NULL,
                         r->by_addr ? FI_SOURCE : 0, hints, &r->info);
        fi_freeinfo(hints);
        if (ret == 0 && r->info) break;
        if (r->info) {
            fi_freeinfo(r->info);
            r->info = NULL;
        }
    }
    return ret;
}

/* Keeps only the entry of the NIC asked for (by domain name; a tcp rail pinned by address has
 * only its own), first: 0, or -FI_ENODATA (r->info freed) when there is none. */
static int rail_keep_nic(aio_rail *r, const char *nic) {
    if (!r->info || !nic || !*nic || r->by_addr) return 0;
    struct fi_info *keep = NULL, **pp = &r->info;
    for (struct fi_info *i = r->info; i; i = i->next)
        if (!keep && i->domain_attr->name && !strcmp(i->domain_attr->name, nic)) keep = i;
    if (!keep) {
        fi_freeinfo(r->info);
        r->info = NULL;
        return -FI_ENODATA;
    }
    if (keep != r->info) {
        while (*pp != keep) pp = &(*pp)->next;
        *pp = keep->next;
        keep->next = r->info;
        r->info = keep;
    }
    return 0;
}

/* Says why no rail could be opened, naming the NICs the provider offers. */
static void rail_getinfo_error(const char *provider, const char *nic, int ret, char *err, size_t errlen) {
    char nics[512];
    aio__list_nics(provider, nics, sizeof(nics));
    if (nic && *nic && nics[0])
        aio__set_err(err, errlen, "provider '%s' has no NIC named '%s' (it offers: %s)", provider,
                     nic, nics);
    else if (nics[0] == 0)
        aio__set_err(err, errlen,
                     "libfabric offers no provider '%s' with RDM endpoints, RMA and remote CQ data "
                     "on this machine (%s)",
                     provider, fi_strerror(-ret));
    else
        aio__set_err(err, errlen, "provider '%s' could not open '%s': %s", provider,
                     nic ? nic : "(any)", fi_strerror(-ret));
}

/* Takes the attributes aiote uses from r->info (its only entry from now on): 0, or -FI_ENOSYS
 * when the provider carries no immediates. */
static int rail_take_info(aio_rail *r, const char *provider, char *err, size_t errlen) {
    struct fi_info *fi = r->info;
    if (fi->next) {
        fi_freeinfo(fi->next);
        fi->next = NULL;
    }
    r->mr_mode = (uint64_t)fi->domain_attr->mr_mode;
    r->mode = fi->mode;
    r->cq_data_size = (uint32_t)fi->domain_attr->cq_data_size;
    r->tx_op_flags = fi->tx_attr->op_flags & (FI_DELIVERY_COMPLETE | FI_TRANSMIT_COMPLETE);
    r->iov_limit = fi->tx_attr->iov_limit ? fi->tx_attr->iov_limit : 1;
    if (r->iov_limit > AIO_MAX_GATHER) r->iov_limit = AIO_MAX_GATHER;
    if (r->cq_data_size < 4) {
        aio__set_err(err, errlen, "provider '%s' carries no remote CQ data (immediates)", provider);
        return -FI_ENOSYS;
    }
    return 0;
}

/* In the helpers below, which return what failed (the caller frees the rail): a libfabric call
 * that must succeed, its failure told in `err`. */
#define CHECK(call, what)                                                                         \
    do {                                                                                          \
        ret = (call);                                                                             \
        if (ret) {                                                                                \
            aio__set_err(err, errlen, "%s on provider '%s': %s", what, provider, fi_strerror(-ret)); \
            return ret;                                                                           \
        }                                                                                         \
    } while (0)

/* Opens the rail's fabric objects: fabric, domain, CQ (with its wait fd when the provider has
 * one), address vector, endpoint (named first on shm: shm_wake.c); then its address, and on
 * tcp its listener's send buffer. 0 or a negative error. */
static int rail_open(aio_engine *e, aio_rail *r, const char *provider, char *err, size_t errlen) {
    int ret;
    struct fi_info *fi = r->info;
    CHECK(fi_fabric(fi->fabric_attr, &r->fabric, NULL), "fi_fabric");
    CHECK(fi_domain(r->fabric, fi, &r->domain, NULL), "fi_domain");
    struct fi_cq_attr cqa;
    memset(&cqa, 0, sizeof(cqa));
    cqa.format = FI_CQ_FORMAT_DATA;
    cqa.size = 0;
    cqa.wait_obj = FI_WAIT_FD;
    ret = fi_cq_open(r->domain, &cqa, &r->cq, NULL);
    if (ret == 0) {
        int fd = -1;
        if (fi_control(&r->cq->fid, FI_GETWAIT, &fd) == 0 && fd >= 0) r->wait_fd = fd;
        /* over sockets the CQ's wait set holds the connections' sockets; on verbs or efa it
         * is a completion channel, and re-arming it while spinning would cost interrupts */
        const char *pn = fi->fabric_attr->prov_name ? fi->fabric_attr->prov_name : "";
        r->bytes_fd = r->wait_fd >= 0 && (strstr(pn, "tcp") || strstr(pn, "sockets"));
    } else {
        cqa.wait_obj = FI_WAIT_NONE;
        CHECK(fi_cq_open(r->domain, &cqa, &r->cq, NULL), "fi_cq_open");
    }
    struct fi_av_attr ava;
    memset(&ava, 0, sizeof(ava));
    ava.type = FI_AV_TABLE;
    CHECK(fi_av_open(r->domain, &ava, &r->av, NULL), "fi_av_open");
    CHECK(fi_endpoint(r->domain, fi, &r->ep, NULL), "fi_endpoint");
    CHECK(fi_ep_bind(r->ep, &r->av->fid, 0), "fi_ep_bind(av)");
    CHECK(fi_ep_bind(r->ep, &r->cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
    if (r->is_shm) CHECK(aio__shm_own_endpoint(r), "naming the shm endpoint");
    CHECK(fi_enable(r->ep), "fi_enable");
    r->addr_len = sizeof(r->addr);
    CHECK(fi_getname(&r->ep->fid, r->addr, &r->addr_len), "fi_getname");
    if (r->is_tcp && e->sndbuf > 0) aio__tcp_tune(e, r, NULL); /* the listener: accepted sockets inherit */
    return 0;
}

/* The rail's op pool and message slots: recv_slots buffers of slot_size bytes to receive into
 * (registered and posted) and as many to send from (registered). 0 or a negative error. */
static int rail_slots(aio_engine *e, aio_rail *r, const char *provider, uint32_t recv_slots, uint64_t slot_size,
                      char *err, size_t errlen) {
    int ret;
    r->nops = e->cfg.max_ops;
    r->ops = calloc(r->nops, sizeof(aio_op));
    r->nslots = recv_slots;
    r->slot_size = slot_size;
    r->recv_ops = calloc(recv_slots, sizeof(aio_op));
    r->send_free = calloc(recv_slots, sizeof(uint32_t));
    if (posix_memalign((void **)&r->recv_buf, 4096, (size_t)recv_slots * slot_size)) r->recv_buf = NULL;
    if (posix_memalign((void **)&r->send_buf, 4096, (size_t)recv_slots * slot_size)) r->send_buf = NULL;
    if (!r->ops || !r->recv_ops || !r->send_free || !r->recv_buf || !r->send_buf) {
        aio__set_err(err, errlen, "out of memory for %u message slots of %llu bytes", recv_slots,
                     (unsigned long long)slot_size);
        return -FI_ENOMEM;
    }
    memset(r->recv_buf, 0, (size_t)recv_slots * slot_size);
    memset(r->send_buf, 0, (size_t)recv_slots * slot_size);
    for (uint32_t i = 0; i < r->nops; i++) r->ops[i].next_free = (i + 1 < r->nops) ? (int32_t)(i + 1) : -1;
    r->free_head = 0;
    for (uint32_t i = 0; i < recv_slots; i++) {
        r->recv_ops[i].kind = OPK_RECV;
        r->recv_ops[i].slot = i;
        r->recv_ops[i].rail = r->index;
        r->recv_ops[i].group = -1;
        r->send_free[i] = i;
    }
    r->send_nfree = recv_slots;
    uint64_t k1 = (r->mr_mode & FI_MR_PROV_KEY) ? 0 : aio__random_key(r);
    uint64_t k2 = (r->mr_mode & FI_MR_PROV_KEY) ? 0 : aio__random_key(r);
    CHECK(aio__reg_local(r, r->recv_buf, (size_t)recv_slots * slot_size, FI_RECV, &r->recv_mr,
                         &r->recv_desc, k1, AIO_HMEM_SYSTEM, 0),
          "registering receive slots");
    CHECK(aio__reg_local(r, r->send_buf, (size_t)recv_slots * slot_size, FI_SEND, &r->send_mr,
                         &r->send_desc, k2, AIO_HMEM_SYSTEM, 0),
          "registering send slots");
    for (uint32_t i = 0; i < recv_slots; i++) CHECK(aio__post_recv_locked(r, i), "posting receives");
    return 0;
}

#undef CHECK

/* Gives the opened rail to poller qi (its wait fd and wake fifo into the poller's epoll set)
 * and to the engine: the rail's index. */
static int rail_attach(aio_engine *e, aio_rail *r, int qi) {
    aio_poller *q = &e->pollers[qi];
    if (r->wait_fd >= 0) {
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = r->wait_fd};
        if (epoll_ctl(q->epfd, EPOLL_CTL_ADD, r->wait_fd, &ev) != 0) {
            r->wait_fd = -1;
            r->bytes_fd = 0;
        }
    }
    if (r->wake_fd >= 0) { /* peers wake us through it (see shm_wake.c) */
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = r->wake_fd};
        if (epoll_ctl(q->epfd, EPOLL_CTL_ADD, r->wake_fd, &ev) != 0) {
            close(r->wake_fd);
            r->wake_fd = -1;
        }
    }
    r->poller = qi;
    q->rails[q->nrails++] = r;
    e->rails[e->nrails] = r;
    return e->nrails++;
}

int aio_engine_add_rail(aio_engine *e, const char *provider, const char *nic, uint32_t recv_slots,
                        uint64_t slot_size, char *err, size_t errlen) {
    if (e->started) {
        aio__set_err(err, errlen, "rails must be added before the engine starts");
        return -FI_EINVAL;
    }
    if (e->nrails >= AIO_MAX_RAILS) {
        aio__set_err(err, errlen, "at most %d NICs per engine", AIO_MAX_RAILS);
        return -FI_EINVAL;
    }
    /* rail i goes to poller i % npollers_want: open that poller first if it is new */
    int qi = e->nrails % e->npollers_want;
    if (qi >= e->npollers && aio__poller_open(e) != 0) {
        aio__set_err(err, errlen, "eventfd/epoll for poller %d: %s", qi, strerror(errno));
        return -FI_ENOMEM;
    }
    aio__fab_init();
    if (recv_slots == 0) recv_slots = 1;
    if (slot_size < 64) slot_size = 64;
    if (!strcmp(aio__map_provider(provider), "shm")) aio__shm_sweep_stale();
    char node[INET6_ADDRSTRLEN + 1] = {0};
    char service[16] = {0};
    aio_rail *r = rail_new(e, provider, nic, node, sizeof(node), service, sizeof(service));
    if (!r) return -FI_ENOMEM;
    int ret = rail_getinfo(r, provider, nic, node, service);
    if (ret == 1) { /* no memory for the hints */
        free(r);
        return -FI_ENOMEM;
    }
    if (ret == 0) ret = rail_keep_nic(r, nic);
    if (ret || !r->info) {
        rail_getinfo_error(provider, nic, ret, err, errlen);
        aio__rail_free(r);
        return ret ? ret : -FI_ENODATA;
    }
    if ((ret = rail_take_info(r, provider, err, errlen)) || (ret = rail_open(e, r, provider, err, errlen)) ||
        (ret = rail_slots(e, r, provider, recv_slots, slot_size, err, errlen))) {
        aio__rail_free(r);
        return ret;
    }
    return rail_attach(e, r, qi);
}

int aio_rail_get_info(aio_engine *e, int rail, aio_rail_info *o) {
    if (rail < 0 || rail >= e->nrails) return -FI_EINVAL;
    aio_rail *r = e->rails[rail];
    struct fi_info *fi = r->info;
    memset(o, 0, sizeof(*o));
    snprintf(o->provider, sizeof(o->provider), "%s", fi->fabric_attr->prov_name);
    snprintf(o->domain, sizeof(o->domain), "%s", fi->domain_attr->name);
    snprintf(o->fabric, sizeof(o->fabric), "%s", fi->fabric_attr->name);
    o->mr_mode = r->mr_mode;
    o->mode = r->mode;
    o->max_msg_size = fi->ep_attr->max_msg_size;
    o->inject_size = fi->tx_attr->inject_size;
    o->mr_key_size = fi->domain_attr->mr_key_size;
    o->cq_data_size = r->cq_data_size;
    o->has_wait_fd = r->wait_fd >= 0;
    o->tx_size = (uint32_t)fi->tx_attr->size;
    o->rx_size = (uint32_t)fi->rx_attr->size;
    o->recv_slots = r->nslots;
    o->slot_size = r->slot_size;
    o->caps = fi->caps;
    o->addr_len = (uint32_t)r->addr_len;
    memcpy(o->addr, r->addr, r->addr_len);
    return 0;
}

/* What the rail keeps per peer address (how to wake it, tuning tries, the hand-over flag):
 * reset when the address is removed or reused. Caller holds r->mu. */
static void addr_forget(aio_rail *r, fi_addr_t fa) {
    if (fa < r->wcap) aio__shm_wpeer_forget(&r->wpeers[fa]);
    if (fa < r->tune_cap) r->tune_tries[fa] = 0;
    defer_set(r, fa, 0);
}

int aio_av_insert(aio_engine *e, int rail, const void *addr, size_t len, uint64_t *fi_addr) {
    if (rail < 0 || rail >= e->nrails || !addr || len == 0) return -FI_EINVAL;
    aio_rail *r = e->rails[rail];
    fi_addr_t fa = FI_ADDR_NOTAVAIL;
    pthread_mutex_lock(&r->mu);
    int ret = fi_av_insert(r->av, addr, 1, &fa, 0, NULL);
    if (ret == 1) addr_forget(r, fa); /* a reused address starts afresh */
    pthread_mutex_unlock(&r->mu);
    if (ret != 1) return ret < 0 ? ret : -FI_EINVAL;
    *fi_addr = fa;
    return 0;
}

int aio_av_remove(aio_engine *e, int rail, uint64_t fi_addr) {
    if (rail < 0 || rail >= e->nrails) return -FI_EINVAL;
    aio_rail *r = e->rails[rail];
    fi_addr_t fa = fi_addr;
    pthread_mutex_lock(&r->mu);
    int ret = fi_av_remove(r->av, &fa, 1, 0);
    addr_forget(r, fa);
    pthread_mutex_unlock(&r->mu);
    return ret;
}

int aio_least_loaded(aio_engine *e, const int32_t *rails, int n, int64_t start) {
    if (n < 1 || !rails) return -1;
    int first = (int)(((start % n) + n) % n), best = -1;
    uint64_t least = UINT64_MAX;
    for (int k = 0; k < n; k++) {
        int i = (first + k) % n;
        if (rails[i] < 0 || rails[i] >= e->nrails) return -1;
        uint64_t b = atomic_load_explicit(&e->rails[rails[i]]->bytes_inflight, memory_order_relaxed);
        if (b < least) {
            least = b;
            best = i;
        }
    }
    return best;
}
