"""Byte-exact engine publisher fixtures (wire formats: docs/events.md).

* :func:`schema` builds msgspec classes with the exact field order, defaults and
  struct options of a vLLM / SGLang release (array-tagged events until vLLM 0.23 /
  SGLang 0.5.19, maps after), so encoded payloads are byte-identical to what the
  real classes emit (tests/test_vllm.py checks this against hex example payloads).
* :class:`FakePublisher` mimics ``ZmqEventPublisher``: a PUB socket sending
  ``[topic, seq(8B BE), payload]`` (an XPUB, the same on the wire, so that a test can
  wait until a subscription has reached it: ``subscribers``), a ROUTER replay socket answering
  ``[b"", start_seq]`` in the old (``[seq, payload]``) or new
  (``[topic, seq, payload]``) layout, a ring buffer of ``buffer_steps`` batches,
  one thread owning both sockets. ``publish(..., drop=True)`` buffers a batch
  but does not send it live (simulated loss).
* :class:`PoolPublisher`: a plain PUB for pool events (Mooncake tuple, Memcache
  map, YuanRong per-port publishers).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import msgspec
import zmq

TS = 1700000000.5
H1 = 0x1122334455667788
H2 = 0x8877665544332211

# ---------------------------------------------------------------------------------------
# versioned event classes

_STORED_FIELDS = [
    # (name, type, since, required)   required = no default (always on the wire)
    ("block_hashes", list, (0, 9, 0), True),
    ("parent_block_hash", Any, (0, 9, 0), True),
    ("token_ids", list, (0, 9, 0), True),
    ("block_size", int, (0, 9, 0), True),
    ("lora_id", int | None, (0, 9, 0), True),
    ("medium", str | None, (0, 10, 2), True),
    ("lora_name", str | None, (0, 14, 0), True),
    ("extra_keys", Any, (0, 17, 0), False),
    ("group_idx", int | None, (0, 20, 0), False),
    ("kv_cache_spec_kind", str | None, (0, 22, 0), False),
    ("kv_cache_spec_sliding_window", int | None, (0, 22, 0), False),
    ("locality", str | None, (0, 26, 0), False),
    ("ownership", str | None, (0, 29, 0), False),
    ("session_id", str | None, (0, 30, 0), False),
    ("lookahead_token_ids", Any, (0, 33, 0), False),
]
_REMOVED_FIELDS = [
    ("block_hashes", list, (0, 9, 0), True),
    ("medium", str | None, (0, 10, 2), True),
    ("group_idx", int | None, (0, 20, 0), False),
    ("locality", str | None, (0, 26, 0), False),
    ("ownership", str | None, (0, 29, 0), False),
]
# SGLang (kv_events.py): medium (default None) from 0.5.9; maps from 0.5.20.
_SGL_STORED_FIELDS = [
    ("block_hashes", list, (0, 4, 6), True),
    ("parent_block_hash", Any, (0, 4, 6), True),
    ("token_ids", list, (0, 4, 6), True),
    ("block_size", int, (0, 4, 6), True),
    ("lora_id", int | None, (0, 4, 6), True),
    ("medium", str | None, (0, 5, 9), False),
    ("cache_salt", str | None, (0, 5, 20), False),
    ("session_id", str | None, (0, 5, 20), False),
    ("lora_name", str | None, (0, 5, 22), False),
]
_SGL_REMOVED_FIELDS = [
    ("block_hashes", list, (0, 4, 6), True),
    ("medium", str | None, (0, 5, 9), False),
]


def _vt(v: str) -> tuple[int, int, int]:
    parts = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in v.split(".")[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


class Schema:
    """Event classes and encoder of one engine release."""

    def __init__(self, engine: str, version: str) -> None:
        v = _vt(version)
        self.engine, self.version = engine, version
        if engine == "vllm":
            array_events = v < (0, 24, 0)
            has_dp = v >= (0, 9, 1)
            sf, rf = _STORED_FIELDS, _REMOVED_FIELDS
        elif engine == "sglang":
            array_events = v < (0, 5, 20)
            has_dp = v >= (0, 4, 7)
            sf, rf = _SGL_STORED_FIELDS, _SGL_REMOVED_FIELDS
        else:
            raise ValueError(engine)
        self.array_events = array_events
        self.has_dp = has_dp
        opts = {"omit_defaults": True, "gc": False, "tag": True, "array_like": array_events}
        base = msgspec.defstruct("KVCacheEvent", [], **opts)

        def fields(table):
            out = []
            for name, typ, since, required in table:
                if v < since:
                    continue
                out.append((name, typ) if required else (name, typ, None))
            return out

        self.stored_fields = [f[0] for f in fields(sf)]
        self.removed_fields = [f[0] for f in fields(rf)]
        self.BlockStored = msgspec.defstruct("BlockStored", fields(sf), bases=(base,))
        self.BlockRemoved = msgspec.defstruct("BlockRemoved", fields(rf), bases=(base,))
        self.AllBlocksCleared = msgspec.defstruct("AllBlocksCleared", [], bases=(base,))
        bopts = {"array_like": True, "omit_defaults": True, "gc": False}
        bf = [("ts", float), ("events", list)]
        if has_dp:
            bf.append(("data_parallel_rank", int | None, None))
        self.Batch = msgspec.defstruct("KVEventBatch", bf, **bopts)
        self.encoder = msgspec.msgpack.Encoder()

    def stored(self, block_hashes, parent_block_hash, token_ids, block_size, **kw):
        """A BlockStored; required fields not given default to nil (as the engines send them)."""
        args = {
            "block_hashes": block_hashes,
            "parent_block_hash": parent_block_hash,
            "token_ids": token_ids,
            "block_size": block_size,
        }
        for name in self.stored_fields:
            if name in kw:
                args[name] = kw.pop(name)
            elif name not in args:
                args[name] = None
        if kw:
            raise TypeError(f"{self.engine} {self.version} BlockStored has no {sorted(kw)}")
        return self.BlockStored(**args)

    def removed(self, block_hashes, **kw):
        args = {"block_hashes": block_hashes}
        for name in self.removed_fields:
            if name in kw:
                args[name] = kw.pop(name)
            elif name not in args:
                args[name] = None
        if kw:
            raise TypeError(f"{self.engine} {self.version} BlockRemoved has no {sorted(kw)}")
        return self.BlockRemoved(**args)

    def cleared(self):
        return self.AllBlocksCleared()

    def batch(self, events, dp: int | None = 0, ts: float = TS) -> bytes:
        if self.has_dp:
            return self.encoder.encode(self.Batch(ts, list(events), dp))
        return self.encoder.encode(self.Batch(ts, list(events)))


def schema(engine: str, version: str) -> Schema:
    return Schema(engine, version)


def hexbytes(s: str) -> bytes:
    """Spec hex with ``"..."`` ASCII runs: ``'a4 "type" c0'``."""
    out = bytearray()
    chunks = s.split('"')
    for i, c in enumerate(chunks):
        if i % 2:
            out += c.encode()
        else:
            out += bytes.fromhex("".join(c.split()))
    return bytes(out)


# ---------------------------------------------------------------------------------------
# sockets


def free_tcp_port() -> int:
    """A loopback port free right now (a plain socket: closed at once, unlike ZeroMQ's,
    which its reaper thread closes later)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bind_retry(sock, url: str, deadline: float = 15.0) -> None:
    end = time.monotonic() + deadline
    while True:
        try:
            sock.bind(url)
            return
        except zmq.ZMQError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


