# cython: language_level=3
"""Response encoding of the query path (``_encode.pyx``)."""
from libc.stdint cimport uint32_t, uint64_t

# A growing output buffer (malloc'd; the owner frees ``data``).
ctypedef struct wbuf:
    char* data
    size_t len
    size_t cap


# One named (instance, DP) group of an index, pre-encoded for the answer: the instance id
# and the DP key (``str(dp_rank)``) as a JSON string and as a msgpack str, one after the
# other in ``data`` (``ji + mi + jd + md`` bytes), and the instance's ordinal.
ctypedef struct gname_t:
    char* data
    uint32_t inst               # instance ordinal (first-named order)
    uint32_t ji                 # JSON instance id bytes (quoted, escaped)
    uint32_t mi                 # msgpack instance id bytes (header + UTF-8)
    uint32_t jd                 # JSON DP key bytes
    uint32_t md                 # msgpack DP key bytes


# The freshness of one answered (instance, DP) (docs/api.md, "freshness"): its state's
# code (an index into ``FRESH_STATES``), the age of its last event and the time since its
# stream was degraded, in milliseconds, each only when ``has_*`` is set.
ctypedef struct fresh_t:
    uint64_t age_ms
    uint64_t since_ms
    uint32_t code
    uint32_t has_age
    uint32_t has_since


cdef enum:
    GN_CHUNK0 = 256             # entries of the first chunk; chunk c holds GN_CHUNK0 << c
    GN_NCHUNKS = 40


# The group names of one index (``Index``, a worker's ``ViewIndex``). Entries live in chunks
# that never move once allocated (chunk c holds GN_CHUNK0 << c entries), so a reader that
# resolved its groups below ``count`` may use them without the GIL while the writer adds.
cdef class GroupNames:
    cdef gname_t* chunks[GN_NCHUNKS]
    cdef size_t count
    cdef size_t ninst
    cdef size_t nbytes_
    cdef readonly list keys
    cdef readonly list dp_keys
    cdef dict _inst

    cdef gname_t* entry(self, size_t g) noexcept nogil
