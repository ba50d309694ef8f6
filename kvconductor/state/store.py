"""The state store of ``--state-url`` (docs/operations.md, "Replicas on Valkey"): its
keys, the scripts run in it, the client of its URL, the packing of the log's entries and
a replica's counters of its work with it (:class:`ReplicaStats`).

What a replica does with it is :mod:`kvconductor.state.replica`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from valkey import Valkey

# valkey types every command's reply as sync-or-async: the casts below name what the
# synchronous client this module uses returns.
NS = "kvc:"
#: The stream every replica applies.
LOG = NS + "log"
#: Generation of the store's content: a store found without it was emptied.
GEN = NS + "gen"
#: Hash: the latest snapshot (``id`` log position, ``key``, ``chunks``, ``bytes``,
#: ``gen``, ``time``, ``trimmed`` the position the log was trimmed to).
SNAP = NS + "snap"
SNAP_CHUNK = NS + "snap:"
SNAP_LOCK = NS + "snaplock"
EPOCH = NS + "epoch"
LEASE = NS + "lease:"
#: Sorted set: replica id -> its last heartbeat (ms).
MEMBERS = NS + "replicas"

#: Bytes of a snapshot per chunk key (``SNAP_CHUNK`` + snapshot id + ``:`` + n).
CHUNK_BYTES = 4 << 20

# Leases are taken and renewed only in the generation the replica loaded: a lease taken
# in a store that was emptied (before it is seeded again) or renewed across a re-seed
# would let an owner go on from a cursor the new state does not have.
TAKE_LEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] or redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
local epoch = redis.call('INCR', KEYS[3])
redis.call('SET', KEYS[2], ARGV[2] .. ':' .. epoch, 'PX', ARGV[3])
return epoch
"""
RENEW_LEASE = """
if redis.call('GET', KEYS[2]) == ARGV[3] and redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
RELEASE = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then "
    "return redis.call('DEL', KEYS[1]) else return 0 end"
)
# Record a snapshot and trim the log below the previous one, only if the store is still
# of the generation the snapshot was taken in.
COMMIT_SNAPSHOT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local trim = redis.call('HGET', KEYS[2], 'id') or '0-0'
if ARGV[7] == '1' then trim = '0-0' end
redis.call('HSET', KEYS[2], 'id', ARGV[2], 'key', ARGV[3], 'chunks', ARGV[4],
           'bytes', ARGV[5], 'gen', ARGV[1], 'time', ARGV[6], 'trimmed', trim,
           'floor', ARGV[8])
if trim ~= '0-0' then redis.call('XTRIM', KEYS[3], 'MINID', trim) end
return 1
"""
# A new generation; owner epochs go on above every epoch the seeding replica applied
# (ARGV[2], the new fence floor), so that nothing an owner of the old store appends is
# applied in the new one.
SEED = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX') then
  redis.call('DEL', KEYS[2])
  redis.call('DEL', KEYS[3])
  redis.call('SET', KEYS[4], ARGV[2])
  return 1
end
return 0
"""


def entry_id(eid: str) -> tuple[int, int]:
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)


def text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


SENTINEL_SCHEMES = ("redis+sentinel", "valkey+sentinel")


def connect(url: str, password: str | None = None) -> Valkey:
    """A client of ``url``: ``redis://HOST:PORT/DB``, ``rediss://...``,
    ``unix:///PATH?db=N``, or ``redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/
    SERVICE[/DB]``: the primary the Sentinels name for SERVICE, found again after a
    failover. ``password``: used when the URL carries none."""
    import valkey

    scheme = url.partition("://")[0]
    if scheme in SENTINEL_SCHEMES:
        from valkey.sentinel import Sentinel

        sentinels, service, db, url_password = parse_sentinel_url(url)
        kw = {"socket_timeout": 5.0, "socket_connect_timeout": 2.0}
        return Sentinel(sentinels, sentinel_kwargs=kw, **kw).master_for(
            service, db=db, password=url_password or password, **kw
        )
    # from_url: a password in the URL takes precedence over the keyword
    return valkey.Valkey.from_url(
        url,
        password=password,
        socket_timeout=5.0,
        socket_connect_timeout=2.0,
        health_check_interval=0,
    )


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int, str | None]:
    """(sentinels, service, db, password) of a ``redis+sentinel://`` URL; ``ValueError``
    naming what is wrong."""
    from urllib.parse import unquote

    rest = url.partition("://")[2]
    auth, _, rest = rest.rpartition("@")
    hosts, _, path = rest.partition("/")
    password = unquote(auth.partition(":")[2]) or None if auth else None
    sentinels = []
    for h in hosts.split(","):
        host, _, port = h.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"sentinel address {h!r} is not HOST:PORT")
        sentinels.append((host.strip("[]"), int(port)))
    service, _, db = path.partition("/")
    if not service:
        raise ValueError("the URL names no Sentinel service (redis+sentinel://HOST:PORT/NAME)")
    if db and not db.isdigit():
        raise ValueError(f"database {db!r} is not a number")
    return sentinels, service, int(db or 0), password


def store_errors() -> tuple[type[BaseException], ...]:
    import valkey

    return (valkey.ConnectionError, valkey.TimeoutError, OSError)


def safe_url(url: str) -> str:
    """``url`` with its password (``redis://user:PASSWORD@host``) replaced by ``***``."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def lease_key(key: tuple[str, int, str]) -> str:
    return f"{LEASE}{key[0]}/dp{key[1]}@{key[2]}"


#: Bytes of engine payloads packed into one ``batches`` entry at most.
PACK_BYTES = 1 << 20


def pack(items: list) -> list[dict]:
    """The log entries of a writer round, in order: each HTTP/source entry as it is,
    each run of engine batches as ``batches`` entries of at most :data:`PACK_BYTES`.

    PERF: one entry per batch costs the client ~50 µs to append and every replica as
    much to read (command building and reply parsing in Python); packed, the cost per
    batch is one msgpack item."""
    out: list[dict] = []
    run: list = []
    size = 0
    for fields, _, _, item in items:
        if item is not None:
            run.append(item)
            size += len(item[5])
            if size < PACK_BYTES:
                continue
        if run:
            out.append({"k": "batches", "b": msgspec.msgpack.encode(run)})
            run, size = [], 0
        if fields is not None:
            out.append(fields)
    if run:
        out.append({"k": "batches", "b": msgspec.msgpack.encode(run)})
    return out


@dataclass
class ReplicaStats:
    """Counters of one replica (``/metrics``, ``/workers``)."""

    applied: int = 0
    #: Engine batches in the applied ``batches`` entries.
    batches: int = 0
    appended: int = 0
    append_failures: int = 0
    apply_errors: int = 0
    bootstraps: int = 0
    seeds: int = 0
    snapshots: int = 0
    takeovers: int = 0
    #: Sources given back because this replica held more than its share.
    handed_over: int = 0
    #: The log's newest entry id and length, as last seen by the keeper.
    log_last_id: str = "0-0"
    log_length: int = 0
    replicas: int = 0
