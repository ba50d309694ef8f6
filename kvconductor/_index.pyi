from array import array
from collections.abc import Sequence
from typing import Any

from typing_extensions import disjoint_base

@disjoint_base
class CoreIndex:
    """Index core of one (model, tenant). One writer thread; concurrent readers."""
    def __init__(self) -> None: ...
    def set_worker(self, worker: int, group: int, tier: int) -> None: ...
    def store(
        self,
        worker: int,
        parent: int | None,
        engine_hashes: Sequence[int],
        local_hashes: Sequence[int],
    ) -> int: ...
    def store_tokens(
        self,
        worker: int,
        parent: int | None,
        engine_hashes: Sequence[int],
        tokens: Any,
        block_size: int,
        seed: int = 1337,
    ) -> int: ...
    def remove(self, worker: int, engine_hashes: Sequence[int]) -> int: ...
    def clear(self, worker: int) -> int: ...
    def offload(
        self,
        engine_hashes: Sequence[int],
        local_hashes: Sequence[int],
        parent: int | None,
        now: float,
    ) -> int: ...
    def pool_store(
        self, worker: int, engine_hashes: Sequence[int], now: float
    ) -> tuple[int, int]: ...
    def evict(self, worker: int, engine_hashes: Sequence[int]) -> int: ...
    def sweep(
        self, now: float, pending_ttl: float, content_ttl: float, offload_ttl: float
    ) -> int: ...
    def match(self, local_hashes: Sequence[int]) -> list[tuple[int, int, int, int]]: ...
    def match_tokens(
        self, tokens: Any, block_size: int, seed: int = 1337
    ) -> list[tuple[int, int, int, int]]: ...
    def worker_blocks(self, worker: int) -> int: ...
    def worker_hashes(self, worker: int) -> array: ...
    def parent_of(self, worker: int, h: int) -> int | None: ...
    def stats(self) -> dict[str, int]: ...
    def check_invariants(self) -> None: ...
    def _corrupt_for_test(self, kind: str) -> None: ...
    def export_hbm(self) -> tuple[array, array, array, array, array]: ...
    def restore_hbm(
        self,
        parents: Sequence[int],
        local_hashes: Sequence[int],
        node: Sequence[int],
        worker: Sequence[int],
        ehash: Sequence[int],
    ) -> int: ...
    def export_tier(self, tier: int) -> tuple[array, array, array, array, array]: ...
    def restore_tier(
        self,
        tier: int,
        worker: Sequence[int],
        ehash: Sequence[int],
        local_hashes: Sequence[int],
        parent: Sequence[int],
        has_parent: Sequence[int],
    ) -> int: ...
    def export_twophase(
        self,
    ) -> tuple[list[tuple[int, int, int, int | None, float]], list[tuple[int, int, float]]]: ...
    def restore_twophase(
        self,
        records: Sequence[tuple[int, int, int, int | None, float]],
        waits: Sequence[tuple[int, int, float]],
    ) -> None: ...
