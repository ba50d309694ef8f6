"""Worker identity, storage media and store backends (docs/api.md, POST /register)."""

from __future__ import annotations

import enum
from typing import NamedTuple


class Medium(enum.IntEnum):
    """Where a block lives. UNKNOWN is indexed like NPU (docs/api.md, "Medium keys")."""

    NPU = 0
    CPU = 1
    DISK = 2
    UNKNOWN = 3

    @property
    def display(self) -> str:
        return self.name

    @property
    def tier(self) -> int:
        """0 = HBM tree, 1 = CPU tier, 2 = Disk tier."""
        return 0 if self in (Medium.NPU, Medium.UNKNOWN) else int(self)


_MEDIA = {}
for _k in ("npu", "NPU", "gpu", "GPU", "xpu", "XPU", "hbm", "HBM", "device", "DEVICE"):
    _MEDIA[_k] = Medium.NPU
for _k in ("cpu", "CPU", "cpu_pinned", "CPU_PINNED", "host", "HOST", "memory", "MEMORY"):
    _MEDIA[_k] = Medium.CPU
# ``STORAGE``: vLLM's disk/file offloading tier (``MEDIUM_STORAGE``, vLLM >= 0.27);
# ``SHARED_STORAGE``, ``OBJECT_STORE``: llm-d's storage offloading backends.
_DISK_KEYS = ("disk", "DISK", "ssd", "SSD", "nvme", "NVME", "nof_ssd", "dfs", "DFS")
_STORAGE_KEYS = ("storage", "STORAGE", "shared_storage", "SHARED_STORAGE", "object_store")
for _k in (*_DISK_KEYS, *_STORAGE_KEYS, "OBJECT_STORE"):
    _MEDIA[_k] = Medium.DISK


def parse_medium(s: str | None) -> Medium:
    """Parse a medium string with the reference's exact alias table.

    ``None`` and ``""`` give NPU (the default); unknown strings give UNKNOWN.
    """
    if not s:
        return Medium.NPU
    return _MEDIA.get(s, Medium.UNKNOWN)


def is_hbm_key(s: str | None) -> bool:
    """True when ``s`` parses to NPU (GPU/XPU/HBM/... aliases)."""
    return parse_medium(s) is Medium.NPU


class WorkerKey(NamedTuple):
    """(instance_id, backend_id, dp_rank, medium): one holder of blocks."""

    instance_id: str
    backend_id: str
    dp_rank: int
    medium: Medium


class StoreBackend(enum.Enum):
    MOONCAKE = "Mooncake"
    MEMCACHE = "Memcache"
    YUANRONG = "YuanRong"
    UNKNOWN = "Unknown"

    @classmethod
    def parse(cls, s: str | None) -> StoreBackend:
        low = (s or "").lower()
        for b in (cls.MOONCAKE, cls.MEMCACHE, cls.YUANRONG):
            if low == b.value.lower():
                return b
        return cls.UNKNOWN

    @property
    def indexes_hbm_ip(self) -> bool:
        """Every backend's HBM registrations enter the HBM-IP index: the cluster pools of
        Mooncake/Memcache and the node pools of YuanRong/Unknown find their DPs there."""
        return True

    @property
    def is_pool_backend(self) -> bool:
        """A legacy-``endpoint`` registration of this backend is a cluster pool publisher
        (Mooncake, Memcache)."""
        return self in (StoreBackend.MOONCAKE, StoreBackend.MEMCACHE)

    @property
    def has_node_pools(self) -> bool:
        """A CPU/Disk-only registration of this backend is a node pool (YuanRong, Unknown):
        :func:`is_node_pool_registration`."""
        return self in (StoreBackend.YUANRONG, StoreBackend.UNKNOWN)

    @property
    def match_mode(self) -> str:
        """How the backend's pool publishers find workers: ``"ip_only"`` (an event's
        ``backend_id`` names a node, every DP there) for Mooncake/Memcache, ``"none"``
        otherwise. The registration's shape decides in the end: a YuanRong/Unknown node
        pool is ``ip_only`` too (:func:`is_node_pool_registration`)."""
        return "ip_only" if self.is_pool_backend else "none"


def is_node_pool_registration(backend: StoreBackend, medium_keys) -> bool:
    """A YuanRong/Unknown registration whose ``medium_endpoints`` keys name no HBM medium
    and at least one CPU or Disk medium: the CPU/Disk publisher of one node, whose blocks
    belong to every DP registered with an HBM URL on that node (docs/api.md, "Node
    pools"). Keys are judged as sent (a key with an empty URL counts)."""
    if not backend.has_node_pools:
        return False
    lower = False
    for key in medium_keys:
        m = parse_medium(key)
        if m is Medium.NPU:
            return False
        if m is Medium.CPU or m is Medium.DISK:
            lower = True
    return lower


def node_of_backend_id(backend_id: str) -> str:
    """The HBM-IP index key a pool event's ``backend_id`` names (docs/api.md, "Node
    pools"): ``10.0.0.1``, ``10.0.0.1:5558``, ``tcp://10.0.0.1:5558`` -> ``10.0.0.1``;
    ``[::1]:5558``, ``tcp://[::1]:5558`` -> ``::1``; anything else as it is (a bare IPv6
    address, a host name)."""
    rest = backend_id[len("tcp://") :] if backend_id.startswith("tcp://") else backend_id
    if rest.startswith("["):
        end = rest.find("]")
        if end > 1:
            return rest[1:end]
        return rest
    host, sep, port = rest.rpartition(":")
    if sep and host and ":" not in host and port.isascii() and port.isdigit():
        return host
    return rest
