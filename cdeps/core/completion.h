/* Completions: a rail's op pool and its completion queue (completion.c). */
#ifndef AIOTE_CORE_COMPLETION_H
#define AIOTE_CORE_COMPLETION_H

#include "internal.h"

/* An op of the rail's pool, or NULL when all are in flight; and back. Any thread, with or
 * without the rail's lock (pool_mu is innermost). */
AIO_INTERNAL aio_op *aio__op_get(aio_rail *r);
AIO_INTERNAL void aio__op_put(aio_rail *r, aio_op *op);
/* Posts the receive of message slot `slot`. Caller holds r->mu. */
AIO_INTERNAL int aio__post_recv_locked(aio_rail *r, uint32_t slot);
/* Completes our own op (write/read/send) with a status. Caller holds r->mu. */
AIO_INTERNAL void aio__complete_op(aio_engine *e, aio_rail *r, aio_op *op, int status, int prov_errno);
/* Reads and handles up to one batch of the rail's completions: how many. Caller holds r->mu. */
AIO_INTERNAL int aio__progress_locked(aio_engine *e, aio_rail *r);

#endif
