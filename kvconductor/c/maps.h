/* kvconductor/c/maps.h: prefetch for the hash maps.
 * Declared for Cython in kvconductor/_maps.pxd (cdef extern from "kvconductor/c/maps.h"). */
#ifndef KVC_MAPS_H
#define KVC_MAPS_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__) || defined(__clang__)
#define kvc_prefetch(p) __builtin_prefetch((p), 0, 1)
#else
#define kvc_prefetch(p) ((void)(p))
#endif

#endif /* KVC_MAPS_H */
