"""The processes the trace replay's ``--server`` mode talks to (:mod:`bench.trace_server`):
a keep-alive HTTP connection, the open-file limits, the services under test (``Service``:
kv-conductor's :class:`Server` here, Dynamo's indexer in :mod:`bench.trace_dynamo_server`)
and the HTTP stack's :class:`Floor`."""

from __future__ import annotations

import http.client
import json
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from bench import trace_replay as tr

ROOT = Path(__file__).resolve().parent.parent
SERVER_BLOCK = 16  # tokens per block on the wire
MODEL = "trace"


def resource_limit() -> int:
    """The hard open-file limit."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


_GONE = (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected)


class Conn:
    """A keep-alive HTTP connection that reconnects once when the server closed it (an idle
    keep-alive connection is closed after a few seconds, as in a paced run's pauses)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def request(self, method: str, path: str, body: bytes | None = None, hdr=None):
        for attempt in (0, 1):
            try:
                self.c.request(method, path, body, hdr or {})
                r = self.c.getresponse()
                return r, r.read()
            except _GONE:
                self.c.close()
                self.c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.c.close()


class RawConn:
    """The load generator's lean keep-alive HTTP/1.1 client: a request's bytes are built once
    (:meth:`prepare`), sent with one ``sendall``; the answer is read with ``recv_into`` into
    a reused buffer and only the status, ``Content-Length`` (or a chunked body) and
    ``Server-Timing`` are parsed. ``http.client`` builds the headers and parses the answer
    with the email parser on every request: on the 2 cores the services share, that client
    CPU was the ceiling of the saturation runs. Reconnects once as :class:`Conn` does."""

    def __init__(self, port: int, size: int = 1 << 17) -> None:
        self.port = port
        self.buf = bytearray(size)
        self.have = 0  # bytes of the next answer already read
        self.sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=60)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.have = s, 0
        return s

    def prepare(self, method: str, path: str, body: bytes = b"", ctype: str = "") -> tuple:
        """A request as ``(head, tail)``: ``head + tail`` is the request; per-request headers
        (``b"x-floor-size: 9\r\n"``) go between the two."""
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
        if ctype:
            head += f"Content-Type: {ctype}\r\n"
        head += f"Content-Length: {len(body)}\r\n"
        return head.encode(), b"\r\n" + body

    def send(self, req: bytes) -> tuple[int, bytes, bytes]:
        """One round trip: ``(status, body, Server-Timing value or b"")``."""
        for attempt in (0, 1):
            s = self.sock or self._connect()
            try:
                s.sendall(req)
                return self._read(s)
            except _GONE:
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def request(self, method: str, path: str, body: bytes = b"", ctype: str = ""):
        head, tail = self.prepare(method, path, body, ctype)
        return self.send(head + tail)

    def _fill(self, s: socket.socket, need: int) -> None:
        """Read until the buffer holds ``need`` bytes."""
        if need > len(self.buf):
            self.buf.extend(bytes(need - len(self.buf) + (1 << 16)))
        mv = memoryview(self.buf)
        while self.have < need:
            n = s.recv_into(mv[self.have :])
            if not n:
                raise http.client.RemoteDisconnected("closed by the server")
            self.have += n

    def _read(self, s: socket.socket) -> tuple[int, bytes, bytes]:
        buf = self.buf
        end = buf.find(b"\r\n\r\n", 0, self.have)
        while end < 0:
            seen = max(0, self.have - 3)
            self._fill(s, self.have + 1)
            end = buf.find(b"\r\n\r\n", seen, self.have)
        head = bytes(buf[: end + 2]).lower()
        status = int(head[9:12])
        start = end + 4
        i = head.find(b"\r\ncontent-length:")
        if i >= 0:
            stop = start + int(head[i + 17 : head.index(b"\r\n", i + 2)])
            self._fill(s, stop)
            body = bytes(buf[start:stop])
        elif b"\r\ntransfer-encoding: chunked" in head:
            body, stop = self._chunked(s, start)
        else:
            body, stop = b"", start
        timing = b""
        i = head.find(b"\r\nserver-timing:")
        if i >= 0:  # the value as sent (the lowercase copy serves only to find it)
            timing = bytes(buf[i + 16 : head.index(b"\r\n", i + 2)]).strip()
        if self.have > stop:  # bytes past this answer (none in request-response order)
            buf[: self.have - stop] = buf[stop : self.have]
        self.have -= stop
        if b"\r\nconnection: close" in head:
            self.close()
        return status, body, timing

    def _chunked(self, s: socket.socket, at: int) -> tuple[bytes, int]:
        parts = []
        while True:
            eol = self.buf.find(b"\r\n", at, self.have)
            while eol < 0:
                self._fill(s, self.have + 1)
                eol = self.buf.find(b"\r\n", at, self.have)
            n = int(bytes(self.buf[at:eol]).split(b";")[0], 16)
            self._fill(s, eol + 2 + n + 2)
            if not n:  # no trailers are sent by the services measured here
                return b"".join(parts), eol + 4
            parts.append(bytes(self.buf[eol + 2 : eol + 2 + n]))
            at = eol + 2 + n + 2

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock, self.have = None, 0


