/* kvconductor/c/ingest.h: the string tables of the ingest fast path (their Python twins are tied by tests/test_shapes.py).
 * Declared for Cython in kvconductor/_ingest.pyx (cdef extern from "kvconductor/c/ingest.h"). */
#ifndef KVC_INGEST_H
#define KVC_INGEST_H

#include <stddef.h>
#include <stdint.h>

typedef struct { const char* s; size_t n; } kvi_lit;
#define KVI_LIT(x) {x, sizeof(x) - 1}
/* kvconductor.keys.parse_medium aliases of NPU ("" counts as absent, also NPU) */
static const kvi_lit kvi_hbm_media[] = {
    KVI_LIT("npu"), KVI_LIT("NPU"), KVI_LIT("gpu"), KVI_LIT("GPU"), KVI_LIT("xpu"),
    KVI_LIT("XPU"), KVI_LIT("hbm"), KVI_LIT("HBM"), KVI_LIT("device"), KVI_LIT("DEVICE")};
/* kvconductor.ingest.apply.REJECTED_KINDS (lower-case, '_' removed) */
static const kvi_lit kvi_rejected_kinds[] = {
    KVI_LIT("slidingwindow"), KVI_LIT("slidingwindowmla"), KVI_LIT("mamba"),
    KVI_LIT("chunkedlocalattention"), KVI_LIT("encoderonlyattention"),
    KVI_LIT("crossattention")};

#endif /* KVC_INGEST_H */
