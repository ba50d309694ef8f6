/* kvconductor/c/rwlock.h: the writer-preferring rwlock initialiser.
 * Declared for Cython in kvconductor/_rwlock.pxd (cdef extern from "kvconductor/c/rwlock.h"). */
#ifndef KVC_RWLOCK_H
#define KVC_RWLOCK_H

#include <stddef.h>
#include <stdint.h>

#include <pthread.h>
static inline int kvc_rwlock_init(pthread_rwlock_t *lock) {
#if defined(__GLIBC__)
    pthread_rwlockattr_t attr;
    int rc = pthread_rwlockattr_init(&attr);
    if (rc != 0)
        return rc;
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    rc = pthread_rwlock_init(lock, &attr);
    pthread_rwlockattr_destroy(&attr);
    return rc;
#else
    return pthread_rwlock_init(lock, NULL);
#endif
}

#endif /* KVC_RWLOCK_H */
