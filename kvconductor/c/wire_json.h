/* kvconductor/c/wire_json.h: helpers of the JSON query-body scanner.
 * Declared for Cython in kvconductor/_wire_json.pxi (cdef extern from "kvconductor/c/wire_json.h"). */
#ifndef KVC_WIRE_JSON_H
#define KVC_WIRE_JSON_H

#include <stddef.h>
#include <stdint.h>

static inline int kvw_ctz64(unsigned long long x) {
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_ctzll(x);
#else
    int n = 0;
    while (!(x & 1)) { x >>= 1; n++; }
    return n;
#endif
}

#endif /* KVC_WIRE_JSON_H */