class FakePublisher:
    """vLLM's ZmqEventPublisher, in miniature (one thread owns PUB and ROUTER)."""

    def __init__(
        self,
        port: int | None = None,
        replay_port: int | None = None,
        *,
        topic: bytes = b"",
        replay: bool = True,
        layout: str = "new",
        buffer_steps: int = 10_000,
        start_seq: int = 0,
        sndhwm: int = 0,
        host: str = "127.0.0.1",
    ) -> None:
        self.ctx = zmq.Context.instance()
        #: The loopback address it binds (``127.0.0.2`` stands for a second node).
        self.host = host
        self.topic = topic
        self.layout = layout
        self.buffer_steps = buffer_steps
        self.seq = start_seq
        self.sndhwm = sndhwm
        self.port = port or 0
        self.replay_port = (replay_port or 0) if replay else None
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []
        #: Subscriptions that reached the PUB (from then on nothing it sends is dropped).
        self.subscribers = 0
        self._q: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._err: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-publisher")
        self._thread.start()
        # Longer than _bind_retry's deadline, so that a port still taken reports its error.
        if not self._ready.wait(20) or self._err:
            raise RuntimeError(f"publisher failed to start: {self._err!r}")

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def replay_url(self) -> str | None:
        return None if self.replay_port is None else f"tcp://{self.host}:{self.replay_port}"

    def _run(self) -> None:
        try:
            pub = self.ctx.socket(zmq.XPUB)
            pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, self.sndhwm)
            if self.port:
                _bind_retry(pub, f"tcp://{self.host}:{self.port}")
            else:
                self.port = pub.bind_to_random_port(f"tcp://{self.host}")
            router = None
            if self.replay_port is not None:
                router = self.ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.setsockopt(zmq.SNDHWM, 0)
                if self.replay_port:
                    _bind_retry(router, f"tcp://{self.host}:{self.replay_port}")
                else:
                    self.replay_port = router.bind_to_random_port(f"tcp://{self.host}")
        except BaseException as ex:
            self._err = ex
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(pub, zmq.POLLIN)
        if router is not None:
            poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(0))
                if pub in ready:
                    while pub.poll(0):
                        if pub.recv()[:1] == b"\x01":
                            self.subscribers += 1
                if router is not None and router in ready:
                    self._serve(router)
                try:
                    item = self._q.get(timeout=0.005)
                except queue.Empty:
                    self._idle.set()
                    continue
                if item is None:
                    break
                payload, drop, done = item
                seq = self.seq
                self.seq += 1
                seq_b = seq.to_bytes(8, "big")
                if not drop:
                    pub.send_multipart([self.topic, seq_b, payload])
                self.buffer.append((seq, payload))
                if len(self.buffer) > self.buffer_steps:
                    del self.buffer[0]
                done.set()
        finally:
            pub.close(linger=0)
            if router is not None:
                router.close(linger=0)

    def _serve(self, router) -> None:
        frames = router.recv_multipart()
        if len(frames) != 3:
            return  # "Invalid replay request": no reply
        ident, _, start_b = frames
        start = int.from_bytes(start_b, "big")
        self.replay_requests.append(start)
        for seq, payload in list(self.buffer):
            if seq >= start:
                if self.layout == "new":
                    router.send_multipart([ident, b"", self.topic, seq.to_bytes(8, "big"), payload])
                else:
                    router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
        if self.layout == "new":
            router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])
        else:
            router.send_multipart([ident, b"", b"\xff" * 8, b""])

    def wait_subscribed(self, n: int = 1, timeout: float = 20.0) -> None:
        """Until ``n`` subscriptions have reached the PUB: from then on the subscriber
        gets everything published (before, the PUB drops it: the slow joiner)."""
        wait_until(lambda: self.subscribers >= n, timeout, msg=f"{n} subscription(s) at the PUB")

    def publish(self, payload: bytes, drop: bool = False, wait: bool = True) -> None:
        self._idle.clear()
        done = threading.Event()
        self._q.put((payload, drop, done))
        if wait:
            done.wait(5)

    def stop(self) -> None:
        self._stop.set()
        self._q.put(None)
        self._thread.join(5)


