# cython: language_level=3
"""Response encoding of the query path (``_encode.pyx``)."""

# A growing output buffer (malloc'd; the owner frees ``data``).
ctypedef struct wbuf:
    char* data
    size_t len
    size_t cap
