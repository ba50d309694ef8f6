/* kvconductor/c/shlock.h: the robust cross-process reader/writer lock.
 * Declared for Cython in kvconductor/_shlock.pxd (cdef extern from "kvconductor/c/shlock.h"). */
#ifndef KVC_SHLOCK_H
#define KVC_SHLOCK_H

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
#define SHL_VERSION 3u
#define SHL_SLOTS 256
#define SHL_HIST 12             /* writer wait histogram buckets (last: +Inf) */
#define SHL_LOG 16              /* stall log entries (a ring) */
enum { SHL_OK = 0, SHL_EBUSY = 1, SHL_EINVAL = 2, SHL_EAGAIN = 3, SHL_EMAGIC = 4 };

/* Upper bounds (ns) of the writer wait histogram's buckets; the last is +Inf. */
static const uint64_t shl_hist_bounds[SHL_HIST - 1] = {
    100000ull, 1000000ull, 10000000ull, 50000000ull, 100000000ull, 250000000ull,
    500000000ull, 1000000000ull, 2500000000ull, 5000000000ull, 10000000000ull};

typedef struct {
    int32_t pid;        /* 0: free; -1: being reclaimed; else the owner's pid */
    uint32_t active;    /* 1 inside a read section; the writer's futex */
    uint64_t stamp;     /* owner's start time + 1 (0: unknown) */
    uint32_t enters;    /* read sections begun (wraps): tells a new section apart */
    char pad[44];       /* one cache line per slot: readers do not share lines */
} shl_slot;

typedef struct {
    uint64_t seq;       /* 1, 2, ... (0: being written or never) */
    int32_t pid;        /* the stalled reader's process */
    int32_t slot;
    uint64_t waited_ns; /* how long the writer had waited for it */
    uint32_t killed;    /* 1: SIGKILL sent to it */
    char state;         /* its process state then (/proc/<pid>/stat field 3; '?') */
    char pad[3];
} shl_stall;

