"""Index dump: ``GET /debug/dump`` writes it, ``kv-conductor load-dump`` and
``--load-dump`` read it back (format: docs/dump.md).

A dump is a sequence of msgpack ``bin`` objects, each holding one msgpack-encoded
record (a map with a ``"t"`` key, except the header). Block tables travel as raw
little-endian integer columns, at most :data:`CHUNK_ROWS` rows per record.

The snapshot is taken on the ingest thread (:func:`snapshot`): every index and the
registry at one instant, with no event applied in between; the export copies the
structures into flat arrays (about 40 bytes per block), which are then encoded and
streamed record by record without holding the ingest thread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import struct
import sys
import time
from array import array
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, TypedDict, cast

import msgspec
import xxhash

import kvconductor
from kvconductor.keys import Medium, WorkerKey
from kvconductor.predict import is_predicted
from kvconductor.schema import RegisterRequest, StoreOnly
from kvconductor.state.protocols import JSONObject, NoSubscriptions

if TYPE_CHECKING:
    from kvconductor.state.conductor import Conductor
    from kvconductor.state.registry import EndpointInfo, WorkerEntry

FORMAT = "kvconductor-dump"
#: The version this kvconductor writes; it reads :data:`READS`.
VERSION = 2
READS = (1, 2)
#: Rows per block-table record.
CHUNK_ROWS = 65536
#: Bytes a header record may have (:func:`header`; a few dozen in practice).
HEADER_MAX = 1 << 16

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode
_BIN32 = 0xC6
_LE = sys.byteorder == "little"

#: The core's ``(kind, rows)`` tables of an index, in dump order, with their columns and
#: typecodes: HBM node table, HBM member table, CPU rows, Disk rows.
_TABLES: dict[str, tuple[tuple[str, str], ...]] = {
    "hbm_nodes": (("parents", "I"), ("locals", "Q")),
    "hbm_members": (("node", "I"), ("worker", "I"), ("ehash", "Q")),
    "cpu": (("worker", "I"), ("ehash", "Q"), ("local", "Q"), ("parent", "Q"), ("has_parent", "B")),
    "disk": (
        ("worker", "I"),
        ("ehash", "Q"),
        ("local", "Q"),
        ("parent", "Q"),
        ("has_parent", "B"),
    ),
}


class IndexSnapshot(TypedDict):
    """One index of a :func:`snapshot`: its workers, block tables (by ``_TABLES`` name:
    the core's exported columns) and two-phase records."""

    model: str
    tenant: str
    workers: list[list[str | int]]
    tables: dict[str, tuple[array, ...]]
    lora_seeds: list[int]
    records: list[list[int | float | None]]
    waits: list[list[int | float]]


class Snapshot(TypedDict):
    """The state at one instant (:func:`snapshot`), what :func:`encode` writes."""

    sources: list[JSONObject]
    registrations: list[JSONObject]
    indexes: list[IndexSnapshot]


# -- writing ------------------------------------------------------------------------------
def _registration(entry: WorkerEntry, ep: EndpointInfo) -> JSONObject:
    """The ``POST /register`` body that recreates one registered DP
    (:func:`registration_request`; ``engine_url`` only when it has one)."""
    doc: JSONObject = msgspec.to_builtins(registration_request(entry, ep))
    if ep.engine_url is None:
        del doc["engine_url"]
    return doc


def registration_request(entry: WorkerEntry, ep: EndpointInfo) -> RegisterRequest:
    """The ``POST /register`` request that recreates one registered DP.

    A legacy ``endpoint`` is kept only by cluster pools (it decides ``is_pool``); any
    other was stored as the three media on its URL, which registers the same way (HBM-IP
    index included). A node pool keeps its CPU/Disk ``medium_endpoints``."""
    meds = dict(ep.medium_endpoints)
    endpoint = None
    if ep.is_pool and not ep.node_pool and ep.sources:
        endpoint, meds = ep.sources[0][0], {}
    req = RegisterRequest(
        instance_id=entry.instance_id,
        engine_type=ep.engine_type,
        modelname=ep.model_name,
        block_size=ep.block_size,
        dp_rank=ep.dp_rank,
        medium_endpoints=meds or None,
        endpoint=endpoint,
        store_backend=ep.store_backend,
        replay_endpoint=ep.replay_endpoint,
        tenant_id=ep.tenant_id,
        node_id=ep.node_id,
        store_only=(
            None
            if ep.store_only is None
            else StoreOnly(ttl_secs=ep.store_only[0], capacity=ep.store_only[1])
        ),
        shared_store=ep.shared_store or None,
        lora_name=ep.lora_name,
        engine_url=ep.engine_url,
    )
    return req


def snapshot(conductor: Conductor) -> Snapshot:
    """Registry and every index at one instant. Ingest thread only."""
    now = time.monotonic()
    sources = conductor.subs.cursors()
    regs = [
        _registration(entry, ep)
        for entry in conductor.registry.instances.values()
        for _, ep in sorted(entry.endpoints.items())
    ]
    indexes: list[IndexSnapshot] = []
    for key in sorted(conductor.indexes):
        idx = conductor.indexes[key]
        core = idx.core
        records, waits = core.export_twophase()
        hbm = core.export_hbm()
        indexes.append(
            {
                "model": idx.model,
                "tenant": idx.tenant,
                "workers": [
                    [k.instance_id, k.backend_id, k.dp_rank, int(k.medium)] for k in idx.worker_keys
                ],
                "tables": {
                    "hbm_nodes": hbm[:2],
                    "hbm_members": hbm[2:],
                    "cpu": core.export_tier(1),
                    "disk": core.export_tier(2),
                },
                "lora_seeds": sorted(conductor.lora_seeds.get(key, ())),
                "records": [[k, h, loc, p, now - t] for k, h, loc, p, t in records],
                "waits": [[h, w, now - t] for h, w, t in waits],
            }
        )
    return {"sources": sources, "registrations": regs, "indexes": indexes}


def _le(a: array) -> bytes:
    if not _LE and a.itemsize > 1:
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def _frame(record: object) -> bytes:
    payload = _encode(record)
    return struct.pack(">BI", _BIN32, len(payload)) + payload


def encode(snap: Snapshot, counter: int | None = None) -> Iterator[bytes]:
    """The dump of a :func:`snapshot`, one framed record at a time; the end record
    carries the XXH3-64 of every byte before it. ``counter``: the snapshot counter of a
    snapshot directory, kept in the header (:mod:`kvconductor.state.snapshot`)."""
    h = xxhash.xxh3_64()
    for frame in _frames(snap, counter):
        h.update(frame)
        yield frame
    yield _frame(
        {
            "t": "end",
            "sources": len(snap.get("sources", ())),
            "registrations": len(snap["registrations"]),
            "indexes": len(snap["indexes"]),
            "checksum": h.intdigest(),
        }
    )


def _frames(snap: Snapshot, counter: int | None = None) -> Iterator[bytes]:
    header: JSONObject = {
        "format": FORMAT,
        "version": VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "kvconductor": kvconductor.__version__,
    }
    if counter is not None:
        header["counter"] = counter
    yield _frame(header)
    for src in snap.get("sources", ()):
        yield _frame({"t": "source", **src})
    for reg in snap["registrations"]:
        yield _frame({"t": "registration", "request": reg})
    for ix in snap["indexes"]:
        yield _frame(
            {
                "t": "index",
                "model": ix["model"],
                "tenant": ix["tenant"],
                "workers": ix["workers"],
                "lora_seeds": ix.get("lora_seeds", []),
            }
        )
        counts: dict[str, int] = {}
        for name, cols in _TABLES.items():
            arrays = ix["tables"][name]
            n = len(arrays[0])
            counts[name] = n
            for lo in range(0, n, CHUNK_ROWS):
                rec: dict[str, str | bytes] = {"t": name}
                for (col, _), a in zip(cols, arrays, strict=True):
                    rec[col] = _le(a[lo : lo + CHUNK_ROWS])
                yield _frame(rec)
        for lo in range(0, max(len(ix["records"]), len(ix["waits"])), CHUNK_ROWS):
            yield _frame(
                {
                    "t": "twophase",
                    "records": ix["records"][lo : lo + CHUNK_ROWS],
                    "waits": ix["waits"][lo : lo + CHUNK_ROWS],
                }
            )
        counts["records"] = len(ix["records"])
        counts["waits"] = len(ix["waits"])
        yield _frame({"t": "index_end", **counts})


def write_dump(conductor: Conductor) -> Iterator[bytes]:
    """The dump of ``conductor``, snapshot on its ingest thread (call from another thread)."""
    return encode(conductor.call(snapshot, conductor))


# -- reading ------------------------------------------------------------------------------
class _Digest:
    """The running XXH3-64 of the frames a :func:`_records` walk has yielded."""

    def __init__(self) -> None:
        self.h = xxhash.xxh3_64()
        #: The digest of every frame before the one just yielded.
        self.before = self.h.intdigest()


def _records(chunks: Iterable[bytes], digest: _Digest | None = None) -> Iterator[object]:
    """Decode the framed records of ``chunks`` (bytes of any split), feeding each
    frame to ``digest``. A record is whatever the msgpack decoded: its readers check it
    is a map (``isinstance(rec, dict)``) and convert each value they read."""
    buf = bytearray()
    for chunk in chunks:
        buf += chunk
        pos = 0
        while len(buf) - pos >= 5:
            tag, size = struct.unpack_from(">BI", buf, pos)
            if tag != _BIN32:
                raise ValueError(f"not a kvconductor dump: byte {tag:#04x} where a record starts")
            if len(buf) - pos - 5 < size:
                break
            frame = memoryview(buf)[pos : pos + 5 + size]
            try:
                rec = _decode(frame[5:])
            except msgspec.DecodeError as ex:
                raise ValueError(f"corrupt dump record: {ex}") from None
            finally:
                if digest is not None:
                    digest.before = digest.h.intdigest()
                    digest.h.update(frame)
                frame.release()
            yield rec
            pos += 5 + size
        del buf[:pos]
    if buf:
        raise ValueError("truncated dump: the input ends inside a record")


def _column(raw: object, typecode: str, name: str) -> array:
    if not isinstance(raw, bytes):
        raise ValueError(f"dump record {name}: column is not raw bytes")
    a = array(typecode)
    if len(raw) % a.itemsize:
        raise ValueError(f"dump record {name}: column length is not a multiple of {a.itemsize}")
    a.frombytes(raw)
    if not _LE and a.itemsize > 1:
        a.byteswap()
    return a


def _check_header(rec: object) -> int:
    """The version of a header record, or ``ValueError``."""
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise ValueError("not a kvconductor dump: missing the kvconductor-dump header")
    version = rec.get("version")
    if version not in READS:
        raise ValueError(
            f"unsupported dump version {version!r}: this kvconductor reads versions "
            + " and ".join(str(v) for v in READS)
        )
    return int(version)


def header(path: str) -> JSONObject:
    """The header record of the dump at ``path``, reading only its first record (at most
    :data:`HEADER_MAX` bytes); ``ValueError`` if it is not a dump this kvconductor reads,
    ``OSError``. It checks nothing else: :func:`verify` does."""
    with open(path, "rb") as f:
        head = f.read(5)
        if len(head) < 5 or head[0] != _BIN32:
            raise ValueError("not a kvconductor dump: no header record")
        (size,) = struct.unpack_from(">I", head, 1)
        if size > HEADER_MAX:
            raise ValueError(f"not a kvconductor dump: a header record of {size} bytes")
        payload = f.read(size)
    if len(payload) < size:
        raise ValueError("truncated dump: the input ends inside a record")
    try:
        rec = _decode(payload)
    except msgspec.DecodeError as ex:
        raise ValueError(f"corrupt dump record: {ex}") from None
    _check_header(rec)
    return cast(JSONObject, rec)  # a map (checked), of msgpack scalars


def _check_end(rec: dict, version: int, digest: _Digest, counts: dict[str, int]) -> None:
    """The end record: its counts are what was read, its checksum (version 2) that of
    every byte before it."""
    if version >= 2 and rec.get("checksum") != digest.before:
        raise ValueError(
            "corrupt dump: checksum mismatch (the file was changed or damaged after it was written)"
        )
    got = {k: rec.get(k) for k in counts}
    if version == 1:
        got["sources"] = counts.get("sources")
    if got != counts:
        raise ValueError(f"dump is inconsistent: read {counts}, its end record says {got}")


def _open(chunks: Iterable[bytes]) -> tuple[Iterator[object], _Digest, JSONObject, int]:
    """The records after the header, their running digest, the header and its version."""
    digest = _Digest()
    recs = _records(chunks, digest)
    header = next(recs, None)
    if header is None:
        raise ValueError("not a kvconductor dump: empty input")
    version = _check_header(header)
    return recs, digest, cast(JSONObject, header), version


def verify(chunks: Iterable[bytes]) -> JSONObject:
    """Walk a whole dump without loading it: header, framing, counts and (version 2)
    checksum. Returns the header; ``ValueError`` naming the problem."""
    recs, digest, header, version = _open(chunks)
    counts = {"sources": 0, "registrations": 0, "indexes": 0}
    kinds = {"source": "sources", "registration": "registrations", "index": "indexes"}
    for r in recs:
        rec = r if isinstance(r, dict) else {}
        kind = rec.get("t") if isinstance(r, dict) else None
        if kind == "end":
            _check_end(rec, version, digest, counts)
            if next(recs, None) is not None:
                raise ValueError("dump has records after its end record")
            return header
        if kind in kinds:
            counts[kinds[kind]] += 1
    raise ValueError("truncated dump: no end record")


def _load_index(conductor: Conductor, head: dict, recs: Iterator[object]) -> None:
    """Read one index's records up to its ``index_end`` and restore them."""
    idx = conductor.get_or_create_index(head["model"], head["tenant"])
    ids = array(
        "I",
        [
            idx.worker_id(WorkerKey(str(iid), str(backend), int(dp), Medium(int(medium))))
            for iid, backend, dp, medium in head["workers"]
        ],
    )
    tables = {name: [array(tc) for _, tc in cols] for name, cols in _TABLES.items()}
    records: list = []
    waits: list = []
    for r in recs:
        rec = r if isinstance(r, dict) else {}
        kind = rec.get("t") if isinstance(r, dict) else None
        if kind in _TABLES:
            for (col, tc), out in zip(_TABLES[kind], tables[kind], strict=True):
                out.extend(_column(rec.get(col), tc, kind))
        elif kind == "twophase":
            records += rec["records"]
            waits += rec["waits"]
        elif kind == "index_end":
            got = {name: len(cols[0]) for name, cols in tables.items()}
            got |= {"records": len(records), "waits": len(waits)}
            want = {k: rec.get(k) for k in got}
            if got != want:
                raise ValueError(
                    f"dump of index {head['model']}/{head['tenant']} is inconsistent: "
                    f"read {got}, its end record says {want}"
                )
            break
        else:
            raise ValueError(f"unexpected dump record {kind!r} inside an index")
    else:
        raise ValueError(
            f"truncated dump: index {head['model']}/{head['tenant']} has no end record"
        )

    # PERF: a fresh index numbers the header's workers 0, 1, ... as the dump did: then the
    # worker columns are used as they are (a per-row remap costs ~0.1 s per million rows).
    identity = ids == array("I", range(len(ids)))

    def remap(col: array) -> array:
        if identity:
            if col and max(col) >= len(ids):
                raise ValueError("dump names a worker its index header does not list")
            return col
        try:
            return array("I", [ids[w] for w in col])
        except IndexError:
            raise ValueError("dump names a worker its index header does not list") from None

    core = idx.core
    now = time.monotonic()
    nodes, members = tables["hbm_nodes"], tables["hbm_members"]
    core.restore_hbm(nodes[0], nodes[1], members[0], remap(members[1]), members[2])
    for tier, name in ((1, "cpu"), (2, "disk")):
        cols = tables[name]
        core.restore_tier(tier, remap(cols[0]), *cols[1:])
    core.restore_twophase(
        [(k, h, loc, p, now - age) for k, h, loc, p, age in records],
        [(h, ids[w], now - age) for h, w, age in waits],
    )
    for wid, key in enumerate(idx.worker_keys):
        if is_predicted(key):  # a router's predictions do not outlive their process
            core.clear(wid)
    try:
        core.check_invariants()
    except AssertionError as ex:
        raise ValueError(
            f"dump of index {head['model']}/{head['tenant']} does not form a valid index: {ex}"
        ) from None


def load_dump(conductor: Conductor, chunks: Iterable[bytes]) -> dict[str, int]:
    """Load a dump into ``conductor`` (ingest thread, or before it starts serving):
    the sources' sequence cursors (each subscription the registrations open resumes
    from its cursor: its replay starts there), registrations through
    :meth:`Conductor.register`, then each index restored into a fresh index. A
    registration the current flags refuse or that cannot be opened now is skipped
    (:mod:`kvconductor.state.restore`: one WARN, a count) and its blocks dropped. Returns
    ``{"registrations": n, "indexes": k, "sources": s, "skipped": m}`` (``n`` the
    registration records read, ``m`` of them skipped). ``ValueError`` naming the
    problem for an unknown format or version, a truncated, corrupt or inconsistent dump;
    the conductor may then hold part of it (:func:`verify` first to avoid that)."""
    from kvconductor.state import restore

    recs, digest, _, version = _open(chunks)
    counts = {"sources": 0, "registrations": 0, "indexes": 0}
    skipped: list[restore.Skipped] = []
    resume = conductor.subs.resume
    try:
        for r in recs:
            rec = r if isinstance(r, dict) else {}
            kind = rec.get("t") if isinstance(r, dict) else None
            if kind == "source":
                src = (str(rec["instance_id"]), int(rec["dp_rank"]), str(rec["url"]))
                resume[src] = (
                    int(rec["last_seq"]),
                    int(rec["digest"]),
                    int(rec.get("fence", 0)),
                )
                counts["sources"] += 1
            elif kind == "registration":
                restore.register(conductor, rec["request"], skipped)
                counts["registrations"] += 1
            elif kind == "index":
                key = (rec["model"], rec["tenant"])
                old = conductor.indexes.get(key)
                if old is not None and not old.is_empty():
                    raise ValueError(f"index {key[0]}/{key[1]} is not empty: cannot load into it")
                _load_index(conductor, rec, recs)
                for seed in rec.get("lora_seeds", ()):
                    conductor.note_lora(key[0], key[1], int(seed))
                counts["indexes"] += 1
            elif kind == "end":
                _check_end(rec, version, digest, counts)
                if next(recs, None) is not None:
                    raise ValueError("dump has records after its end record")
                restore.drop_skipped(conductor, skipped)
                # store-only DPs' restored CPU/Disk blocks: under their bound from now on
                conductor.subs.seed_store_only()
                return {**counts, "skipped": len(skipped)}
            else:
                raise ValueError(f"unexpected dump record {kind!r}")
    finally:
        resume.clear()  # cursors of sources no registration reopened
    raise ValueError("truncated dump: no end record")


# -- kv-conductor load-dump ---------------------------------------------------------------
#: Subscriptions for verification: registrations open no sockets (``load-dump``, tests).
_NoSubscriptions = NoSubscriptions


def file_chunks(path: str, size: int = 1 << 20) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk


def load_file(path: str) -> dict[str, object]:
    """Load the dump at ``path`` into an in-process conductor without sockets; returns
    ``{"loaded": ..., "workers": [...], "indexer": [per-index /workers summaries]}``."""
    from kvconductor.state.conductor import Conductor, ConductorConfig

    verify(file_chunks(path))
    conductor = Conductor(
        ConductorConfig(maintenance_interval=3600), subscriptions=_NoSubscriptions
    )
    conductor.start()
    try:
        loaded = conductor.call(load_dump, conductor, file_chunks(path), timeout=None)
        workers = conductor.call(conductor.workers)
    finally:
        conductor.stop()
    return {"loaded": loaded, "workers": workers["workers"], "indexer": workers["indexer"]}


def fetch(url: str, path: str, api_key: str | None) -> None:
    """Download ``url``'s ``GET /debug/dump`` into ``path`` (streamed)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.stream(
            "GET", url.rstrip("/") + "/debug/dump", headers=headers, timeout=60.0
        ) as r:
            if r.status_code != 200:
                raise ValueError(f"GET {r.url} answered {r.status_code}: {r.read()[:200]!r}")
            with open(path, "wb") as f:
                for chunk in r.iter_bytes():
                    f.write(chunk)
    except httpx.HTTPError as ex:
        raise ValueError(f"cannot fetch the dump from {url}: {ex}") from None


def main(argv: list[str]) -> int:
    """``kv-conductor load-dump FILE [--url URL]``: (with ``--url``, first download the
    running service's dump into FILE) load FILE in-process (no sockets) and print the
    per-index ``/workers`` counts as JSON; exit 1 with one line on stderr if it is bad."""
    import os

    parser = argparse.ArgumentParser(
        prog="kv-conductor load-dump",
        description="Load a GET /debug/dump file into an in-process index (no sockets) "
        "and print the per-index /workers counts as JSON.",
    )
    parser.add_argument("file", help="dump file (the body of GET /debug/dump)")
    parser.add_argument(
        "--url",
        help="first download the dump of the service at URL (http://HOST:PORT) into FILE",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("KV_CONDUCTOR_API_KEY"),
        help="bearer token for --url (default: env KV_CONDUCTOR_API_KEY)",
    )
    args = parser.parse_args(argv)
    try:
        if args.url:
            fetch(args.url, args.file, args.api_key)
        out = load_file(args.file)
    except (OSError, ValueError) as ex:
        print(f"kv-conductor load-dump: {args.file}: {ex}", file=sys.stderr)
        return 1
    json.dump({"loaded": out["loaded"], "indexer": out["indexer"]}, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
