/* The poller threads (poller.c). */
#ifndef AIOTE_CORE_POLLER_H
#define AIOTE_CORE_POLLER_H

#include "internal.h"

/* Kicks the pollers of the rails in `mask` (bit i: rail i): their spin restarts, and a sleeping
 * one wakes. Any thread. */
AIO_INTERNAL void aio__kick_rails(aio_engine *e, uint32_t mask);
/* Kicks every poller. */
AIO_INTERNAL void aio__kick(aio_engine *e);
/* Kicks poller 0, which reads the watched words. */
AIO_INTERNAL void aio__kick_watcher(aio_engine *e);
/* fi_trywait on the rail's CQ, under the rail's lock: FI_SUCCESS when its wait fd may be slept on. */
AIO_INTERNAL int aio__rail_trywait(aio_rail *r);
/* Opens the next poller's kick eventfd and epoll set (its thread: aio_engine_start): 0, or -1
 * with errno. */
AIO_INTERNAL int aio__poller_open(aio_engine *e);
/* Starts the thread of every poller that drives a rail: 0, or a negative errno (none left running). */
AIO_INTERNAL int aio__pollers_start(aio_engine *e);
/* Stops and joins the running poller threads. */
AIO_INTERNAL void aio__pollers_join(aio_engine *e);

#endif