class PoolPublisher:
    """A bare PUB for pool events: ``[topic, seq, payload]`` with its own seq counter (an
    XPUB, the same on the wire, for :meth:`wait_subscribed`)."""

    def __init__(
        self, port: int | None = None, topic: bytes = b"", host: str = "127.0.0.1"
    ) -> None:
        self.ctx = zmq.Context.instance()
        self.host = host
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        if port:
            _bind_retry(self.sock, f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.topic = topic
        self.seq = 0
        self.subscribers = 0
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def wait_subscribed(self, n: int = 1, timeout: float = 20.0) -> None:
        """Until ``n`` subscriptions have reached the PUB (see FakePublisher's)."""

        def count() -> bool:
            with self._lock:
                while self.sock.poll(0):
                    if self.sock.recv()[:1] == b"\x01":
                        self.subscribers += 1
            return self.subscribers >= n

        wait_until(count, timeout, msg=f"{n} subscription(s) at the PUB")

    def publish(self, payload: bytes) -> None:
        with self._lock:
            self.sock.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
            self.seq += 1

    def stop(self) -> None:
        self.sock.close(linger=0)


def mooncake_tuple(events: list[dict], dp: int = 0, ts_ms: int = 1782281033484) -> bytes:
    return msgspec.msgpack.encode([ts_ms, events, dp])


def memcache_map(events: list[dict]) -> bytes:
    return msgspec.msgpack.encode({"events": events})


def wait_until(cond, timeout: float = 20.0, interval: float = 0.02, msg: str = "condition"):
    """Poll ``cond()`` until truthy; return its value or raise AssertionError."""
    end = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {msg}")
        time.sleep(interval)


# ---------------------------------------------------------------------------------------
# a tiny conductor for the subscriber/applier tests


class InstanceInfo:
    def __init__(self, model: str, tenant: str, block_size: int, store_backend: str = "Mooncake"):
        self.model = model
        self.tenant = tenant
        self.block_size = block_size
        self.store_backend = store_backend


class FakeConductor:
    """The callbacks the SubscriptionManager uses, over a dict of Index objects."""

    def __init__(self, impl: str | None = None) -> None:
        self.impl = impl
        self.indexes: dict = {}
        self.ip_index: dict[str, list[tuple[str, int]]] = {}
        self.instances: dict[str, InstanceInfo] = {}
        self.lora_seeds: dict[tuple[str, str], frozenset[int]] = {}

    def note_lora(self, model: str, tenant: str, seed: int) -> None:
        key = (model, tenant)
        self.lora_seeds[key] = self.lora_seeds.get(key, frozenset()) | {seed}

    def get_or_create_index(self, model: str, tenant: str):
        from kvconductor.index import Index

        idx = self.indexes.get((model, tenant))
        if idx is None:
            idx = self.indexes[(model, tenant)] = Index(model, tenant, impl=self.impl)
        return idx

    def get_index(self, model: str, tenant: str):
        return self.indexes.get((model, tenant))

    def hbm_ip_lookup(self, ip: str) -> list[tuple[str, int]]:
        return list(self.ip_index.get(ip, ()))

    def instance_info(self, instance_id: str):
        return self.instances.get(instance_id)


def hits(index, tokens, block_size: int, seed: int = 1337) -> dict:
    """{(instance, dp): (npu, cpu, disk)} of a token query."""
    if index is None:
        return {}
    return {
        (h.instance_id, h.dp_rank): (h.npu_blocks, h.cpu_blocks, h.disk_blocks)
        for h in index.query(tokens, block_size, seed).hits
    }
