/* aiote_cbench's small helpers: failing, CPU time, the control channel, the peer's exit.
 *
 * Theory of operation. A run is two processes (the parent and its forked peer, or a --listen
 * peer and its --connect writer) that say little to each other besides the transfers: their
 * addresses and region descriptors, a few fixed-size reports (a time, CPU seconds, a count)
 * and one-byte "go" and "bye" marks, each written and read whole over the control channel
 * (write_full, read_full). Whatever goes wrong ends the process at once (die: one line on
 * stderr naming the side, exit status 1); the parent sees a failed peer in wait_peer. Times
 * are CLOCK_MONOTONIC (now_ns, cbench.h), which is system-wide, so the two processes of a
 * forked run can compare their clocks; CPU time is the process's (cpu_s) or the calling
 * thread's (thread_cpu_s). */
#include "cbench.h"

#include <stdarg.h>
#include <sys/resource.h>
#include <sys/wait.h>

const char *g_role = "writer";

/* Says what went wrong on stderr, prefixed by the process's role, and exits with status 1. */
void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "aiote_cbench (%s): ", g_role);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

/* CPU seconds of the whole process (every thread: the caller's and the core's pollers). */
double cpu_s(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

/* CPU seconds of the calling thread (the writer's own posting and draining, without its pollers). */
double thread_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The control channel (a pipe, or --listen / --connect's socket): all n bytes, or die. */
void write_full(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) die("control write: %s", strerror(errno));
        c += w;
        n -= (size_t)w;
    }
}

void read_full(int fd, void *p, size_t n) {
    char *c = p;
    while (n) {
        ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) die("control read: %s", r == 0 ? "the peer closed its end" : strerror(errno));
        c += r;
        n -= (size_t)r;
    }
}

/* qsort's comparison of int64_t (latencies, call times). */
int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* Waits for the forked peer process: 0 if it exited cleanly, else 1 (said on stderr). */
int wait_peer(pid_t pid) {
    int status = 0;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "aiote_cbench: the peer process failed (status 0x%x)\n", status);
        return 1;
    }
    return 0;
}
