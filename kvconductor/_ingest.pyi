from array import array

from typing_extensions import Self, disjoint_base

from kvconductor._index import CoreIndex

HBM_MEDIA: tuple[str, ...]
REJECTED_KINDS: tuple[str, ...]
STORED_POSITIONS: tuple[str | None, ...]
REMOVED_POSITIONS: tuple[str | None, ...]
STORED_KEYS: tuple[str, ...]
REMOVED_KEYS: tuple[str, ...]
CLEARED_KEYS: tuple[str, ...]
POOL_KEYS: tuple[str, ...]
DECLINED_KEYS: tuple[str, ...]
PAYLOAD_UNSURE: int
PAYLOAD_VLLM: int
PAYLOAD_POOL: int
PAYLOAD_VLLM_TAG: int

def array_payload_kind(payload: bytes | bytearray | memoryview, whole: bool = True) -> int: ...
def extra_key_digests(
    raw: bytes | bytearray | memoryview, lora_name: str | None, nblocks: int
) -> array | None: ...

@disjoint_base
class FastBatch:
    """Parse buffer and applier of the vLLM/SGLang HBM ingest fast path (ingest thread only)."""

    parsed: int
    rejected: int
    def __new__(cls, seed: int = ...) -> Self: ...
    def parse(self, payload: bytes | bytearray | memoryview, registered_block_size: int) -> int: ...
    def apply(
        self, core: CoreIndex, hbm_worker: int = -1, clear_workers: object = (), upto: int = -1
    ) -> tuple[int, int, int, int]: ...
    @property
    def nrecords(self) -> int: ...
    @property
    def leading_stores(self) -> int: ...
    @property
    def nhashes(self) -> int: ...
    @property
    def reason(self) -> str: ...
    @property
    def mismatched_block_size(self) -> int: ...
    @property
    def lora_seeds(self) -> tuple[int, ...]: ...
    @property
    def needs_worker(self) -> bool: ...
    @property
    def touches(self) -> bool: ...
    @property
    def has_clear(self) -> bool: ...
    @property
    def size_mismatch(self) -> int: ...
    @property
    def kind_rejected(self) -> int: ...