def server_ms(timing: bytes) -> float | None:
    """The ``dur=`` of a ``Server-Timing`` value, in ms."""
    if b"dur=" not in timing:
        return None
    try:
        return float(timing.split(b"dur=")[1].split(b";")[0].split(b",")[0])
    except ValueError:
        return None


def _raise_nofile() -> None:
    """Open files up to 65,536 where the hard limit may be raised, else up to the hard
    limit: a subscription holds 4 files on the server (:func:`sources_that_fit`)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(hard, 65536), max(hard, 65536)))
    except (ValueError, OSError):
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


#: The server's HTTP connections (``--max-connections``): the clients, the probe, the check.
MAX_CONNECTIONS = 64
#: More flags for every kv-conductor server started here (``trace_replay.py --server-args``).
SERVER_ARGS: list[str] = []


def sources_that_fit() -> int | None:
    """ZeroMQ sources a server started by this process can open (None: no limit): the hard
    open-file limit less the HTTP connections and the headroom, at
    ``kvconductor.serve.tuning.FDS_PER_SOURCE`` files a source (its SUB socket and TCP
    connection, its monitor's PAIR pair)."""
    from kvconductor.serve.tuning import FD_HEADROOM, FDS_PER_SOURCE

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return None
    try:  # as _raise_nofile: a limit that may be raised is no limit here
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, 65536))
        return None
    except (ValueError, OSError):
        pass
    return (hard - MAX_CONNECTIONS - FD_HEADROOM) // FDS_PER_SOURCE


def _wait_port(port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.05)


