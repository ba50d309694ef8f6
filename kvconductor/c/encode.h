/* kvconductor/c/encode.h: small bit helpers of the response encoder.
 * Declared for Cython in kvconductor/_encode.pyx and, for the answers as Python objects,
 * kvconductor/_index_answers.pxi (cdef extern from "kvconductor/c/encode.h"). */
#ifndef KVC_ENCODE_H
#define KVC_ENCODE_H

#include <stddef.h>
#include <stdint.h>

static inline unsigned kvc_log2_u64(unsigned long long x) {
    return 63u - (unsigned)__builtin_clzll(x);
}

/* min(a * b, 2^32 - 1): a row's matched tokens (its blocks times the block size), as the
 * V3 answer caps them (the encoder's bytes and the index's answer dicts alike). */
static inline uint64_t kvc_sat_u32_mul(uint64_t a, uint64_t b) {
    if (a == 0 || b == 0)
        return 0;
    if (a > UINT32_MAX || b > UINT32_MAX)
        return UINT32_MAX;
    a *= b;
    return a < UINT32_MAX ? a : UINT32_MAX;
}

#endif /* KVC_ENCODE_H */
