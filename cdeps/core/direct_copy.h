/* Same-host direct copies: the copies (direct_copy.c). */
#ifndef AIOTE_CORE_DIRECT_COPY_H
#define AIOTE_CORE_DIRECT_COPY_H

#include "internal.h"

/* Makes one direct copy (poller 0's thread only): 0, or a negative error for its op. `run`
 * is the poller's pass (a peer's liveness is checked once per pass). */
AIO_INTERNAL int aio__direct_copy(aio_engine *e, const aio_op *op, uint64_t run);
/* The checks of a direct copy, in place, for a request that moves no bytes itself (a bare
 * immediate to a same-host peer): 0, -FI_ECONNRESET or -FI_EACCES. Any thread. */
AIO_INTERNAL int aio__direct_check(aio_engine *e, const aio_op_desc *d);
/* Copies runs of a queue's ops at once, and merges the immediates of copied runs (poller 0,
 * before it posts anything of the queue). */
AIO_INTERNAL void aio__direct_batch(aio_engine *e, aio_op *list, uint64_t run);

#endif
