/* Groups: requests that finish as one record (groups.c). */
#ifndef AIOTE_CORE_GROUPS_H
#define AIOTE_CORE_GROUPS_H

#include "internal.h"

/* One request of group g finished (status 0 or a negative error): the last one, once the
 * group is sealed, pushes its record. Any thread; g < 0 is no group. */
AIO_INTERNAL void aio__group_op_done(aio_engine *e, int64_t g, int status, int prov_errno);
/* aio_group_seal by the thread that posted every request of g, once its own progress may
 * have completed them all: when sealing ends g, it ends here without a record (its slot
 * freed): returns 1 with the first failure's status in *status (0: all landed); otherwise 0,
 * sealed as by aio_group_seal (the last completion pushes the record). -FI_EINVAL when g is
 * not open or already sealed. */
AIO_INTERNAL int aio__group_seal_inline(aio_engine *e, int64_t g, int32_t *status, int32_t *prov_errno);
/* Whether group g is open and not sealed (requests may be posted into it). */
AIO_INTERNAL int aio__group_postable(aio_engine *e, int64_t g);

#endif
