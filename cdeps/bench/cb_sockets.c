/* aiote_cbench's sockets: the bare-sockets baseline, and the control socket of two hosts.
 *
 * Theory of operation. The sockets mode is what the kernel gives one TCP connection:
 *
 *   sockets SIZE WINDOW TOTAL_BYTES
 *       no libfabric at all: the same SIZE-byte messages from the same --slots buffers
 *       (WINDOW by default, the same memory as write's), sent over one bare TCP connection
 *       (TCP_NODELAY) by a nonblocking send loop and taken by a nonblocking recv loop, both
 *       spinning as the pollers do. The kernel's ceiling for one connection, beside which
 *       the core's and the peers' tcp figures can be read. The sender's send buffer is
 *       --sndbuf (default: what the core sets on same-host connections, AIO_TCP_SNDBUF_AUTO;
 *       across hosts the kernel's autotuning). --nic NAME: the connection goes to that
 *       interface's IPv4 address (lo: 127.0.0.1). Reports GB/s at the sender, from the first
 *       send to the receiver's report that every byte arrived; --listen / --connect run it
 *       across hosts over the control connection itself.
 *
 * Forked (sockets_forked), the parent listens on the NIC's address and sends; the child
 * connects and receives. The few control bytes (go, the receiver's report) travel back over
 * the same connection.
 *
 * Two hosts (any mode): sock_listen takes one connection on --listen's port, announced as
 * {"listening":PORT} on stdout, and sock_connect reaches it (--connect HOST:PORT, retried for
 * 10 s while the peer starts); that connection is then the run's control channel. */
#include "cbench.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>

/* Moves messages first .. first+n-1 (slot i % slots of buf) over fd, spinning on a
 * nonblocking send or recv as a poller spins on its queue; the calls it made. */
static uint64_t sock_pump(int fd, uint8_t *buf, const opts_t *o, uint64_t first, uint64_t n, int sending) {
    uint64_t calls = 0;
    for (uint64_t i = first; i < first + n; i++) {
        uint8_t *p = buf + (i % o->slots) * o->size;
        uint64_t off = 0;
        while (off < o->size) {
            ssize_t r = sending ? send(fd, p + off, o->size - off, MSG_DONTWAIT | MSG_NOSIGNAL)
                                : recv(fd, p + off, o->size - off, MSG_DONTWAIT);
            calls++;
            if (r > 0) off += (uint64_t)r;
            else if (r == 0) die("sockets: the peer closed the connection");
            else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                die("sockets %s: %s", sending ? "send" : "recv", strerror(errno));
        }
    }
    return calls;
}

typedef struct sock_report {
    double cpu_s;
    uint64_t calls;
} sock_report;

/* Whether both ends of the connected socket fd have the same IP address, as the core's
 * tcp_tune decides "same host" for its send buffers. */
static int same_host_socket(int fd) {
    struct sockaddr_storage a, b;
    socklen_t al = sizeof(a), bl = sizeof(b);
    if (getsockname(fd, (struct sockaddr *)&a, &al) || getpeername(fd, (struct sockaddr *)&b, &bl) ||
        a.ss_family != b.ss_family)
        return 0;
    if (a.ss_family == AF_INET)
        return ((struct sockaddr_in *)&a)->sin_addr.s_addr == ((struct sockaddr_in *)&b)->sin_addr.s_addr;
    if (a.ss_family == AF_INET6)
        return !memcmp(&((struct sockaddr_in6 *)&a)->sin6_addr, &((struct sockaddr_in6 *)&b)->sin6_addr,
                       sizeof(struct in6_addr));
    return 0;
}

/* sockets SIZE WINDOW TOTAL: rank 0 sends, rank 1 receives, over the connected socket fd
 * (blocking; the pumps pass MSG_DONTWAIT). The control bytes travel back over it too. */
void run_sockets(const opts_t *o, int rank, int fd) {
    uint64_t n = transfer_count(o), warm = n < o->window ? n : o->window, region = o->size * o->slots;
    int one = 1, got = 0, same_host = same_host_socket(fd);
    socklen_t gl = sizeof(got);
    signal(SIGPIPE, SIG_IGN); /* a peer gone: EPIPE and a message, not a silent death */
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one))) die("TCP_NODELAY: %s", strerror(errno));
    int64_t want = o->sndbuf >= 0 ? o->sndbuf : (same_host ? AIO_TCP_SNDBUF_AUTO : 0);
    if (rank == 0 && want > 0) {
        int v = (int)want;
        if (setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof(v))) die("SO_SNDBUF: %s", strerror(errno));
    }
    getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &got, &gl);
    uint8_t *buf = region_alloc(region, o->small_pages);
    region_touch(buf, region);
    char go = 'g';
    if (rank == 1) {
        sock_pump(fd, buf, o, 0, warm, 0); /* warm-up: connection, first touch, not timed */
        write_full(fd, &go, 1);
        double c0 = cpu_s();
        sock_report rep = {0, sock_pump(fd, buf, o, warm, n, 0)};
        rep.cpu_s = cpu_s() - c0;
        write_full(fd, &rep, sizeof(rep));
        free(buf);
        return;
    }
    sock_pump(fd, buf, o, 0, warm, 1);
    read_full(fd, &go, 1);
    double c0 = cpu_s();
    int64_t t0 = now_ns();
    uint64_t calls = sock_pump(fd, buf, o, warm, n, 1);
    sock_report rep;
    read_full(fd, &rep, sizeof(rep));
    int64_t t1 = now_ns();
    double cpu = cpu_s() - c0, secs = (double)(t1 - t0) * 1e-9, bytes = (double)n * (double)o->size;
    printf("{\"mode\":\"sockets\",\"provider\":\"sockets\",\"nic\":\"%s\",\"size\":%llu,"
           "\"window\":%llu,\"slots\":%llu,\"messages\":%llu,\"total_bytes\":%.0f,\"gbps\":%.3f,"
           "\"seconds\":%.6f,\"writer_cpu_s\":%.3f,\"receiver_cpu_s\":%.3f,\"sndbuf\":%lld,"
           "\"sndbuf_got\":%d,\"send_calls\":%llu,\"recv_calls\":%llu}\n",
           o->nic ? o->nic : "", (unsigned long long)o->size, (unsigned long long)o->window,
           (unsigned long long)o->slots, (unsigned long long)n, bytes, bytes / secs / 1e9, secs, cpu,
           rep.cpu_s, (long long)want, got, (unsigned long long)calls, (unsigned long long)rep.calls);
    free(buf);
}

