/* kvconductor/c/bits.h: bit helpers of the radix tree (popcount, count trailing zeros).
 * Declared for Cython in kvconductor/_tree.pyx (cdef extern from "kvconductor/c/bits.h"). */
#ifndef KVC_BITS_H
#define KVC_BITS_H

#include <stdint.h>
/* popcount without -mpopcnt: the SWAR sum (gcc would call libgcc's table loop) */
static inline unsigned kvc_popc64(uint64_t x) {
#if defined(__POPCNT__) || defined(__aarch64__)
    return (unsigned)__builtin_popcountll(x);
#else
    x = x - ((x >> 1) & 0x5555555555555555ULL);
    x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0FULL;
    return (unsigned)((x * 0x0101010101010101ULL) >> 56);
#endif
}
/* index of the lowest set bit of x != 0 */
static inline unsigned kvc_ctz64(uint64_t x) { return (unsigned)__builtin_ctzll(x); }

#endif /* KVC_BITS_H */
