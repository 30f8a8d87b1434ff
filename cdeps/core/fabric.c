/* libfabric before any rail: its first call, the hints aiote asks with, probing.
 *
 * Theory of operation. Everything aiote needs of a provider is asked in one set of hints
 * (aio__make_hints): RDM endpoints with RMA and messages, remote CQ data, FI_CONTEXT2, the
 * memory-registration modes aiote handles (local, virtual addresses, provider keys,
 * endpoint-bound regions, device memory), FI_THREAD_DOMAIN (aiote serializes every call on a
 * rail under the rail's lock, which spares the provider its own locking) and manual progress (the
 * pollers drive it: poller.c). tcp and verbs are asked for through the ofi_rxm utility
 * provider, which gives them RDM endpoints. A tcp rail also asks for delivery completion: see
 * aio__make_hints. aio_probe answers with the same hints, so what it lists is what a rail can
 * open. Nothing here holds state but the pthread_once of the first call, below; the functions
 * run on the caller's thread (the loop's, when the engine is built). */
#include "internal.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "fabric.h"

/* libfabric probes every provider it knows on its first call (fi_ini), reading FI_PROVIDER
 * then and never again. aiote uses few of them, so when the user has not chosen (FI_PROVIDER
 * unset) the first call is made with FI_PROVIDER set to those, and the variable is removed
 * again as soon as fi_ini has read it: the process environment is left as it was (importing
 * aiote no longer touches it). Done once, under pthread_once, from the first function that
 * would call into libfabric (aio__fab_init below). The variable exists only for the length of one
 * fi_getinfo: a thread that reads the C environment meanwhile (getenv) may see it, and glibc's
 * setenv/unsetenv take its environment lock against each other (Python's os.environ writes go
 * through putenv/unsetenv too), so nothing is lost or torn; a user who wants other providers
 * sets FI_PROVIDER, which is then left alone. */
#define AIO_DEFAULT_PROVIDERS "tcp,ofi_rxm,shm,verbs,efa"

static pthread_once_t fab_once = PTHREAD_ONCE_INIT;
static void fab_init_once(void) {
    if (getenv("FI_PROVIDER")) return; /* the user's choice; fi_ini reads it on first use */
    if (setenv("FI_PROVIDER", AIO_DEFAULT_PROVIDERS, 0)) return;
    struct fi_info *h = fi_allocinfo(), *info = NULL;
    if (h) {
        h->ep_attr->type = FI_EP_RDM;
        h->fabric_attr->prov_name = strdup("shm"); /* cheap; the call only has to run fi_ini */
        if (fi_getinfo(FI_VERSION(1, 9), NULL, NULL, 0, h, &info) == 0) fi_freeinfo(info);
        fi_freeinfo(h);
    }
    unsetenv("FI_PROVIDER");
}

void aio__fab_init(void) { pthread_once(&fab_once, fab_init_once); }

const char *aio__map_provider(const char *p) {
    if (!strcmp(p, "tcp")) return "tcp;ofi_rxm";
    if (!strcmp(p, "verbs")) return "verbs;ofi_rxm";
    return p;
}

struct fi_info *aio__make_hints(const char *prov, const char *nic) {
    struct fi_info *h = fi_allocinfo();
    if (!h) return NULL;
    h->caps = FI_RMA | FI_MSG | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_SEND |
              FI_RECV;
    h->ep_attr->type = FI_EP_RDM;
    h->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
    h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY |
                              FI_MR_ENDPOINT | FI_MR_HMEM;
    h->domain_attr->threading = FI_THREAD_DOMAIN;
    h->domain_attr->data_progress = FI_PROGRESS_MANUAL;
    h->tx_attr->msg_order = 0;
    /* tcp completes a write once its bytes are in the local socket otherwise: a wrong key
     * or a link that fails afterwards would lose it silently. Delivery completion makes a
     * completion mean "placed at the target" (shm in libfabric 1.17 mishandles the flag, and
     * its copies are done by the time they complete anyway). */
    if (!strcmp(prov, "tcp") || !strncmp(prov, "tcp;", 4)) h->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    h->fabric_attr->prov_name = strdup(aio__map_provider(prov));
    if (nic && *nic) h->domain_attr->name = strdup(nic);
    return h;
}

