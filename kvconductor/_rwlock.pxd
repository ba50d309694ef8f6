# cython: language_level=3
"""The reader/writer lock of the index structures (one per ``cdef class`` of
``_tree``/``_lower``/``_index``): writers exclusive, writer-preferring on glibc."""
cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_rwlock_t:
        pass
    int pthread_rwlock_destroy(pthread_rwlock_t* lock)
    int pthread_rwlock_rdlock(pthread_rwlock_t* lock)
    int pthread_rwlock_tryrdlock(pthread_rwlock_t* lock)
    int pthread_rwlock_wrlock(pthread_rwlock_t* lock)
    int pthread_rwlock_trywrlock(pthread_rwlock_t* lock)
    int pthread_rwlock_unlock(pthread_rwlock_t* lock)

# glibc's pthread_rwlock_t prefers readers unless told otherwise, through a GNU
# extension (pthread_rwlockattr_setkind_np). Other libcs (musl, macOS, the BSDs) have
# no such call; their default rwlock is used there (POSIX leaves the policy to them).
cdef extern from "kvconductor/c/rwlock.h":
    int _kvc_rwlock_init "kvc_rwlock_init"(pthread_rwlock_t* lock) noexcept nogil


cdef inline int rwlock_init(pthread_rwlock_t* lock) noexcept nogil:
    """Writer-preferring on glibc, so a stream of readers cannot starve the ingest thread."""
    return _kvc_rwlock_init(lock)
