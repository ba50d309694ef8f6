# cython: language_level=3
"""C-level declarations of the query parser (``_wire.pyx``).

The readers it shares with ``_ingest`` are in ``_readers.pxd``; this file holds what
belongs to the parser alone.
"""

# Field ids of a /query or /query_by_hash body. Their names are ``_field_name`` in
# ``_wire.pyx``; ``kvconductor.schema.QUERY_FIELDS`` is the declaration both are tied to
# (tests/test_shapes.py).
cdef enum:
    FIELD_UNKNOWN = 0
    FIELD_MODEL = 1
    FIELD_BLOCK_SIZE = 2
    FIELD_TOKEN_IDS = 3
    FIELD_BLOCK_HASHES = 4
    FIELD_TENANT = 5
    FIELD_LORA = 6
    FIELD_TOP_K = 7             # extension (docs/api.md, "top_k and instances")
    FIELD_INSTANCES = 8         # extension
    FIELD_FRESHNESS = 9         # extension (docs/api.md, "freshness")
    FIELD_CACHE_SALT = 10       # extension (docs/api.md, "Extra keys"): only seen here,
    FIELD_MM_INPUTS = 11        # read by kvconductor.extrakeys when present
