/* Memory: regions registered on every rail of an engine.
 *
 * Theory of operation. A region (aio_mr) is registered on each of the engine's rails, so that
 * any rail can carry a transfer into or out of it: one libfabric memory region per rail,
 * whose key and remote base a peer needs (aio_mr_key, aio_mr_remote_base: an offset-based
 * provider wants 0, one with FI_MR_VIRT_ADDR the buffer's address). Keys are the provider's
 * (FI_MR_PROV_KEY) or random ones, drawn again when the provider says a key is taken. Each
 * registration is made under the rail's lock (FI_THREAD_DOMAIN). The engine keeps its regions
 * in a list under mr_mu, and destroys those still registered when it is destroyed. A host
 * region with remote access also takes a slot of the engine's direct-copy table, if it has
 * one, so that same-host peers can copy into it directly (direct_table.c).
 *
 * A region is closed only when nothing touches it: -FI_EBUSY while requests on it are in
 * flight (its `inflight` count, kept by posting and completion), or while a same-host peer
 * is copying into or out of it (its slot's busy marks). The first such attempt already closes
 * the slot to new copies; aio_mr_reopen opens it again when the caller gives up. Device
 * memory (FI_HMEM, CUDA) is registered the same way on providers built for it, and never
 * goes in the direct-copy table. */
#include "internal.h"

#include <sys/random.h>
#include <sys/uio.h>

#include "direct_table.h"
#include "memory.h"

int aio__reg_local(aio_rail *r, void *buf, size_t len, uint64_t access, struct fid_mr **mr,
                   void **desc, uint64_t key, int iface, int device) {
    int ret;
    if (iface == AIO_HMEM_SYSTEM) {
        ret = fi_mr_reg(r->domain, buf, len, access, 0, key, 0, mr, NULL);
    } else { /* device memory, on a provider with FI_HMEM */
        struct iovec iov = {.iov_base = buf, .iov_len = len};
        struct fi_mr_attr attr;
        memset(&attr, 0, sizeof(attr));
        attr.mr_iov = &iov;
        attr.iov_count = 1;
        attr.access = access;
        attr.requested_key = key;
        attr.iface = FI_HMEM_CUDA;
        attr.device.cuda = device;
        ret = fi_mr_regattr(r->domain, &attr, 0, mr);
    }
    if (ret) return ret;
    if (r->mr_mode & FI_MR_ENDPOINT) {
        ret = fi_mr_bind(*mr, &r->ep->fid, 0);
        if (!ret) ret = fi_mr_enable(*mr);
        if (ret) {
            fi_close(&(*mr)->fid);
            *mr = NULL;
            return ret;
        }
    }
    *desc = fi_mr_desc(*mr);
    return 0;
}

uint64_t aio__random_key(aio_rail *r) {
    uint64_t k = 0;
    while (getrandom(&k, sizeof(k), 0) != sizeof(k)) {
    }
    size_t ks = r->info->domain_attr->mr_key_size;
    if (ks > 0 && ks < 8) k &= (1ULL << (8 * ks)) - 1;
    return k;
}

int aio_mr_register(aio_engine *e, void *buf, uint64_t len, uint32_t access, aio_mr **out,
                    char *err, size_t errlen) {
    return aio_mr_register_dev(e, buf, len, access, AIO_HMEM_SYSTEM, 0, out, err, errlen);
}

int aio_rail_hmem(aio_engine *e, int rail) {
    if (rail < 0 || rail >= e->nrails) return 0;
    return (e->rails[rail]->info->caps & FI_HMEM) ? 1 : 0;
}

