/* kvconductor/c/alloc.h: the structure allocator of the compiled core, and its shared
 * arena hook. Included by kvconductor/_alloc.pyx ONLY: its state (the installed arena,
 * the writer thread, the leak count) exists once per process, in that module; every
 * other module allocates through _alloc's exported functions (kvconductor/_pool.pxd's
 * mem_alloc/mem_realloc/mem_free), so installing the arena is one call.
 *
 * Once kvc_set_arena installed the arena, allocations made ON THE WRITER THREAD (the
 * thread that installed it: the owner's ingest thread) come from the shared arena, so
 * worker processes see them at the same address. Other threads keep plain malloc (query
 * scratch, explain walks): the arena allocator has no lock. Frees and reallocs go by
 * address: arena blocks back to the arena (writer thread only; an arena block freed
 * elsewhere is leaked and counted, never handed to the allocator concurrently), others
 * to free/realloc. */
#ifndef KVC_ALLOC_H
#define KVC_ALLOC_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <pthread.h>

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
static inline void *kvc_alloc(size_t n) {
    return kvc_arena_writing() ? kvc_arena_malloc(kvc_arena, n) : malloc(n);
}
static inline void *kvc_realloc(void *ptr, size_t n) {
    if (ptr != NULL && kvc_in_arena(ptr))
        return kvc_arena_writing() ? kvc_arena_realloc(kvc_arena, ptr, n) : NULL;
    if (ptr == NULL && kvc_arena_writing())
        return kvc_arena_malloc(kvc_arena, n);
    return realloc(ptr, n);
}
static inline void kvc_free(void *p) {
    if (p == NULL)
        return;
    if (!kvc_in_arena(p))
        free(p);
    else if (kvc_arena_writing())
        kvc_arena_free(kvc_arena, p);
    else
        __atomic_add_fetch(&kvc_arena_leaks, 1, __ATOMIC_RELAXED);
}
static inline long kvc_arena_leaked(void) {
    return __atomic_load_n(&kvc_arena_leaks, __ATOMIC_RELAXED);
}

#endif /* KVC_ALLOC_H */
