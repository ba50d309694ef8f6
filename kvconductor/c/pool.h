/* kvconductor/c/pool.h: counted structure allocation and the shared arena hook.
 * Declared for Cython in kvconductor/_pool.pxd (cdef extern from "kvconductor/c/pool.h"). */
#ifndef KVC_POOL_H
#define KVC_POOL_H

#include <stddef.h>
#include <stdint.h>

#include <stdlib.h>
#include <pthread.h>
static long kvc_live_allocs = 0;
#if defined(__GNUC__) || defined(__clang__)
#define kvc_count(d) ((void)__atomic_add_fetch(&kvc_live_allocs, (d), __ATOMIC_RELAXED))
#define kvc_live() __atomic_load_n(&kvc_live_allocs, __ATOMIC_RELAXED)
#else
#define kvc_count(d) ((void)(kvc_live_allocs += (d)))
#define kvc_live() (kvc_live_allocs)
#endif
typedef void *(*kvc_arena_malloc_fn)(void *, size_t);
typedef void *(*kvc_arena_realloc_fn)(void *, void *, size_t);
typedef int (*kvc_arena_free_fn)(void *, void *);
static void *kvc_arena = NULL;
static kvc_arena_malloc_fn kvc_arena_malloc = NULL;
static kvc_arena_realloc_fn kvc_arena_realloc = NULL;
static kvc_arena_free_fn kvc_arena_free = NULL;
static const char *kvc_arena_lo = NULL, *kvc_arena_hi = NULL;
static pthread_t kvc_arena_writer;
static long kvc_arena_leaks = 0;
static inline void kvc_set_arena(void *arena, void *m, void *r, void *f, const char *lo,
                                 const char *hi) {
    kvc_arena_malloc = (kvc_arena_malloc_fn)m;
    kvc_arena_realloc = (kvc_arena_realloc_fn)r;
    kvc_arena_free = (kvc_arena_free_fn)f;
    kvc_arena_lo = lo;
    kvc_arena_hi = hi;
    kvc_arena_writer = pthread_self();
    __atomic_store_n(&kvc_arena, arena, __ATOMIC_SEQ_CST);
}
static inline void kvc_unset_arena(void) {
    __atomic_store_n(&kvc_arena, NULL, __ATOMIC_SEQ_CST);
}
static inline int kvc_in_arena(const void *p) {
    return kvc_arena_lo != NULL && (const char *)p >= kvc_arena_lo
        && (const char *)p < kvc_arena_hi;
}
static inline int kvc_arena_writing(void) {
    return __atomic_load_n(&kvc_arena, __ATOMIC_SEQ_CST) != NULL
        && pthread_equal(pthread_self(), kvc_arena_writer);
}
static inline void *kvc_mem_alloc(size_t n) {
    void *p = kvc_arena_writing() ? kvc_arena_malloc(kvc_arena, n) : malloc(n);
    if (p != NULL)
        kvc_count(1);
    return p;
}
static inline void *kvc_mem_realloc(void *ptr, size_t n) {
    void *p;
    if (ptr != NULL && kvc_in_arena(ptr))
        p = kvc_arena_writing() ? kvc_arena_realloc(kvc_arena, ptr, n) : NULL;
    else if (ptr == NULL && kvc_arena_writing())
        p = kvc_arena_malloc(kvc_arena, n);
    else
        p = realloc(ptr, n);
    if (p != NULL && ptr == NULL)
        kvc_count(1);
    return p;
}
static inline void kvc_mem_free(void *p) {
    if (p == NULL)
        return;
    kvc_count(-1);
    if (!kvc_in_arena(p))
        free(p);
    else if (kvc_arena_writing())
        kvc_arena_free(kvc_arena, p);
    else
        __atomic_add_fetch(&kvc_arena_leaks, 1, __ATOMIC_RELAXED);
}
static inline long kvc_live_allocations(void) { return kvc_live(); }
static inline long kvc_arena_leaked(void) {
    return __atomic_load_n(&kvc_arena_leaks, __ATOMIC_RELAXED);
}

#endif /* KVC_POOL_H */