void aio__list_nics(const char *prov, char *buf, size_t len) {
    aio__fab_init();
    struct fi_info *h = aio__make_hints(prov, NULL), *info = NULL;
    buf[0] = 0;
    if (!h) return;
    if (fi_getinfo(FI_VERSION(1, 9), NULL, NULL, 0, h, &info) == 0) {
        size_t used = 0;
        for (struct fi_info *i = info; i; i = i->next) {
            const char *nm = i->domain_attr->name;
            if (strstr(buf, nm)) continue;
            int w = snprintf(buf + used, len - used, "%s%s", used ? ", " : "", nm);
            if (w < 0 || (size_t)w >= len - used) break;
            used += (size_t)w;
        }
        fi_freeinfo(info);
    }
    fi_freeinfo(h);
}

int aio_probe(const char *provider, aio_probe_entry *out, int max) {
    aio__fab_init();
    struct fi_info *h = aio__make_hints(provider, NULL), *info = NULL;
    if (!h) return -FI_ENOMEM;
    int ret = fi_getinfo(FI_VERSION(1, 9), NULL, NULL, 0, h, &info);
    fi_freeinfo(h);
    if (ret == -FI_ENODATA) return 0;
    if (ret) return ret;
    int n = 0;
    for (struct fi_info *i = info; i && n < max; i = i->next) {
        const char *dom = i->domain_attr->name ? i->domain_attr->name : "";
        int dup = 0;
        for (int k = 0; k < n; k++)
            if (!strcmp(out[k].domain, dom)) dup = 1;
        if (dup) continue;
        aio_probe_entry *o = &out[n++];
        memset(o, 0, sizeof(*o));
        snprintf(o->provider, sizeof(o->provider), "%s", i->fabric_attr->prov_name);
        snprintf(o->domain, sizeof(o->domain), "%s", dom);
        snprintf(o->fabric, sizeof(o->fabric), "%s", i->fabric_attr->name ? i->fabric_attr->name : "");
        o->caps = i->caps;
        o->mr_mode = (uint64_t)i->domain_attr->mr_mode;
        o->max_msg_size = i->ep_attr->max_msg_size;
        o->cq_data_size = (uint32_t)i->domain_attr->cq_data_size;
        o->hmem = (i->caps & FI_HMEM) ? 1 : 0;
        o->iov_limit = (uint32_t)i->tx_attr->iov_limit;
        if (i->nic && i->nic->link_attr) o->link_speed = i->nic->link_attr->speed;
    }
    fi_freeinfo(info);
    return n;
}

/* The IPv4 (else IPv6) address of a network interface, for providers whose domains
 * are interfaces (tcp): rxm does not filter on the domain-name hint, so the source
 * address is what pins the endpoint to the NIC. */
int aio__nic_address(const char *nic, char *out, size_t len) {
    struct ifaddrs *ifa = NULL;
    int found = 0;
    if (!nic || !*nic || getifaddrs(&ifa) != 0) return 0;
    for (int pass = 0; pass < 2 && !found; pass++) {
        for (struct ifaddrs *i = ifa; i; i = i->ifa_next) {
            if (!i->ifa_addr || strcmp(i->ifa_name, nic) != 0) continue;
            int fam = i->ifa_addr->sa_family;
            if (pass == 0 && fam == AF_INET) {
                inet_ntop(AF_INET, &((struct sockaddr_in *)i->ifa_addr)->sin_addr, out, (socklen_t)len);
                found = 1;
                break;
            }
            if (pass == 1 && fam == AF_INET6) {
                inet_ntop(AF_INET6, &((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr, out, (socklen_t)len);
                found = 1;
                break;
            }
        }
    }
    freeifaddrs(ifa);
    return found;
}
