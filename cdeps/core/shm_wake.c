/* Owned shm names and wake-ups: the shm provider's endpoints, named by aiote, and how a peer
 * wakes a poller that sleeps on one.
 *
 * Theory of operation. libfabric's shm provider keeps an endpoint's queues in a file in
 * /dev/shm named after the endpoint, and leaves it behind when its process is killed. By
 * default it names it <pid>:<uid>:<n>: a name that says neither whose it is nor, once another
 * PID namespace shares /dev/shm, whether its process lives. So aiote names its endpoints itself
 * (fi_setname, before fi_enable): aiote-<token>-<n>, where <token> is 64 random bits drawn once
 * per process (again in a forked child) and <n> counts the process's endpoints. Before the first
 * of them it creates /dev/shm/aiote-<token>.lock (O_EXCL) and holds an exclusive flock on it for
 * the rest of its life; the kernel drops the lock when the process dies, whatever its PID
 * namespace. Every file aiote (or libfabric on its behalf) creates for the endpoint starts with
 * aiote-<token>-: the endpoint's queues, the mmap-protocol files libfabric adds after the name,
 * and our wake-up word (.w) and fifo (.p).
 *
 * Sweeping (aio__shm_sweep_stale, once per process, before its first shm endpoint) removes only
 * those: for each aiote-<token>.lock whose lock it can take at once (no living process holds
 * it, in any namespace), still the same file after the lock is taken, it removes every
 * aiote-<token>-* and then the lock file, holding the lock throughout. A creator that lost the
 * race (its new lock file was swept before it locked it) sees st_nlink == 0 after locking and
 * draws another token. Files aiote did not name (another program's <pid>:..., an old aiote's)
 * are never touched, nor are a living process's, whatever its pid.
 *
 * Wake-ups. The shm provider has no wait object: nothing tells a sleeping poller that a peer
 * put a message or an immediate in its queue, so an idle engine used to poll its shm rail every
 * 50 us to 1 ms. Each aiote shm endpoint has a word in a small shared file (aiote-...-<n>.w,
 * nonzero while its poller sleeps) and a fifo (aiote-...-<n>.p) in its poller's epoll set. After
 * every request it hands to the shm provider (taken or refused with -FI_EAGAIN, which may be a
 * connection request the target must answer), an aiote sender reads the target's word and, if
 * it is set, writes a byte into its fifo (aio__shm_wake; the target's files are opened once per
 * address). A poller about to sleep sets its word, then reads its CQ once more: the sender's
 * queue write, fence, word read and the sleeper's word write, fence, queue read cannot both
 * miss each other. With every rail woken this way or by its own wait fd, and nothing of its own
 * in flight (a completion of our request needs no sender to wake us: then it keeps the short
 * steps), and idle for WAKE_IDLE_NS (poller.c), the poller sleeps for sleep_ms (100 ms by default); a peer
 * that is not aiote (no word to read) is then served at that pace.
 *
 * A dead peer. libfabric's shm provider puts a request into the target's queues under a spinlock
 * that lives in the target's shared region; a target killed while it held that lock (in its own
 * progress) leaves every later sender spinning in fi_send / fi_write for ever. So before a
 * request goes to the provider, the posting code (post.c, handoff.c) asks aio__shm_peer_gone:
 * the target's owner lock file (opened once per address, beside its wake-up files) can be
 * locked shared at once only when no process holds it, i.e. the owner died (or closed its last
 * endpoint). Such a request fails with -AIO_EPEERGONE and nothing is posted. One flock call per
 * request while the target lives (per posting call and peer for a batch, post.c); a target that
 * dies while a sender already spins on its lock is beyond this. */
#include "internal.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>

#include "shm_wake.h"

#define OWN_PREFIX "aiote-"
#define WAKE_MAX_ADDR (1u << 20)

static pthread_mutex_t own_mu = PTHREAD_MUTEX_INITIALIZER;
static pid_t own_pid;
static char own_token[17];
static int own_lockfd = -1;
static uint32_t own_next;
static int own_live; /* endpoints named with the token: at 0 the lock file goes */

/* This process's token and held lock file (caller holds own_mu): 0, or -1 with errno. */
static int own_init_locked(void) {
    if (own_lockfd >= 0 && own_pid == getpid()) return 0;
    if (own_lockfd >= 0) { /* a forked child: the lock is its parent's (closing keeps it there) */
        close(own_lockfd);
        own_lockfd = -1;
    }
    for (int tries = 0; tries < 16; tries++) {
        uint64_t v = 0;
        if (getrandom(&v, sizeof(v), 0) != sizeof(v)) v = (uint64_t)now_ns() * 0x9E3779B97F4A7C15ULL ^ (uint64_t)getpid();
        snprintf(own_token, sizeof(own_token), "%016llx", (unsigned long long)v);
        char path[96];
        snprintf(path, sizeof(path), "/dev/shm/" OWN_PREFIX "%s.lock", own_token);
        int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (fd < 0) {
            if (errno == EEXIST) continue;
            return -1;
        }
        struct stat st;
        if (flock(fd, LOCK_EX) != 0 || fstat(fd, &st) != 0 || st.st_nlink == 0) {
            close(fd); /* swept before we locked it: another token */
            continue;
        }
        own_lockfd = fd;
        own_pid = getpid();
        own_next = 0;
        return 0;
    }
    errno = EEXIST;
    return -1;
}

