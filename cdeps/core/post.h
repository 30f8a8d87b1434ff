/* Posting (post.c). */
#ifndef AIOTE_CORE_POST_H
#define AIOTE_CORE_POST_H

#include "internal.h"

/* Posts one write or read to the rail's provider (and wakes an shm target). Caller holds r->mu. */
AIO_INTERNAL ssize_t aio__post_one(aio_rail *r, const aio_op_desc *it, aio_op *op);
/* A request to `peer` went to the rail's provider: tunes its tcp connection (first posts), and
 * lets requests to it be handed over again. Caller holds r->mu. */
AIO_INTERNAL void aio__posted_to(aio_engine *e, aio_rail *r, uint64_t peer);

#endif
