/* Groups: requests that finish as one record (groups.c). */
#ifndef AIOTE_CORE_GROUPS_H
#define AIOTE_CORE_GROUPS_H

#include "internal.h"

/* One request of group g finished (status 0 or a negative error): the last one, once the
 * group is sealed, pushes its record. Any thread; g < 0 is no group. */
AIO_INTERNAL void aio__group_op_done(aio_engine *e, int64_t g, int status, int prov_errno);
/* Whether group g is open and not sealed (requests may be posted into it). */
AIO_INTERNAL int aio__group_postable(aio_engine *e, int64_t g);

#endif