class Floor:
    """The floor of the HTTP stack: ``bench/floor_app.py`` (``app``: ``size`` bytes to every
    request; ``sized_app``: as many as the request's ``x-floor-size``) on the same uvicorn
    as kv-conductor (same loop and HTTP parser), doing nothing else. What a target adds
    is the difference."""

    def __init__(self, size: int | None = None) -> None:
        self.port = _free_port()
        self.answer = tempfile.NamedTemporaryFile(prefix="kvc-floor-")
        self.answer.write(bytes(size or 0))
        self.answer.flush()
        app = "floor_app:sized_app" if size is None else "floor_app:app"
        self.proc = subprocess.Popen(
            floor_cmd(app, self.port),
            cwd=ROOT,
            env={**os.environ, "FLOOR_ANSWER": self.answer.name},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_port(self.port, self.proc, "the floor app")

    @staticmethod
    def row(lat: list[int], wall: float) -> dict[str, Any]:
        return {
            "floor_p50_us": tr.quantile(lat, 0.5) / 1e3,
            "floor_p99_us": tr.quantile(lat, 0.99) / 1e3,
            "floor_queries_per_s": len(lat) / wall if wall else 0.0,
        }

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.answer.close()


def floor_cmd(app: str, port: int) -> list[str]:
    """``bench/floor_app.py``'s ``app`` on the uvicorn kv-conductor runs on (its loop and
    HTTP parser), on ``port``."""
    from kvconductor.serve.single import _uvicorn_impls

    loop, http_impl = _uvicorn_impls()
    return (
        [sys.executable, "-m", "uvicorn", app, "--app-dir", str(ROOT / "bench")]
        + ["--host", "127.0.0.1", "--port", str(port), "--loop", loop]
        + ["--http", http_impl, "--lifespan", "off", "--no-access-log"]
        + ["--no-server-header", "--log-level", "warning"]
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """A service under test in a subprocess on a free loopback port, its log in a temporary
    directory; the target interface :func:`run_server` drives (``register``, ``applied``,
    ``body``, ``items``) is the subclass's."""

    name = ""
    path = "/query_by_hash"
    ctype = "application/msgpack"
    #: a kv-conductor probe engine measures the event-to-visible lag
    probe = False
    #: its answers are checked at quiescence (a floor has none)
    answers = True
    #: a floor's answer size (bytes)
    size = 0

    def __init__(self, cmd: list[str], logdir: str, dp: int, preexec=None, env=None) -> None:
        self.dp = dp
        self.log = open(Path(logdir) / f"{self.name}.log", "wb")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=preexec, env=env
        )
        _wait_port(self.port, self.proc, self.name)
        self.http = Conn(self.port)

    port = 0

    def log_text(self) -> str:
        self.log.flush()
        return (Path(self.log.name)).read_text(errors="replace")[-3000:]

    def request(
        self, method: str, path: str, body: bytes | None = None, ctype: str = "", conn=None
    ):
        hdr = {"Content-Type": ctype} if ctype else {}
        r, data = (conn or self.http).request(method, path, body, hdr)
        return r.status, data

    def get(self, path: str):
        return self.request("GET", path)

    def post_json(self, path: str, obj: Any, conn: Conn | None = None):
        return self.request("POST", path, json.dumps(obj).encode(), "application/json", conn)

    def ask(self, hashes: list[int], top_k: int | None = None) -> tuple[int, bytes]:
        return self.request("POST", self.path, self.body(hashes, top_k), self.ctype)

    def body(self, hashes: list[int], top_k: int | None = None) -> bytes:
        raise NotImplementedError

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the service's processes have used so far: its own
        and its children's (``--workers``), from ``/proc`` (0.0 where there is none)."""
        total, todo = 0, [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/task/{pid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except (OSError, ValueError, IndexError):
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime (stat's 14th, 15th)
        return total / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


class Server(Service):
    """``python -m kvconductor``."""

    name = "kv-conductor"
    probe = True

    def __init__(self, workers: int, logdir: str, dp: int = 1, extra: Sequence[str] = ()) -> None:
        self.port = _free_port()
        cmd = [sys.executable, "-m", "kvconductor", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--no-snapshots", "--log-level", "WARNING"]
        cmd += ["--max-sources", str(workers + 16), "--max-connections", str(MAX_CONNECTIONS)]
        cmd += [*SERVER_ARGS, *extra]
        super().__init__(cmd, logdir, dp, _raise_nofile)
        self.enc = msgspec.msgpack.Encoder()
        deadline = time.monotonic() + 60
        while self.get("/health")[1] != b"OK":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server not ready: {self.log_text()}")
            time.sleep(0.1)

    def register(self, w: int, url: str, iid: str | None = None, conn: Conn | None = None):
        iid, d = (iid, 0) if iid is not None else tr.instance_of(w, self.dp)
        st, body = self.post_json(
            "/register",
            {
                "instance_id": iid,
                "type": "vLLM",
                "modelname": MODEL,
                "block_size": SERVER_BLOCK,
                "dp_rank": d,
                "medium_endpoints": {"npu": url},
            },
            conn,
        )
        if st != 201:
            raise RuntimeError(f"register {iid}/{d}: {st} {body[:200]!r}")

    def applied(self) -> tuple[int, dict[str, int]]:
        """Batches applied over every source, and the losses (``GET /workers``)."""
        st, data = self.get("/workers")
        if st != 200:
            return -1, {}
        sources = json.loads(data).get("sources", [])
        losses = {
            "gaps": sum(s.get("gaps", 0) for s in sources),
            "losses": sum(s.get("losses", 0) for s in sources),
            "dropped": sum(sum((s.get("dropped") or {}).values()) for s in sources),
        }
        return sum(s.get("batches", 0) for s in sources), losses

    def body(self, hashes: list[int], top_k: int | None = None) -> bytes:
        q: dict[str, Any] = {"model": MODEL, "block_hashes": hashes}
        if top_k:
            q["top_k"] = top_k
        return self.enc.encode(q)

    def predict_body(self, hashes: list[int], w: int) -> bytes:
        """``POST /predict_by_hash``'s body: ``hashes`` predicted for engine ``w``."""
        iid, d = tr.instance_of(w, self.dp)
        q = {"model": MODEL, "block_hashes": hashes, "instance_id": iid, "dp_rank": d}
        return self.enc.encode(q)

    def prediction_counts(self) -> dict[str, int]:
        """``kvconductor_predictions_total{outcome}`` and ``kvconductor_predictions_live``."""
        text = self.get("/metrics")[1].decode()
        out = {
            k: int(float(v))
            for k, v in re.findall(r'kvconductor_predictions_total\{outcome="(\w+)"\} (\S+)', text)
        }
        live = re.search(r"^kvconductor_predictions_live (\S+)$", text, re.M)
        out["live"] = int(float(live.group(1))) if live else -1
        return out

    def items(self, raw: bytes) -> list[int]:
        """The answer's ``(worker << DEPTH_BITS) | blocks`` items, in the answer's order."""
        ans = msgspec.msgpack.decode(raw)
        dp = self.dp
        out = []
        for iid, inst in (ans.get("default") or {}).items():
            for rank, e in inst["DP"].items():
                blocks = e["npu_blocks"] + (e["cpu_blocks"] << 10) + (e["disk_blocks"] << 10)
                out.append(((int(iid[1:]) * dp + int(rank)) << tr.DEPTH_BITS) | blocks)
        return out


class IngestFloor(Service):
    """The floor of a service that takes the event stream in while it answers:
    ``bench/floor_app.py``'s ``ingest_app`` on the same uvicorn as kv-conductor, which
    subscribes to every engine registered and receives (and drops) every message on a
    thread of its own, and answers every query ``size`` bytes (kv-conductor's mean answer
    to the same queries). With ``sources``, "floor + sources": a SUB per engine on
    kv-conductor's own ingest loop, whose handler only counts (the floor of a service that
    knows which engine sent each message). Played the same stream, the same queries and
    the same load beside it as the services (:func:`bench.trace_server.run_server`); it has
    no answers to check."""

    name = "floor + ingest"
    answers = False

    def __init__(
        self, workers: int, logdir: str, dp: int = 1, size: int = 0, sources: bool = False
    ) -> None:
        self.port, self.size = _free_port(), size
        answer = Path(logdir) / "floor-answer.bin"
        answer.write_bytes(bytes(size))
        self.enc = msgspec.msgpack.Encoder()
        env = {**os.environ, "FLOOR_ANSWER": str(answer)}
        if sources:  # a SUB per engine on kv-conductor's ingest loop (floor_app.py)
            self.name = "floor + sources"
            env |= {"FLOOR_SOURCES": "1", "FLOOR_SOURCES_MAX": str(workers * dp)}
        cmd = floor_cmd("floor_app:ingest_app", self.port)
        super().__init__(cmd, logdir, dp, _raise_nofile, env)

    def register(self, w: int, url: str, iid: str | None = None, conn: Conn | None = None):
        st, body = self.post_json("/register", {"endpoint": url}, conn)
        if st != 201:
            raise RuntimeError(f"register {w}: {st} {body[:200]!r}")

    def applied(self) -> tuple[int, dict[str, int]]:
        st, data = self.get("/applied")
        return (int(data) if st == 200 else -1), {"gaps": 0, "losses": 0, "dropped": 0}

    body = Server.body


class DoesNotFit(RuntimeError):
    """The engines need more open files than this machine lets the server have."""
