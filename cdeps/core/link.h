/* The link monitor of tcp rails (link.c). */
#ifndef AIOTE_CORE_LINK_H
#define AIOTE_CORE_LINK_H

#include "internal.h"

/* 1 if the interface's carrier is up (sysfs), 0 if not or unknown interface. */
AIO_INTERNAL int aio__iface_up(int ifindex);
/* Opens the netlink socket in poller 0's epoll set, if a rail watches an interface. */
AIO_INTERNAL void aio__open_netlink(aio_engine *e);
/* Reads every pending netlink message (non-blocking) and reports link changes (poller 0). */
AIO_INTERNAL void aio__drain_netlink(aio_engine *e);

#endif
