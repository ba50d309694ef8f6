/* kvconductor/c/arena.h: the shared-memory arena (memfd at a fixed address): mapping and allocator.
 * Declared for Cython in kvconductor/_arena.pyx (cdef extern from "kvconductor/c/arena.h"). */
#ifndef KVC_ARENA_H
#define KVC_ARENA_H

#include <stddef.h>
#include <stdint.h>

#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <fcntl.h>
#include <unistd.h>
#include <errno.h>
#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif
#ifndef FALLOC_FL_KEEP_SIZE
#define FALLOC_FL_KEEP_SIZE 0x01
#endif
#ifndef FALLOC_FL_PUNCH_HOLE
#define FALLOC_FL_PUNCH_HOLE 0x02
#endif
#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif
static int kvc_arena_memfd(void) {
    return (int)syscall(SYS_memfd_create, "kvconductor-arena", MFD_CLOEXEC);
}
static int kvc_arena_punch(int fd, uint64_t off, uint64_t len) {
    return fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                     (off_t)off, (off_t)len);
}
static int kvc_arena_grow(int fd, uint64_t size) {
    return ftruncate(fd, (off_t)size);
}
static void *kvc_arena_map(uintptr_t addr, uint64_t len, int fd) {
    void *p = mmap((void *)addr, (size_t)len, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_NORESERVE | MAP_FIXED_NOREPLACE, fd, 0);
    return p;
}
static int kvc_arena_unmap(void *p, uint64_t len) { return munmap(p, (size_t)len); }
static long kvc_arena_file_size(int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0)
        return -1;
    return (long)st.st_size;
}
static int kvc_errno(void) { return errno; }
#define KVC_MAP_FAILED ((void *)MAP_FAILED)

#endif /* KVC_ARENA_H */
