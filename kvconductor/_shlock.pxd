# cython: language_level=3
"""The robust cross-process reader/writer lock (``docs/design.md``, "The cross-process
lock"): a :c:type:`ShLock` that lives in shared memory (any ``MAP_SHARED`` mapping) and
survives a reader killed inside its read section.

* A writer flag word (also the futex readers wait on) and a fixed table of
  ``SHL_SLOTS`` reader slots, one cache line each: {owner pid, owner start stamp,
  ``active`` (the futex the writer waits on)}.
* A reading thread takes one slot (:func:`shl_slot_acquire`) and keeps it; it gives it
  back with :func:`shl_slot_release`, or the writer reclaims it once its owner is dead.
* Reader: waits while the writer flag is set, sets ``active``, checks the flag again
  (sequentially consistent, Dekker-style); if the writer came in meanwhile it clears
  ``active``, wakes the writer and waits again.
* Writer (one at a time: a second concurrent writer gets ``SHL_EBUSY``): sets the flag,
  then waits on every active slot's futex ``timeout_ms`` at a time; after each timeout
  it checks the slot owner: gone (``kill(pid, 0)`` gives ``ESRCH``) or another process
  under the same pid (its start time, ``/proc/<pid>/stat`` field 22, differs) means
  dead, and the slot is cleared (counted in ``reclaimed``). The writer never waits on a
  dead reader. (A writer that dies inside leaves the flag set and the readers waiting:
  the owner is the only writer, and its death takes the workers down.)

Everything is ``noexcept nogil`` with ``SHL_*`` return codes; raw ``futex(2)``
``FUTEX_WAIT``/``FUTEX_WAKE`` (not the ``_PRIVATE`` ones: the waiters are in other
processes). Linux only. Pids are those of the caller's pid namespace.
"""
from libc.stdint cimport int32_t, uint32_t, uint64_t