/* Removes the files of aiote processes that are gone (see above). Once per process. */
void aio__shm_sweep_stale(void) {
    static atomic_int done;
    if (atomic_exchange(&done, 1)) return;
    enum { MAX_DEAD = 256 };
    char dead[MAX_DEAD][17];
    int dead_fd[MAX_DEAD], ndead = 0;
    pthread_mutex_lock(&own_mu);
    char mine[17];
    snprintf(mine, sizeof(mine), "%s", own_lockfd >= 0 && own_pid == getpid() ? own_token : "");
    pthread_mutex_unlock(&own_mu);
    DIR *d = opendir("/dev/shm");
    if (!d) return;
    struct dirent *ent;
    const size_t pl = strlen(OWN_PREFIX);
    while ((ent = readdir(d)) != NULL && ndead < MAX_DEAD) {
        const char *nm = ent->d_name;
        if (strncmp(nm, OWN_PREFIX, pl) || strlen(nm) != pl + 16 + 5 || strcmp(nm + pl + 16, ".lock"))
            continue;
        if (!strncmp(nm + pl, mine, 16)) continue;
        char path[300];
        snprintf(path, sizeof(path), "/dev/shm/%s", nm);
        int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        if (fd < 0) continue;
        struct stat a, b;
        if (flock(fd, LOCK_EX | LOCK_NB) != 0 || fstat(fd, &a) != 0 || !S_ISREG(a.st_mode) ||
            stat(path, &b) != 0 || a.st_ino != b.st_ino || a.st_dev != b.st_dev) {
            close(fd); /* held: its process lives (in whatever PID namespace); or replaced */
            continue;
        }
        memcpy(dead[ndead], nm + pl, 16);
        dead[ndead][16] = 0;
        dead_fd[ndead++] = fd;
    }
    if (ndead) {
        rewinddir(d);
        while ((ent = readdir(d)) != NULL) {
            const char *nm = ent->d_name;
            if (strncmp(nm, OWN_PREFIX, pl) || strlen(nm) < pl + 17 || nm[pl + 16] != '-') continue;
            for (int i = 0; i < ndead; i++) {
                if (strncmp(nm + pl, dead[i], 16)) continue;
                char path[300];
                snprintf(path, sizeof(path), "/dev/shm/%s", nm);
                unlink(path);
                break;
            }
        }
        for (int i = 0; i < ndead; i++) {
            char path[96];
            snprintf(path, sizeof(path), "/dev/shm/" OWN_PREFIX "%.16s.lock", dead[i]);
            unlink(path); /* still holding its lock: a creator that raced us sees nlink 0 */
            close(dead_fd[i]);
        }
    }
    closedir(d);
}

/* Names a new shm endpoint (before fi_enable) and creates its wake word and fifo. 0, or a
 * negative error (nothing left behind). */
int aio__shm_own_endpoint(aio_rail *r) {
    pthread_mutex_lock(&own_mu);
    int rc = own_init_locked();
    if (!rc) own_live++;
    uint32_t n = own_next++;
    char tok[17];
    snprintf(tok, sizeof(tok), "%s", own_token);
    pthread_mutex_unlock(&own_mu);
    if (rc) return -FI_EIO;
    snprintf(r->shm_name, sizeof(r->shm_name), OWN_PREFIX "%s-%u", tok, n);
    int ret = fi_setname(&r->ep->fid, r->shm_name, strlen(r->shm_name) + 1);
    if (ret) return ret;
    char path[96];
    snprintf(path, sizeof(path), "/dev/shm/%s.w", r->shm_name);
    int wfd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (wfd < 0) return -errno;
    void *w = MAP_FAILED;
    if (ftruncate(wfd, 4096) == 0) w = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, wfd, 0);
    close(wfd);
    if (w == MAP_FAILED) {
        unlink(path);
        return -FI_ENOMEM;
    }
    r->wake_word = w;
    snprintf(path, sizeof(path), "/dev/shm/%s.p", r->shm_name);
    if (mkfifo(path, 0600) == 0) r->wake_fd = open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (r->wake_fd < 0) { /* no fifo: the rail is polled in short steps, as without names */
        unlink(path);
        munmap(r->wake_word, 4096);
        r->wake_word = NULL;
    }
    return 0;
}

void aio__shm_wpeer_forget(shm_wpeer *w) {
    if (w->state == 1) {
        close(w->fd);
        munmap((void *)w->word, 4096);
    }
    if (w->state != 0 && w->lockfd >= 0) close(w->lockfd);
    memset(w, 0, sizeof(*w));
}

