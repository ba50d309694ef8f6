/* kvconductor/c/pool.h: the count of live structure blocks, one per compiled module.
 * Declared for Cython in kvconductor/_pool.pxd (cdef extern from "kvconductor/c/pool.h").
 * The counter is static ON PURPOSE: each module that cimports _pool.pxd counts its own
 * blocks, read by its _live_allocations() (the leak check of the core's tests). The
 * allocator itself lives once, in kvconductor/_alloc.pyx (kvconductor/c/alloc.h). */
#ifndef KVC_POOL_H
#define KVC_POOL_H

static long kvc_live_allocs = 0;
#if defined(__GNUC__) || defined(__clang__)
#define kvc_count(d) ((void)__atomic_add_fetch(&kvc_live_allocs, (d), __ATOMIC_RELAXED))
#define kvc_live() __atomic_load_n(&kvc_live_allocs, __ATOMIC_RELAXED)
#else
#define kvc_count(d) ((void)(kvc_live_allocs += (d)))
#define kvc_live() (kvc_live_allocs)
#endif
static inline void kvc_count_blocks(long d) { kvc_count(d); }
static inline long kvc_live_allocations(void) { return kvc_live(); }

#endif /* KVC_POOL_H */