typedef struct {
    uint32_t magic;
    uint32_t version;
    uint32_t nslots;
    uint32_t used;          /* slots ever taken: 1 + the highest index (never lowered);
                               a writer scans these, not all SHL_SLOTS */
    uint64_t reclaimed;     /* slots of dead owners cleared */
    uint64_t writer_waits;  /* futex waits of writers on active slots */
    uint64_t stalls;        /* readers found inside past the stall bound */
    uint64_t kills;         /* of them, SIGKILLed */
    uint32_t stall_ms;      /* policy: the stall bound (0: none) */
    uint32_t kill_stalled;  /* policy: SIGKILL a stalled reader (a child process) */
    uint32_t wlock;         /* 1 from write_begin to write_exit: one writer */
    int32_t stalling_pid;   /* the writer is waiting, unpreferred, for this reader */
    uint64_t stalling_since_ns;     /* since then (CLOCK_MONOTONIC) */
    uint64_t wait_count;    /* write sections entered, and how long each waited */
    uint64_t wait_sum_ns;
    uint64_t wait_hist[SHL_HIST];
    uint64_t stall_seq;     /* entries written to stall_log */
    shl_stall stall_log[SHL_LOG];
    uint32_t writer __attribute__((aligned(64)));   /* preference; readers' futex */
    char pad2[60];
    shl_slot slots[SHL_SLOTS] __attribute__((aligned(64)));
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

static inline uint64_t shl_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Fields of /proc/<pid>/stat: state (3), ppid (4), num_threads (20) and start
   time + 1 (22). 1 when read, 0 when it cannot be (no such process, no /proc). */
static inline int shl_proc_info(int32_t pid, char *state, int32_t *ppid, long *threads,
                                uint64_t *stamp) {
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
    if (p == NULL || p[1] != ' ')
        return 0;
    for (p += 2, field = 3; *p && field < 22; ) {
        if (field == 3)
            *state = *p;
        else if (field == 4)
            *ppid = (int32_t)strtol(p, NULL, 10);
        else if (field == 20)
            *threads = strtol(p, NULL, 10);
        while (*p && *p != ' ')
            p++;
        if (*p == ' ') {
            p++;
            field++;
        }
    }
    if (field != 22 || *p < '0' || *p > '9')
        return 0;
    *stamp = strtoull(p, NULL, 10) + 1;
    return 1;
}

/* Start time of pid (clock ticks since boot, /proc/<pid>/stat field 22) + 1;
   0 when it cannot be read (no such process, no /proc). */
static inline uint64_t shl_proc_stamp(int32_t pid) {
    char state;
    int32_t ppid;
    long threads;
    uint64_t stamp;
    if (!shl_proc_info(pid, &state, &ppid, &threads, &stamp))
        return 0;
    return stamp;
}

/* 0 when the owner (pid, stamp) of a slot is dead: no such process, the pid now
   names another process (another start time), or a zombie whose threads have all
   exited (it runs no code any more; its parent has not reaped it yet). */
static inline int shl_owner_alive(int32_t pid, uint64_t stamp) {
    char state = '?';
    int32_t ppid = 0;
    long threads = 0;
    uint64_t now = 0;
    if (pid <= 0)
        return 1;           /* free or being reclaimed: nothing to judge */
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 0;
    if (!shl_proc_info(pid, &state, &ppid, &threads, &now))
        return stamp == 0;  /* start unknown (no /proc): kill decides */
    if (stamp != 0 && now != stamp)
        return 0;
    if ((state == 'Z' || state == 'X') && threads <= 1)
        return 0;
    return 1;
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

/* The stall policy: a reader inside stall_ms after the writer started waiting
   for it is stalled (0: never); kill: SIGKILL it when it is a child process. */
static inline void shl_set_stall_policy(ShLock *l, uint32_t stall_ms, int kill) {
    __atomic_store_n(&l->stall_ms, stall_ms, SHL_SC);
    __atomic_store_n(&l->kill_stalled, kill ? 1u : 0u, SHL_SC);
}

/* Raise l->used to cover slot i, before its first read section: a writer that
   set its flag and then reads l->used scans every slot a reader inside can hold
   (a reader sets its active flag after this, then checks the writer flag). */
static inline void shl_note_used(ShLock *l, int i) {
    uint32_t n = __atomic_load_n(&l->used, SHL_SC);
    while (n < (uint32_t)i + 1
           && !__atomic_compare_exchange_n(&l->used, &n, (uint32_t)i + 1, 0, SHL_SC, SHL_SC)) {
    }
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
            shl_note_used(l, i);
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
    /* counted before active is set (the SC store below orders it): a writer that
       sees this section active sees its count too */
    __atomic_store_n(&s->enters, s->enters + 1, __ATOMIC_RELAXED);
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

/* Take the writer mutex and set the preference flag: SHL_OK, or SHL_EBUSY when
   another writer holds it. New readers wait from here on. */
static inline int shl_write_begin(ShLock *l) {
    uint32_t expect = 0;
    if (!__atomic_compare_exchange_n(&l->wlock, &expect, 1, 0, SHL_SC, SHL_SC))
        return SHL_EBUSY;
    __atomic_store_n(&l->writer, 1, SHL_SC);
    return SHL_OK;
}

/* (The writer, after shl_write_begin) clear the preference flag: readers enter
   again while the writer still waits. */
static inline int shl_write_yield(ShLock *l) {
    if (!__atomic_load_n(&l->wlock, SHL_SC))
        return SHL_EINVAL;
    __atomic_store_n(&l->writer, 0, SHL_SC);
    shl_futex_wake(&l->writer, INT_MAX);
    return SHL_OK;
}

/* (The writer) set the preference flag again: new readers wait. */
static inline int shl_write_prefer(ShLock *l) {
    if (!__atomic_load_n(&l->wlock, SHL_SC))
        return SHL_EINVAL;
    __atomic_store_n(&l->writer, 1, SHL_SC);
    return SHL_OK;
}

/* Without waiting (after shl_write_begin): reclaim the active slots of dead owners
   and count the active slots left (0: the writer is alone). */
static inline int shl_write_pending(ShLock *l) {
    int i, n = 0, used = (int)__atomic_load_n(&l->used, SHL_SC);
    for (i = 0; i < used; i++) {
        if (__atomic_load_n(&l->slots[i].active, SHL_SC)
                && !shl_reclaim_if_dead(l, i)
                && __atomic_load_n(&l->slots[i].active, SHL_SC))
            n++;
    }
    return n;
}

/* SIGKILL pid if it is still the process (pid, stamp) and a child of this
   process: 1 when the signal was sent. Through a pidfd where the kernel has them
   (Linux 5.3+), so a pid recycled meanwhile is never signalled. */
static inline int shl_kill_child(int32_t pid, uint64_t stamp) {
    char state = '?';
    int32_t ppid = 0;
    long threads = 0, r;
    uint64_t now = 0;
    int fd = -1;
    if (pid <= 0 || pid == (int32_t)getpid())
        return 0;
#ifdef SYS_pidfd_open
    fd = (int)syscall(SYS_pidfd_open, pid, 0);
#endif
    /* with the pidfd open, the checks below are about the process it names */
    if (!shl_proc_info(pid, &state, &ppid, &threads, &now)
            || (stamp != 0 && now != stamp) || ppid != (int32_t)getpid()) {
        if (fd >= 0)
            close(fd);
        return 0;
    }
#ifdef SYS_pidfd_send_signal
    if (fd >= 0) {
        r = syscall(SYS_pidfd_send_signal, fd, SIGKILL, NULL, 0);
        close(fd);
        return r == 0;
    }
#endif
    if (fd >= 0)
        close(fd);
    return kill(pid, SIGKILL) == 0;
}

static inline void shl_note_wait(ShLock *l, uint64_t ns) {
    int b = 0;
    while (b < SHL_HIST - 1 && ns > shl_hist_bounds[b])
        b++;
    __atomic_add_fetch(&l->wait_hist[b], 1, SHL_SC);
    __atomic_add_fetch(&l->wait_sum_ns, ns, SHL_SC);
    __atomic_add_fetch(&l->wait_count, 1, SHL_SC);
}

/* The writer found slot i inside its read section waited_ns after it started
   waiting for it, past the stall bound. Stop preferring (readers of every other
   slot go on), SIGKILL the reader if the policy says so and it is a child
   process, log the stall, and wait until that read section is over: the reader
   left it (a resumed process, seen at the next timeout_ms wait at the latest;
   another section of the same slot is another matter) or is dead (the slot
   reclaimed). Then prefer again. */
static inline void shl_handle_stall(ShLock *l, int i, uint64_t waited_ns, int timeout_ms) {
    shl_slot *s = &l->slots[i];
    int32_t pid = __atomic_load_n(&s->pid, SHL_SC);
    uint64_t stamp = __atomic_load_n(&s->stamp, SHL_SC);
    uint32_t enters = __atomic_load_n(&s->enters, SHL_SC);
    uint64_t seq, now = 0;
    int32_t ppid = 0;
    long threads = 0, r;
    char state = '?';
    int killed = 0, polls = 0;
    shl_stall *e;
    if (pid <= 0)
        return;
    shl_write_yield(l);
    __atomic_store_n(&l->stalling_since_ns, shl_now_ns(), SHL_SC);
    __atomic_store_n(&l->stalling_pid, pid, SHL_SC);
    if (!shl_proc_info(pid, &state, &ppid, &threads, &now))
        state = '?';
    if (__atomic_load_n(&l->kill_stalled, SHL_SC))
        killed = shl_kill_child(pid, stamp);
    __atomic_add_fetch(&l->stalls, 1, SHL_SC);
    if (killed)
        __atomic_add_fetch(&l->kills, 1, SHL_SC);
    seq = __atomic_load_n(&l->stall_seq, SHL_SC) + 1;
    e = &l->stall_log[(seq - 1) % SHL_LOG];
    __atomic_store_n(&e->seq, 0, SHL_SC);
    e->pid = pid;
    e->slot = i;
    e->waited_ns = waited_ns;
    e->killed = (uint32_t)killed;
    e->state = state;
    __atomic_store_n(&e->seq, seq, SHL_SC);
    __atomic_store_n(&l->stall_seq, seq, SHL_SC);
    while (__atomic_load_n(&s->active, SHL_SC) == 1
            && __atomic_load_n(&s->pid, SHL_SC) == pid
            && __atomic_load_n(&s->enters, SHL_SC) == enters) {
        /* a killed process dies within a few ms: poll every 1 ms for the first
           100 ms, then as usual (one that does not die is waited for) */
        r = shl_futex_wait(&s->active, 1, killed && polls++ < 100 ? 1 : timeout_ms);
        if (r != 0 && errno == ETIMEDOUT && !shl_owner_alive(pid, stamp))
            shl_reclaim_slot(l, i, pid);
    }
    if (killed)
        shl_reclaim_dead(l);    /* the slots of its other threads */
    __atomic_store_n(&l->stalling_pid, 0, SHL_SC);
    shl_write_prefer(l);
}

/* Enter the write section: take the writer mutex, set the flag, then wait for
   every active slot to clear, timeout_ms per futex wait, reclaiming the slot once
   its owner is dead, and acting on a reader stalled past the policy's bound
   (shl_handle_stall), after which every slot is waited for again. */
static inline int shl_write_enter(ShLock *l, int timeout_ms) {
    int i, used, wait, rc = shl_write_begin(l);
    long r;
    uint64_t bound, start = 0, t0 = 0, now, left;
    if (rc != SHL_OK)
        return rc;
    if (timeout_ms <= 0)
        timeout_ms = 10;
    bound = (uint64_t)__atomic_load_n(&l->stall_ms, SHL_SC) * 1000000ull;
again:
    /* PERF: the slots ever taken, not all SHL_SLOTS cache lines per write section */
    used = (int)__atomic_load_n(&l->used, SHL_SC);
    for (i = 0; i < used; i++) {
        while (__atomic_load_n(&l->slots[i].active, SHL_SC) == 1) {
            now = shl_now_ns();
            if (start == 0)
                start = now;
            if (t0 == 0)
                t0 = now;
            wait = timeout_ms;
            if (bound != 0) {
                if (now - t0 >= bound) {
                    if (shl_reclaim_if_dead(l, i))
                        continue;
                    shl_handle_stall(l, i, now - t0, timeout_ms);
                    t0 = 0;         /* a new bound for the readers inside now */
                    goto again;
                }
                left = (bound - (now - t0) + 999999ull) / 1000000ull;
                if (left < (uint64_t)wait)
                    wait = (int)left;
            }
            __atomic_add_fetch(&l->writer_waits, 1, SHL_SC);
            r = shl_futex_wait(&l->slots[i].active, 1, wait);
            if (r != 0 && errno == ETIMEDOUT)
                shl_reclaim_if_dead(l, i);
        }
    }
    shl_note_wait(l, start ? shl_now_ns() - start : 0);
    return SHL_OK;
}

/* Leave the write section: clear the flag, wake the readers, release the mutex. */
static inline int shl_write_exit(ShLock *l) {
    if (!__atomic_load_n(&l->wlock, SHL_SC))
        return SHL_EINVAL;
    __atomic_store_n(&l->writer, 0, SHL_SC);
    shl_futex_wake(&l->writer, INT_MAX);
    __atomic_store_n(&l->wlock, 0, SHL_SC);
    return SHL_OK;
}

#endif /* KVC_SHLOCK_H */
