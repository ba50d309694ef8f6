/* kvconductor/c/index.h: atomic loads of the index core.
 * Declared for Cython in kvconductor/_index.pyx (cdef extern from "kvconductor/c/index.h"). */
#ifndef KVC_INDEX_H
#define KVC_INDEX_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

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

/* A query's scratch kept per reader thread (one malloc'd block, _index_query.pxi's
   ``_scratch_thread``): no thread shares it, so no lock; the block is freed when its
   thread exits (a pthread key's destructor) or when a larger one replaces it. */
static pthread_key_t kvc_scratch_key;
static pthread_once_t kvc_scratch_once = PTHREAD_ONCE_INIT;
static int kvc_scratch_keyed = 0;
static __thread void *kvc_scratch_block = NULL;
static void kvc_scratch_make_key(void) {
    kvc_scratch_keyed = pthread_key_create(&kvc_scratch_key, free) == 0;
}
/* This thread's block, NULL before its first query. */
static inline void *kvc_scratch_get(void) { return kvc_scratch_block; }
/* This thread's block becomes ``p`` (the old one freed); -1 (``p`` not kept, the caller
   frees it) when the thread key cannot be made or set. */
static inline int kvc_scratch_set(void *p) {
    pthread_once(&kvc_scratch_once, kvc_scratch_make_key);
    if (!kvc_scratch_keyed || pthread_setspecific(kvc_scratch_key, p) != 0)
        return -1;
    free(kvc_scratch_block);
    kvc_scratch_block = p;
    return 0;
}

#endif /* KVC_INDEX_H */