int aio_mr_register_dev(aio_engine *e, void *buf, uint64_t len, uint32_t access, int iface,
                        int device, aio_mr **out, char *err, size_t errlen) {
    if (iface != AIO_HMEM_SYSTEM && iface != AIO_HMEM_CUDA) {
        aio__set_err(err, errlen, "unknown memory interface %d", iface);
        return -FI_EINVAL;
    }
    if (iface != AIO_HMEM_SYSTEM)
        for (int i = 0; i < e->nrails; i++)
            if (!aio_rail_hmem(e, i)) {
                aio__set_err(err, errlen, "NIC %d (%s) cannot register device memory (no FI_HMEM)", i,
                             e->rails[i]->info->domain_attr->name);
                return -FI_EOPNOTSUPP;
            }
    if (!buf || len == 0) {
        aio__set_err(err, errlen, "cannot register an empty buffer");
        return -FI_EINVAL;
    }
    aio_mr *m = calloc(1, sizeof(*m));
    if (!m) return -FI_ENOMEM;
    m->buf = buf;
    m->len = len;
    m->access = access;
    m->direct_slot = -1;
    uint64_t acc = FI_READ | FI_WRITE | FI_SEND | FI_RECV;
    if (access & AIO_ACCESS_REMOTE_WRITE) acc |= FI_REMOTE_WRITE;
    if (access & AIO_ACCESS_REMOTE_READ) acc |= FI_REMOTE_READ;
    for (int i = 0; i < e->nrails; i++) {
        aio_rail *r = e->rails[i];
        int ret = -FI_ENOKEY;
        pthread_mutex_lock(&r->mu);
        for (int attempt = 0; attempt < 8 && ret == -FI_ENOKEY; attempt++) {
            uint64_t key = (r->mr_mode & FI_MR_PROV_KEY) ? 0 : aio__random_key(r);
            ret = aio__reg_local(r, buf, len, acc, &m->mr[i], &m->desc[i], key, iface, device);
        }
        pthread_mutex_unlock(&r->mu);
        if (ret) {
            aio__set_err(err, errlen, "registering %llu bytes on NIC %d (%s): %s",
                         (unsigned long long)len, i, r->info->domain_attr->name, fi_strerror(-ret));
            for (int j = 0; j < i; j++) {
                pthread_mutex_lock(&e->rails[j]->mu);
                fi_close(&m->mr[j]->fid);
                pthread_mutex_unlock(&e->rails[j]->mu);
            }
            free(m);
            return ret;
        }
        m->key[i] = fi_mr_key(m->mr[i]);
        m->base[i] = (r->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)buf : 0;
        m->nrails = i + 1;
    }
    pthread_mutex_lock(&e->mr_mu);
    m->next = e->mrs;
    if (e->mrs) e->mrs->prev = m;
    e->mrs = m;
    if (e->dtab && iface == AIO_HMEM_SYSTEM && (access & (AIO_ACCESS_REMOTE_WRITE | AIO_ACCESS_REMOTE_READ)))
        m->direct_slot = aio__direct_publish(e, m);
    pthread_mutex_unlock(&e->mr_mu);
    *out = m;
    return 0;
}

uint64_t aio_mr_key(aio_mr *m, int rail) { return (rail >= 0 && rail < m->nrails) ? m->key[rail] : 0; }
uint64_t aio_mr_remote_base(aio_mr *m, int rail) {
    return (rail >= 0 && rail < m->nrails) ? m->base[rail] : 0;
}

int64_t aio_mr_inflight(aio_mr *m) { return atomic_load(&m->inflight); }

/* A region whose unregister gave up (RegionBusy) stays fully usable: aio_mr_close cleared its
 * slot's key at its first attempt (new direct copies refused, so that the copies in flight
 * drain); this publishes the key again, as aio__direct_publish did. Copies refused meanwhile failed
 * at their initiator (RemoteAccessError), as they would have had the region been retired. */
int aio_mr_reopen(aio_engine *e, aio_mr *m) {
    if (m->direct_slot < 0) return 0;
    int first = -1;
    for (int i = 0; i < m->nrails && first < 0; i++)
        if (e->rails[i]->is_shm) first = i;
    if (first < 0) return -FI_EINVAL;
    direct_slot *s = &e->dtab->slots[m->direct_slot];
    atomic_store(&s->key, m->key[first]); /* base, len, access are unchanged since publish */
    return 0;
}

int aio_mr_close(aio_engine *e, aio_mr *m) {
    if (atomic_load(&m->inflight) > 0) return -FI_EBUSY;
    if (m->direct_slot >= 0) {
        int rc = aio__direct_retire(e->dtab, m->direct_slot, 200000);
        if (rc) return rc;
        aio__direct_unpublish(e, m);
    }
    pthread_mutex_lock(&e->mr_mu);
    if (m->prev) m->prev->next = m->next; else e->mrs = m->next;
    if (m->next) m->next->prev = m->prev;
    pthread_mutex_unlock(&e->mr_mu);
    for (int i = 0; i < m->nrails; i++) {
        pthread_mutex_lock(&e->rails[i]->mu);
        fi_close(&m->mr[i]->fid);
        pthread_mutex_unlock(&e->rails[i]->mu);
    }
    free(m);
    return 0;
}
