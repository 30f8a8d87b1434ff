/* The link monitor: whether the interface behind a tcp rail is up.
 *
 * Theory of operation. A tcp rail bound to an interface's address (by_addr) would learn of its
 * interface going down only from failing requests. The kernel says it at once on a netlink
 * socket (RTMGRP_LINK): the engine opens one when it starts, if any rail watches an interface,
 * and puts it in poller 0's epoll set, so that a sleeping poller 0 wakes for it; an awake one
 * drains it at most once a millisecond. A change of a
 * rail's link (IFF_UP and IFF_LOWER_UP) is pushed as an AIO_REC_LINK record, and the rail's
 * link_up word (aio_rail_link_up) follows it. When netlink dropped messages (ENOBUFS) every
 * watched link is read again from sysfs. Only poller 0 touches the socket; link_up is atomic. */
#include "internal.h"

#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <net/if.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#ifndef IFF_LOWER_UP /* <linux/if.h>, which clashes with <net/if.h> */
#define IFF_LOWER_UP 0x10000
#endif

#include "link.h"
#include "ring.h"

int aio__iface_up(int ifindex) {
    char name[IF_NAMESIZE];
    if (!if_indextoname((unsigned)ifindex, name)) return 0;
    char path[96];
    snprintf(path, sizeof(path), "/sys/class/net/%s/carrier", name);
    FILE *f = fopen(path, "r");
    if (!f) return 1; /* no carrier file (unusual): assume up */
    int c = fgetc(f);
    fclose(f);
    return c == '1';
}

static void link_changed(aio_engine *e, int ifindex, int up) {
    for (int i = 0; i < e->nrails; i++) {
        aio_rail *r = e->rails[i];
        if (r->ifindex != ifindex) continue;
        if (atomic_exchange(&r->link_up, up) == up) continue;
        aio_record rec = {.kind = AIO_REC_LINK, .rail = i, .a = (uint64_t)up};
        aio__ring_push(e, &rec);
    }
}

/* Reads every pending netlink message (non-blocking) and reports link changes. */
void aio__drain_netlink(aio_engine *e) {
    char buf[8192] __attribute__((aligned(__alignof__(struct nlmsghdr))));
    for (;;) {
        ssize_t n = recv(e->nl_fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n <= 0) {
            if (n < 0 && errno == ENOBUFS) { /* lost messages: re-read every watched link */
                for (int i = 0; i < e->nrails; i++)
                    if (e->rails[i]->ifindex)
                        link_changed(e, e->rails[i]->ifindex, aio__iface_up(e->rails[i]->ifindex));
                continue;
            }
            return;
        }
        for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (unsigned)n);
             h = NLMSG_NEXT(h, n)) {
            if (h->nlmsg_type != RTM_NEWLINK && h->nlmsg_type != RTM_DELLINK) continue;
            struct ifinfomsg *ifi = NLMSG_DATA(h);
            int up = h->nlmsg_type == RTM_NEWLINK && (ifi->ifi_flags & IFF_UP) &&
                     (ifi->ifi_flags & IFF_LOWER_UP);
            link_changed(e, ifi->ifi_index, up);
        }
    }
}

void aio__open_netlink(aio_engine *e) {
    e->nl_fd = -1;
    int any = 0;
    for (int i = 0; i < e->nrails; i++)
        if (e->rails[i]->ifindex) any = 1;
    if (!any) return;
    int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC | SOCK_NONBLOCK, NETLINK_ROUTE);
    if (fd < 0) return;
    struct sockaddr_nl sa;
    memset(&sa, 0, sizeof(sa));
    sa.nl_family = AF_NETLINK;
    sa.nl_groups = RTMGRP_LINK;
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        close(fd);
        return;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
    if (epoll_ctl(e->pollers[0].epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
        close(fd);
        return;
    }
    e->nl_fd = fd;
}

int aio_rail_link_up(aio_engine *e, int rail) {
    if (rail < 0 || rail >= e->nrails) return -FI_EINVAL;
    return atomic_load(&e->rails[rail]->link_up);
}
