/* What aiote asks libfabric before opening anything (fabric.c). */
#ifndef AIOTE_CORE_FABRIC_H
#define AIOTE_CORE_FABRIC_H

#include "internal.h"

/* libfabric's first call, once per process (FI_PROVIDER: see fabric.c). Before any fi_getinfo. */
AIO_INTERNAL void aio__fab_init(void);
/* The libfabric provider string of a short name ("tcp" -> "tcp;ofi_rxm", "verbs" -> "verbs;ofi_rxm"). */
AIO_INTERNAL const char *aio__map_provider(const char *p);
/* The hints of an aiote rail on provider `prov` (short name), optionally on domain `nic`. */
AIO_INTERNAL struct fi_info *aio__make_hints(const char *prov, const char *nic);
/* The NICs (domains) provider `prov` offers, comma-separated, for error messages. */
AIO_INTERNAL void aio__list_nics(const char *prov, char *buf, size_t len);
/* The IPv4 (else IPv6) address of network interface `nic`: 1 found, 0 not. */
AIO_INTERNAL int aio__nic_address(const char *nic, char *out, size_t len);

#endif