/* Our own endpoint's and our peers' wake-up objects, at aio__rail_free. */
void aio__shm_own_release(aio_rail *r) {
    for (uint32_t i = 0; i < r->wcap; i++) aio__shm_wpeer_forget(&r->wpeers[i]);
    free(r->wpeers);
    r->wpeers = NULL;
    r->wcap = 0;
    char path[96];
    if (r->wake_word) {
        munmap((void *)r->wake_word, 4096);
        snprintf(path, sizeof(path), "/dev/shm/%s.w", r->shm_name);
        unlink(path);
    }
    if (r->wake_fd >= 0) {
        close(r->wake_fd);
        snprintf(path, sizeof(path), "/dev/shm/%s.p", r->shm_name);
        unlink(path);
    }
    if (!r->shm_name[0]) return;
    pthread_mutex_lock(&own_mu);
    if (own_pid == getpid() && own_lockfd >= 0 && --own_live == 0) {
        /* the process's last endpoint: its lock file goes (a later one draws a new token) */
        snprintf(path, sizeof(path), "/dev/shm/" OWN_PREFIX "%.16s.lock", own_token);
        unlink(path);
        close(own_lockfd);
        own_lockfd = -1;
    }
    pthread_mutex_unlock(&own_mu);
}

/* How to wake the peer at `fa` and tell whether it lives, looked up at its first use: its wake
 * word and fifo, and its owner's lock file (aiote-<token>.lock, held by the owning process for
 * its life: see "Owned shm names"). NULL for an address out of reach. Caller holds r->mu. */
static shm_wpeer *wpeer_of(aio_rail *r, uint64_t fa) {
    if (!r->is_shm || fa >= WAKE_MAX_ADDR) return NULL;
    if (fa >= r->wcap) {
        uint32_t cap = r->wcap ? r->wcap : 64;
        while (cap <= fa) cap *= 2;
        shm_wpeer *t = realloc(r->wpeers, cap * sizeof(*t));
        if (!t) return NULL;
        memset(t + r->wcap, 0, (cap - r->wcap) * sizeof(*t));
        r->wpeers = t, r->wcap = cap;
    }
    shm_wpeer *w = &r->wpeers[fa];
    if (w->state != 0) return w;
    w->state = -1;
    w->lockfd = -1;
    char name[256] = {0};
    size_t l = sizeof(name) - 1;
    size_t pl = strlen(OWN_PREFIX);
    if (fi_av_lookup(r->av, fa, name, &l) != 0 || l >= sizeof(name) || strncmp(name, OWN_PREFIX, pl) ||
        strchr(name, '/'))
        return w;
    char path[300];
    if (strlen(name) > pl + 16 && name[pl + 16] == '-') { /* aiote-<16 hex token>-<n> */
        snprintf(path, sizeof(path), "/dev/shm/" OWN_PREFIX "%.16s.lock", name + pl);
        w->lockfd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        struct stat st;
        if (w->lockfd < 0 && errno == ENOENT) {
            w->dead = 1; /* a live owner holds its lock file: it is gone (and its files swept) */
        } else if (w->lockfd >= 0 && (fstat(w->lockfd, &st) != 0 || !S_ISREG(st.st_mode))) {
            close(w->lockfd);
            w->lockfd = -1;
        }
    }
    snprintf(path, sizeof(path), "/dev/shm/%s.w", name);
    int wfd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    void *m = MAP_FAILED;
    if (wfd >= 0) {
        m = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, wfd, 0);
        close(wfd);
    }
    snprintf(path, sizeof(path), "/dev/shm/%s.p", name);
    int pfd = m != MAP_FAILED ? open(path, O_WRONLY | O_NONBLOCK | O_CLOEXEC) : -1;
    if (pfd >= 0) {
        w->fd = pfd;
        w->word = m;
        w->state = 1;
    } else if (m != MAP_FAILED) {
        munmap(m, 4096);
    }
    return w;
}

/* After a request to `fa` went to (or was refused by) an shm rail's provider: wake the target's
 * poller if it sleeps. Caller holds r->mu. */
void aio__shm_wake(aio_rail *r, uint64_t fa) {
    shm_wpeer *w = wpeer_of(r, fa);
    if (!w || w->state != 1) return;
    atomic_thread_fence(memory_order_seq_cst); /* our queue write, then their word: see above */
    if (atomic_load_explicit(w->word, memory_order_relaxed)) {
        char c = 0;
        ssize_t n = write(w->fd, &c, 1); /* a full fifo already wakes it */
        (void)n;
    }
}

/* Whether the aiote process that owns the shm endpoint at `fa` is gone: its lock file can be
 * locked (shared) at once, so nobody holds it (the kernel dropped the owner's lock as it died,
 * or its last endpoint closed), or it was already gone at the first look. Sticky. Costs one
 * flock call while the owner lives. Caller holds r->mu. */
int aio__shm_peer_gone(aio_rail *r, uint64_t fa) {
    shm_wpeer *w = wpeer_of(r, fa);
    if (!w) return 0;
    if (w->dead) return 1;
    if (w->lockfd < 0) return 0;
    if (flock(w->lockfd, LOCK_SH | LOCK_NB) != 0) return 0; /* EWOULDBLOCK: it lives */
    flock(w->lockfd, LOCK_UN);
    w->dead = 1;
    return 1;
}
