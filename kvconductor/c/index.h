/* kvconductor/c/index.h: atomic loads of the index core.
 * Declared for Cython in kvconductor/_index.pyx (cdef extern from "kvconductor/c/index.h"). */
#ifndef KVC_INDEX_H
#define KVC_INDEX_H

#include <stddef.h>
#include <stdint.h>

static inline uint64_t kvc_load_u64(const uint64_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

#endif /* KVC_INDEX_H */
