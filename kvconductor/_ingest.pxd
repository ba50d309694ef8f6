# cython: language_level=3
"""Compiled fast path of vLLM / SGLang ``KVEventBatch`` ingest (HBM subscriptions)."""
from libc.stdint cimport uint8_t, uint32_t, uint64_t

from kvconductor._index cimport BatchOp
from kvconductor._readers cimport wcur

cdef enum:
    LORA_MAX = 16               # distinct LoRA adapters per batch on the fast path

cdef struct EvRec:
    size_t off                  # first hash of the event in FastBatch.hs / .loc
    size_t n                    # blocks (STORE: stored count, EVICT: hashes)
    uint64_t parent             # STORE: parent engine hash (when has_parent)
    uint8_t kind                # OP_STORE / OP_EVICT / OP_CLEAR (no record for no-ops)
    uint8_t has_parent
    uint8_t ehash_locals          # STORE without tokens: engine hashes double as local hashes

cdef struct Ev:                 # the event being parsed
    size_t nh                   # its engine hashes, at FastBatch.hs[hs_used:hs_used + nh]
    size_t ntok                 # its token ids, at FastBatch.tok[0:ntok]
    uint64_t parent
    uint64_t bs                 # block_size (nil/absent: 0)
    uint64_t seed               # token hashing seed (LoRA: lora_seed(name))
    uint32_t seen               # bit per field id already read (duplicate keys)
    uint8_t has_parent
    uint8_t kind_rejected       # kv_cache_spec_kind names a non-prefix attention kind
    const uint8_t* xk           # extra_keys: its msgpack value (xkn bytes; 0: nil/absent)
    size_t xkn
    const uint8_t* lora         # lora_name (lora_n bytes; 0: none)
    size_t lora_n
    const uint8_t* salt         # SGLang's cache_salt (salt_n bytes; 0: none or not a str)
    size_t salt_n


cdef class FastBatch:
    cdef uint64_t seed          # base seed of token hashing (LoRA events derive their own)
    cdef uint64_t* hs           # engine hashes of every event, in wire order
    cdef uint64_t* loc          # LocalBlockHashes, parallel to hs
    cdef uint64_t* xd           # extra-key digests of the stored blocks, parallel to hs
    cdef size_t hs_cap
    cdef size_t hs_used
    cdef uint32_t* tok          # token ids of the event being parsed
    cdef size_t tok_cap
    cdef EvRec* recs            # one per event that mutates the index
    cdef BatchOp* ops
    cdef size_t rec_cap
    cdef size_t nrec
    cdef size_t done            # records applied by a partial apply(upto=)
    cdef uint32_t* clear        # worker ids cleared by AllBlocksCleared
    cdef size_t clear_cap
    cdef int flags              # BATCH_* flags of the parsed batch
    cdef long nevents           # events of the parsed batch (-1: nothing parsed)
    cdef long n_size_mismatch   # BlockStored dropped: block_size != registered
    cdef uint64_t bad_bs        # the block_size of the last of them
    cdef long n_kind            # BlockStored dropped: non-prefix attention kind
    cdef uint64_t lora[LORA_MAX]  # distinct LoRA seeds of the stores of the parsed batch
    cdef size_t nlora
    cdef int why                # reason code of the last rejection
    cdef public long long parsed      # batches accepted by parse()
    cdef public long long rejected    # batches parse() left to the Python path

    cdef void _trim(self) noexcept nogil
    cdef int _reserve_hashes(self, size_t need) noexcept nogil
    cdef int _field(self, wcur* c, int fid, Ev* ev) noexcept nogil
    cdef int _event(self, wcur* c, long long reg) noexcept nogil
    cdef int _parse(self, const uint8_t* buf, size_t size, long long reg) noexcept nogil
