/* Watched words (watch.c). */
#ifndef AIOTE_CORE_WATCH_H
#define AIOTE_CORE_WATCH_H

#include "internal.h"

/* Reads every watched word; one AIO_REC_WATCH record per change. Returns the number of changes. */
AIO_INTERNAL int aio__poll_watches(aio_engine *e);

#endif
