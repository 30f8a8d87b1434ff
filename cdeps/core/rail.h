/* Rails (rail.c). */
#ifndef AIOTE_CORE_RAIL_H
#define AIOTE_CORE_RAIL_H

#include "internal.h"

/* Closes every fabric object of a rail and frees it (a rail half opened too). */
AIO_INTERNAL void aio__rail_free(aio_rail *r);

#endif
