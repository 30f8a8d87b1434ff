/* The send buffers of tcp rails' sockets (tcp_tune.c). */
#ifndef AIOTE_CORE_TCP_TUNE_H
#define AIOTE_CORE_TCP_TUNE_H

#include <sys/socket.h>

#include "internal.h"

/* Sets e->sndbuf on the rail's own sockets: its listener and accepted connections, and the
 * connection to `peer` (NULL: none). 1 when it saw the connection to `peer`. */
AIO_INTERNAL int aio__tcp_tune(aio_engine *e, aio_rail *r, const struct sockaddr *peer);
/* After a post to `fa` on a tcp rail: tunes that peer's connection (a few tries at most).
 * Caller holds r->mu. */
AIO_INTERNAL void aio__tcp_tune_peer(aio_engine *e, aio_rail *r, fi_addr_t fa);

#endif
