/* Same-host direct copies: the region tables (direct_table.c). */
#ifndef AIOTE_CORE_DIRECT_TABLE_H
#define AIOTE_CORE_DIRECT_TABLE_H

#include "internal.h"

/* Publishes a new region in this engine's table (caller holds mr_mu): its slot, or -1. */
AIO_INTERNAL int32_t aio__direct_publish(aio_engine *e, aio_mr *m);
/* Gives the region's slot back (takes mr_mu). */
AIO_INTERNAL void aio__direct_unpublish(aio_engine *e, aio_mr *m);
/* Closes a slot to new copies and waits up to wait_ns for those under way: 0, or -FI_EBUSY. */
AIO_INTERNAL int aio__direct_retire(direct_table *t, int32_t idx, int64_t wait_ns);
/* Whether an attached peer's process exited or closed its table (marks it dead for good). */
AIO_INTERNAL int aio__peer_gone(direct_peer *p);
/* Lets go of every attached table and of this engine's own (aio_engine_destroy). */
AIO_INTERNAL void aio__direct_destroy(aio_engine *e);

#endif
