from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from typing_extensions import disjoint_base

from kvconductor._index import MatchRows

def encode_result(
    hits: Sequence[tuple[str, int, int, int, int]], tenant: str, block_size: int, msgpack: bool
) -> bytes: ...
def encode_error(message: str, msgpack: bool) -> bytes: ...

@disjoint_base
class GroupNames:
    """The pre-encoded names of an index's (instance, DP) groups."""
    @property
    def keys(self) -> list[tuple[str, int]]: ...
    @property
    def dp_keys(self) -> list[str]: ...
    def __len__(self) -> int: ...
    def nbytes(self) -> int: ...
    def add(self, instance_id: str, dp_rank: int) -> int: ...
    def instances_mask(self, instance_ids: Iterable[str]) -> bytes: ...
    def instances_rank(self, instance_ids: Iterable[str]) -> array[int]: ...

FRESH_STATES: tuple[str, ...]

def encode_rows(
    rows: MatchRows,
    names: GroupNames,
    tenant: str,
    block_size: int,
    msgpack: bool,
    fresh: tuple[list[Any], float, bytes] | None = None,
) -> bytes: ...
def encode_answer(
    result: Any,
    tenant: str,
    block_size: int,
    msgpack: bool,
    fresh: tuple[list[Any], float, bytes] | None = None,
) -> bytes: ...
