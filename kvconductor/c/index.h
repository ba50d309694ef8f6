/* kvconductor/c/index.h: atomic loads of the index core.
 * Declared for Cython in kvconductor/_index.pyx (cdef extern from "kvconductor/c/index.h"). */
#ifndef KVC_INDEX_H
#define KVC_INDEX_H

#include <stddef.h>
#include <stdint.h>

static inline uint64_t kvc_load_u64(const uint64_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
/* The shared lock's writer flag (a worker's query between two steps of its walk). */
static inline uint32_t kvc_load_u32(const uint32_t *p) {
    return __atomic_load_n(p, __ATOMIC_SEQ_CST);
}

/* A worker's long queries: read sections left for the writer between two steps of the
   walk, and walks started again (the tree changed under the path); this process's. */
static uint64_t kvc_query_yields = 0, kvc_query_restarts = 0;
static inline void kvc_count_yield(int restart) {
    __atomic_add_fetch(restart ? &kvc_query_restarts : &kvc_query_yields, 1, __ATOMIC_RELAXED);
}
static inline uint64_t kvc_query_count(int restart) {
    return __atomic_load_n(restart ? &kvc_query_restarts : &kvc_query_yields, __ATOMIC_RELAXED);
}

#endif /* KVC_INDEX_H */
