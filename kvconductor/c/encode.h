/* kvconductor/c/encode.h: small bit helpers of the response encoder.
 * Declared for Cython in kvconductor/_encode.pyx (cdef extern from "kvconductor/c/encode.h"). */
#ifndef KVC_ENCODE_H
#define KVC_ENCODE_H

#include <stddef.h>
#include <stdint.h>

static inline unsigned kvc_log2_u64(unsigned long long x) {
    return 63u - (unsigned)__builtin_clzll(x);
}

#endif /* KVC_ENCODE_H */