cdef extern from *:
    """
    #include <errno.h>
    #include <fcntl.h>
    #include <limits.h>
    #include <signal.h>
    #include <stdint.h>
    #include <stdio.h>
    #include <stdlib.h>
    #include <string.h>
    #include <time.h>
    #include <unistd.h>
    #include <linux/futex.h>
    #include <sys/syscall.h>

    #define SHL_MAGIC 0x6b76534cu   /* "kvSL" */
    #define SHL_VERSION 1u
    #define SHL_SLOTS 256
    enum { SHL_OK = 0, SHL_EBUSY = 1, SHL_EINVAL = 2, SHL_EAGAIN = 3, SHL_EMAGIC = 4 };

    typedef struct {
        int32_t pid;        /* 0: free; -1: being reclaimed; else the owner's pid */
        uint32_t active;    /* 1 inside a read section; the writer's futex */
        uint64_t stamp;     /* owner's start time + 1 (0: unknown) */
        char pad[48];       /* one cache line per slot: readers do not share lines */
    } shl_slot;

    typedef struct {
        uint32_t magic;
        uint32_t version;
        uint32_t nslots;
        uint32_t pad0;
        uint64_t reclaimed;     /* slots of dead owners cleared */
        uint64_t writer_waits;  /* futex waits of writers on active slots */
        char pad1[32];
        uint32_t writer;        /* 1 while a writer is waiting or inside; readers' futex */
        char pad2[60];
        shl_slot slots[SHL_SLOTS];
    } ShLock;

    #define SHL_SC __ATOMIC_SEQ_CST

    static inline long shl_futex_wait(uint32_t *addr, uint32_t val, int timeout_ms) {
        struct timespec ts, *tp = NULL;
        if (timeout_ms >= 0) {
            ts.tv_sec = timeout_ms / 1000;
            ts.tv_nsec = (long)(timeout_ms % 1000) * 1000000L;
            tp = &ts;
        }
        return syscall(SYS_futex, addr, FUTEX_WAIT, val, tp, NULL, 0);
    }

    static inline void shl_futex_wake(uint32_t *addr, int n) {
        syscall(SYS_futex, addr, FUTEX_WAKE, n, NULL, NULL, 0);
    }

    /* Start time of pid (clock ticks since boot, /proc/<pid>/stat field 22) + 1;
       0 when it cannot be read (no such process, no /proc). */
    static inline uint64_t shl_proc_stamp(int32_t pid) {
        char path[64], buf[1024];
        int fd, field = 2;
        ssize_t n;
        char *p;
        if (pid <= 0)
            return 0;
        snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            return 0;
        n = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (n <= 0)
            return 0;
        buf[n] = 0;
        p = strrchr(buf, ')');   /* field 2 (comm) may hold spaces and ')' */
        if (p == NULL)
            return 0;
        for (p++; *p && field < 22; p++)
            if (*p == ' ')
                field++;
        if (field != 22 || *p < '0' || *p > '9')
            return 0;
        return strtoull(p, NULL, 10) + 1;
    }

    /* 0 when the owner (pid, stamp) of a slot is dead: no such process, or the pid
       now names another process (another start time). */
    static inline int shl_owner_alive(int32_t pid, uint64_t stamp) {
        uint64_t now;
        if (pid <= 0)
            return 1;           /* free or being reclaimed: nothing to judge */
        if (kill(pid, 0) != 0 && errno == ESRCH)
            return 0;
        if (stamp == 0)
            return 1;           /* start unknown (no /proc at acquire): kill decides */
        now = shl_proc_stamp(pid);
        return now == stamp;
    }

    static inline void shl_init(ShLock *l) {
        memset(l, 0, sizeof *l);
        l->version = SHL_VERSION;
        l->nslots = SHL_SLOTS;
        __atomic_store_n(&l->magic, SHL_MAGIC, SHL_SC);
    }

    static inline int shl_check(const ShLock *l) {
        if (__atomic_load_n(&l->magic, SHL_SC) != SHL_MAGIC || l->version != SHL_VERSION
                || l->nslots != SHL_SLOTS)
            return SHL_EMAGIC;
        return SHL_OK;
    }

    /* A free slot for a thread of process pid (start stamp as shl_proc_stamp gives
       it): its index, or -1 when all are taken. */
    static inline int shl_slot_acquire(ShLock *l, int32_t pid, uint64_t stamp) {
        int i;
        int32_t expect;
        if (pid <= 0)
            return -1;
        for (i = 0; i < SHL_SLOTS; i++) {
            expect = 0;
            if (__atomic_load_n(&l->slots[i].pid, SHL_SC) == 0
                    && __atomic_compare_exchange_n(&l->slots[i].pid, &expect, pid, 0,
                                                   SHL_SC, SHL_SC)) {
                __atomic_store_n(&l->slots[i].stamp, stamp, SHL_SC);
                return i;
            }
        }
        return -1;
    }

    static inline int shl_slot_ok(ShLock *l, int slot) {
        return slot >= 0 && slot < SHL_SLOTS && __atomic_load_n(&l->slots[slot].pid, SHL_SC) > 0;
    }

    /* Give a slot back (its owner, outside a read section). */
    static inline int shl_slot_release(ShLock *l, int slot) {
        if (!shl_slot_ok(l, slot) || __atomic_load_n(&l->slots[slot].active, SHL_SC))
            return SHL_EINVAL;
        __atomic_store_n(&l->slots[slot].stamp, 0, SHL_SC);
        __atomic_store_n(&l->slots[slot].pid, 0, SHL_SC);
        return SHL_OK;
    }

    /* Clear slot i if it still belongs to pid (whose death the caller saw). Claimed
       first (pid -> -1), so two reclaimers cannot both clear, and neither can clear
       the active flag of a new owner. 1 when this call cleared it. */
    static inline int shl_reclaim_slot(ShLock *l, int i, int32_t pid) {
        int32_t expect = pid;
        if (pid <= 0 || !__atomic_compare_exchange_n(&l->slots[i].pid, &expect, -1, 0,
                                                    SHL_SC, SHL_SC))
            return 0;
        __atomic_store_n(&l->slots[i].stamp, 0, SHL_SC);
        __atomic_store_n(&l->slots[i].active, 0, SHL_SC);
        shl_futex_wake(&l->slots[i].active, INT_MAX);
        __atomic_add_fetch(&l->reclaimed, 1, SHL_SC);
        __atomic_store_n(&l->slots[i].pid, 0, SHL_SC);
        return 1;
    }

    /* Clear the slot if its owner is dead; 1 when this call cleared it. */
    static inline int shl_reclaim_if_dead(ShLock *l, int i) {
        int32_t pid = __atomic_load_n(&l->slots[i].pid, SHL_SC);
        uint64_t stamp = __atomic_load_n(&l->slots[i].stamp, SHL_SC);
        if (pid <= 0 || shl_owner_alive(pid, stamp))
            return 0;
        return shl_reclaim_slot(l, i, pid);
    }

    /* Every slot whose owner is dead, active or not (the owner's supervisor, after a
       worker died): how many were cleared. */
    static inline int shl_reclaim_dead(ShLock *l) {
        int i, n = 0;
        for (i = 0; i < SHL_SLOTS; i++)
            n += shl_reclaim_if_dead(l, i);
        return n;
    }

    /* One attempt to enter a read section: SHL_OK inside, SHL_EAGAIN when a writer is
       waiting or inside (nothing changed then). */
    static inline int shl_read_try(ShLock *l, int slot) {
        shl_slot *s;
        if (!shl_slot_ok(l, slot))
            return SHL_EINVAL;
        s = &l->slots[slot];
        if (__atomic_load_n(&s->active, SHL_SC))
            return SHL_EINVAL;      /* already inside: not reentrant */
        if (__atomic_load_n(&l->writer, SHL_SC))
            return SHL_EAGAIN;
        __atomic_store_n(&s->active, 1, SHL_SC);
        if (!__atomic_load_n(&l->writer, SHL_SC))
            return SHL_OK;
        /* the writer came in meanwhile: it may be waiting on us */
        __atomic_store_n(&s->active, 0, SHL_SC);
        shl_futex_wake(&s->active, INT_MAX);
        return SHL_EAGAIN;
    }

    static inline int shl_read_enter(ShLock *l, int slot) {
        int rc;
        for (;;) {
            while (__atomic_load_n(&l->writer, SHL_SC))
                shl_futex_wait(&l->writer, 1, -1);
            rc = shl_read_try(l, slot);
            if (rc != SHL_EAGAIN)
                return rc;
        }
    }

    static inline int shl_read_exit(ShLock *l, int slot) {
        shl_slot *s;
        if (!shl_slot_ok(l, slot))
            return SHL_EINVAL;
        s = &l->slots[slot];
        if (!__atomic_load_n(&s->active, SHL_SC))
            return SHL_EINVAL;
        __atomic_store_n(&s->active, 0, SHL_SC);
        if (__atomic_load_n(&l->writer, SHL_SC))
            shl_futex_wake(&s->active, INT_MAX);
        return SHL_OK;
    }

    /* Set the writer flag: SHL_OK, or SHL_EBUSY when another writer holds it. New
       readers wait from here on. */
    static inline int shl_write_begin(ShLock *l) {
        uint32_t expect = 0;
        if (!__atomic_compare_exchange_n(&l->writer, &expect, 1, 0, SHL_SC, SHL_SC))
            return SHL_EBUSY;
        return SHL_OK;
    }

    /* Without waiting (after shl_write_begin): reclaim the active slots of dead owners
       and count the active slots left (0: the writer is alone). */
    static inline int shl_write_pending(ShLock *l) {
        int i, n = 0;
        for (i = 0; i < SHL_SLOTS; i++) {
            if (__atomic_load_n(&l->slots[i].active, SHL_SC)
                    && !shl_reclaim_if_dead(l, i)
                    && __atomic_load_n(&l->slots[i].active, SHL_SC))
                n++;
        }
        return n;
    }

    /* Enter the write section: set the flag, then wait for every active slot to clear,
       timeout_ms per futex wait, reclaiming the slot once its owner is dead. */
    static inline int shl_write_enter(ShLock *l, int timeout_ms) {
        int i, rc = shl_write_begin(l);
        long r;
        if (rc != SHL_OK)
            return rc;
        if (timeout_ms <= 0)
            timeout_ms = 10;
        for (i = 0; i < SHL_SLOTS; i++) {
            while (__atomic_load_n(&l->slots[i].active, SHL_SC) == 1) {
                __atomic_add_fetch(&l->writer_waits, 1, SHL_SC);
                r = shl_futex_wait(&l->slots[i].active, 1, timeout_ms);
                if (r != 0 && errno == ETIMEDOUT)
                    shl_reclaim_if_dead(l, i);
            }
        }
        return SHL_OK;
    }

    static inline int shl_write_exit(ShLock *l) {
        uint32_t expect = 1;
        if (!__atomic_compare_exchange_n(&l->writer, &expect, 0, 0, SHL_SC, SHL_SC))
            return SHL_EINVAL;
        shl_futex_wake(&l->writer, INT_MAX);
        return SHL_OK;
    }
    """
    enum:
        SHL_SLOTS
        SHL_OK
        SHL_EBUSY
        SHL_EINVAL
        SHL_EAGAIN
        SHL_EMAGIC

    ctypedef struct shl_slot:
        int32_t pid
        uint32_t active
        uint64_t stamp

    ctypedef struct ShLock:
        uint32_t magic
        uint64_t reclaimed
        uint64_t writer_waits
        uint32_t writer
        shl_slot slots[SHL_SLOTS]

    uint64_t shl_proc_stamp(int32_t pid) noexcept nogil
    int shl_owner_alive(int32_t pid, uint64_t stamp) noexcept nogil
    void shl_init(ShLock* l) noexcept nogil
    int shl_check(const ShLock* l) noexcept nogil
    int shl_slot_acquire(ShLock* l, int32_t pid, uint64_t stamp) noexcept nogil
    int shl_slot_release(ShLock* l, int slot) noexcept nogil
    int shl_reclaim_dead(ShLock* l) noexcept nogil
    int shl_read_try(ShLock* l, int slot) noexcept nogil
    int shl_read_enter(ShLock* l, int slot) noexcept nogil
    int shl_read_exit(ShLock* l, int slot) noexcept nogil
    int shl_write_begin(ShLock* l) noexcept nogil
    int shl_write_pending(ShLock* l) noexcept nogil
    int shl_write_enter(ShLock* l, int timeout_ms) noexcept nogil
    int shl_write_exit(ShLock* l) noexcept nogil


cdef class _Mapping:
    cdef ShLock* lock
    cdef size_t size


cdef class SharedLock:
    cdef _Mapping _map
    cdef ShLock* lock
    cdef int fd
    cdef object _local

    cdef int _slot(self) except -1