/* The address the forked sockets run connects to: --nic's IPv4 address (lo: 127.0.0.1). */
static struct sockaddr_in sockets_addr(const opts_t *o) {
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (!o->nic || !strcmp(o->nic, "lo")) return a;
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs)) die("getifaddrs: %s", strerror(errno));
    int found = 0;
    for (struct ifaddrs *i = ifs; i && !found; i = i->ifa_next)
        if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && !strcmp(i->ifa_name, o->nic)) {
            a.sin_addr = ((struct sockaddr_in *)i->ifa_addr)->sin_addr;
            found = 1;
        }
    freeifaddrs(ifs);
    if (!found) die("sockets: --nic %s has no IPv4 address", o->nic);
    return a;
}

/* Forks the sockets run over one connection to sockets_addr: the parent sends. */
int sockets_forked(const opts_t *o) {
    struct sockaddr_in a = sockets_addr(o);
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    socklen_t al = sizeof(a);
    if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof(a)) || listen(ls, 1) ||
        getsockname(ls, (struct sockaddr *)&a, &al))
        die("sockets: listen on the NIC's address: %s", strerror(errno));
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) die("fork: %s", strerror(errno));
    if (pid == 0) {
        g_role = "peer";
        close(ls);
        int c = socket(AF_INET, SOCK_STREAM, 0);
        if (c < 0 || connect(c, (struct sockaddr *)&a, sizeof(a))) die("sockets: connect: %s", strerror(errno));
        run_sockets(o, 1, c);
        close(c);
        _exit(0);
    }
    struct pollfd pl = {.fd = ls, .events = POLLIN};
    int c = -1;
    if (poll(&pl, 1, 30000) == 1) /* the peer connects at once, or it failed */
        while ((c = accept(ls, NULL, NULL)) < 0 && errno == EINTR) {}
    if (c < 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        die("sockets: the peer did not connect within 30 s");
    }
    close(ls);
    run_sockets(o, 0, c);
    close(c);
    return wait_peer(pid);
}

/* --listen: one connection on PORT (0: any), announced on stdout. */
int sock_listen(int port) {
    int ls = socket(AF_INET6, SOCK_STREAM, 0), v6 = 1;
    if (ls < 0) {
        v6 = 0;
        ls = socket(AF_INET, SOCK_STREAM, 0);
    }
    if (ls < 0) die("socket: %s", strerror(errno));
    int one = 1, zero = 0;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof(ss));
    socklen_t sl;
    if (v6) {
        setsockopt(ls, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
        a->sin6_family = AF_INET6;
        a->sin6_addr = in6addr_any;
        a->sin6_port = htons((uint16_t)port);
        sl = sizeof(*a);
    } else {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
        a->sin_family = AF_INET;
        a->sin_addr.s_addr = htonl(INADDR_ANY);
        a->sin_port = htons((uint16_t)port);
        sl = sizeof(*a);
    }
    if (bind(ls, (struct sockaddr *)&ss, sl) || listen(ls, 1)) die("bind/listen: %s", strerror(errno));
    sl = sizeof(ss);
    getsockname(ls, (struct sockaddr *)&ss, &sl);
    int got = ntohs(v6 ? ((struct sockaddr_in6 *)&ss)->sin6_port : ((struct sockaddr_in *)&ss)->sin_port);
    printf("{\"listening\":%d}\n", got);
    fflush(stdout);
    int c;
    while ((c = accept(ls, NULL, NULL)) < 0 && errno == EINTR) {}
    if (c < 0) die("accept: %s", strerror(errno));
    close(ls);
    return c;
}

/* --connect HOST:PORT (HOST may be [v6]); retries for 10 s while the peer starts. */
int sock_connect(const char *spec) {
    char host[256];
    const char *colon = strrchr(spec, ':');
    if (!colon || (size_t)(colon - spec) >= sizeof(host)) die("--connect wants HOST:PORT, got %s", spec);
    memcpy(host, spec, (size_t)(colon - spec));
    host[colon - spec] = 0;
    char *h = host;
    if (h[0] == '[') {
        h++;
        char *e = strchr(h, ']');
        if (e) *e = 0;
    }
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(h, colon + 1, &hints, &res);
    if (rc) die("getaddrinfo %s: %s", spec, gai_strerror(rc));
    int64_t t0 = now_ns();
    for (;;) {
        for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
            int c = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
            if (c < 0) continue;
            if (!connect(c, ai->ai_addr, ai->ai_addrlen)) {
                freeaddrinfo(res);
                return c;
            }
            close(c);
        }
        if (now_ns() - t0 > 10000000000LL) die("could not connect to %s: %s", spec, strerror(errno));
        usleep(50000);
    }
}
