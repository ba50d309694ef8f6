"""Per-request cost in one process, without sockets (``python bench/request_cost.py``).

Drives uvicorn's HTTP protocol the way its event loop does (``data_received`` with
the raw request bytes, a transport that collects what is written) for two stacks:

* ``floor``: uvicorn's own ``HttpToolsProtocol`` and :mod:`floor_app` (read the
  body, answer fixed bytes): what the stack costs;
* ``kvc``: kv-conductor's protocol (:mod:`kvconductor.http.limits`) and app, built
  by :func:`kvconductor.serve.bootstrap.build_service` as ``kv-conductor`` builds
  them, with one engine's chain loaded through ``POST /events`` so every query is a
  full hit.

No kernel, no client: the difference between the two rows is what kv-conductor adds
per request (parse, match, encode, metrics, limits, headers). Prints µs per request
(best of ``--repeat``); ``--allocs`` instead counts the allocator calls and the
instructions per request of each stack (runs itself under ``valgrind
--tool=callgrind``, a developer tool like ``wrk``). ``--only kvc`` runs one stack (for a profiler).

    python bench/request_cost.py [--tokens 4096] [--requests 20000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import uvicorn
from e2e_query import BLOCK, MODEL, bodies, tokens

INSTANCE = "vllm-prefill-0"
BASE_HASH = 1 << 40


class Transport(asyncio.Transport):
    """What uvicorn's protocol needs of a transport; counts responses written."""

    def __init__(self) -> None:
        super().__init__()
        self.buf = bytearray()
        self.closed = False
        self.done: asyncio.Future | None = None
        self.responses = 0
        self.statuses: list[bytes] = []
        self.last_body = b""

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 13333), "peername": ("127.0.0.1", 40000)}.get(
            name, default
        )

    def write(self, data) -> None:
        self.buf += data
        while True:  # one or more complete responses in the buffer
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = bytes(self.buf[: head_end + 2]).lower()
            i = head.find(b"content-length: ")
            length = int(head[i + 16 : head.find(b"\r\n", i)]) if i >= 0 else 0
            end = head_end + 4 + length
            if len(self.buf) < end:
                return
            self.statuses.append(bytes(self.buf[9:12]))
            self.last_body = bytes(self.buf[head_end + 4 : end])
            del self.buf[:end]
            self.responses += 1
            if self.done is not None and not self.done.done():
                self.done.set_result(None)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


def request_bytes(path: str, body: bytes, ctype: str) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:13333\r\nUser-Agent: bench\r\n"
        f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Stack:
    def __init__(self, config: uvicorn.Config, loop: asyncio.AbstractEventLoop) -> None:
        from uvicorn.server import ServerState

        if not config.loaded:
            config.load()
        self.transport = Transport()
        self.proto = config.http_protocol_class(  # type: ignore[call-arg]
            config=config, server_state=ServerState(), app_state={}, _loop=loop
        )
        self.proto.connection_made(self.transport)

    async def one(self, raw: bytes) -> bytes:
        loop = asyncio.get_running_loop()
        self.transport.done = loop.create_future()
        self.proto.data_received(raw)
        await self.transport.done
        return self.transport.statuses[-1]

    async def many(self, raw: bytes, n: int) -> float:
        t = self.transport
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        for _ in range(n):
            t.done = loop.create_future()
            self.proto.data_received(raw)
            await t.done
        return time.perf_counter() - t0


def floor_stack(loop, answer: bytes) -> Stack:
    import floor_app

    floor_app.ANSWER = answer
    floor_app._HEADERS[1] = (b"content-length", str(len(answer)).encode())
    config = uvicorn.Config(
        floor_app.app, loop="none", http="httptools", lifespan="off", access_log=False
    )
    return Stack(config, loop)


def kvc_stack(loop):
    from kvconductor.serve.bootstrap import build_service
    from kvconductor.serve.cli import build_parser, settings_from_args
    from kvconductor.serve.single import KvServer, uvicorn_config

    settings = settings_from_args(build_parser().parse_args(["--no-snapshots"]))
    service = build_service(settings, "single")
    if not service.start():
        raise SystemExit("service did not start")
    config = uvicorn_config(service.app, settings)
    config.loop = "none"
    KvServer(config)  # wraps the app as kv-conductor does
    return service, Stack(config, loop)


async def load_events(stack: Stack, toks) -> None:
    import json

    reg = {
        "instance_id": INSTANCE,
        "type": "vLLM",
        "modelname": MODEL,
        "block_size": BLOCK,
        "dp_rank": 0,
    }
    st = await stack.one(request_bytes("/register", json.dumps(reg).encode(), "application/json"))
    assert st == b"201", st
    nb = len(toks) // BLOCK
    ev = {
        "event_id": 0,
        "dp_rank": 0,
        "type": "BlockStored",
        "block_hashes": list(range(BASE_HASH, BASE_HASH + nb)),
        "parent_block_hash": None,
        "token_ids": toks[: nb * BLOCK].tolist(),
        "block_size": BLOCK,
        "medium": "GPU",
    }
    body = json.dumps({"instance_id": INSTANCE, "model_name": MODEL, "events": [ev]}).encode()
    st = await stack.one(request_bytes("/events", body, "application/json"))
    assert st == b"200", st


#: The allocators counted by ``--allocs``: CPython's small-object allocator (every
#: object and buffer up to 512 bytes) and the C heap (larger ones, and C code's).
ALLOCATORS = ("_PyObject_Malloc", "malloc")


def callgrind_calls(path: str) -> dict[str, int]:
    """Calls of each of :data:`ALLOCATORS` in a callgrind output file: the sum of its
    callers' call counts, as ``callgrind_annotate --tree=caller`` prints them."""
    import re
    import subprocess

    out = subprocess.run(
        ["callgrind_annotate", "--tree=caller", "--auto=no", "--threshold=100", path],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    calls: dict[str, int] = {}
    for name in ALLOCATORS:
        target = re.compile(r"\*\s+\S*:" + re.escape(name) + r" ")
        for i, line in enumerate(out):
            if target.search(line):
                j, total = i - 1, 0
                while j >= 0 and "<" in out[j]:
                    m = re.search(r"\(([\d,]+)x\)", out[j])
                    total += int(m.group(1).replace(",", "")) if m else 0
                    j -= 1
                calls[name] = calls.get(name, 0) + total
    return calls


def allocs_per_request(only: str, tokens: int, n: int) -> dict[str, float]:
    """Run this script under ``valgrind --tool=callgrind`` with ``n`` and ``3n``
    requests; the difference of the allocator calls, per request."""
    import subprocess
    import tempfile

    counts = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in (n, 3 * n):
            out = os.path.join(tmp, f"cg.{k}")
            subprocess.run(
                ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable]
                + [os.path.abspath(__file__), "--only", only, "--tokens", str(tokens)]
                + ["--requests", str(k), "--repeat", "1"],
                check=True,
                capture_output=True,
            )
            calls = callgrind_calls(out)
            calls["instructions"] = callgrind_instructions(out)
            counts.append(calls)
    keys = (*ALLOCATORS, "instructions")
    return {a: (counts[1].get(a, 0) - counts[0].get(a, 0)) / (2 * n) for a in keys}


def callgrind_instructions(path: str) -> int:
    """Instructions executed (``Ir``) in a callgrind output file: its ``totals:`` line."""
    with open(path) as f:
        for line in f:
            if line.startswith(("totals:", "summary:")):
                return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", choices=["floor", "kvc"])
    ap.add_argument(
        "--allocs",
        action="store_true",
        help="count allocator calls and instructions per request under valgrind (slow)",
    )
    args = ap.parse_args()
    if args.allocs:
        for who in ("floor", "kvc"):
            per = allocs_per_request(who, args.tokens, 500)
            calls = ", ".join(f"{k} {v:,.1f}" for k, v in per.items())
            print(f"{who:>6}: {calls} per request")
        return
    import uvloop

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    toks = tokens(args.tokens, 1)
    body = bodies(toks)["msgpack"][0]
    raw = request_bytes("/query", body, "application/msgpack")
    service, kvc = kvc_stack(loop)
    try:
        loop.run_until_complete(load_events(kvc, toks))
        # the floor answers what kv-conductor answers
        loop.run_until_complete(kvc.one(raw))
        stacks = {"kvc": kvc}
        if args.only != "kvc":
            stacks["floor"] = floor_stack(loop, _answer_of(kvc, raw, loop))
        if args.only:
            stacks = {args.only: stacks[args.only]}
        print(f"{args.tokens}-token msgpack /query full hit, {len(raw):,}-byte request")
        best = {}
        for _ in range(args.repeat):
            for name, st in stacks.items():
                dt = loop.run_until_complete(st.many(raw, args.requests))
                best[name] = min(best.get(name, 1e9), dt / args.requests)
        for name, v in best.items():
            print(f"{name:>6}: {v * 1e6:8.2f} µs/request (best of {args.repeat})")
        if "floor" in best and "kvc" in best:
            print(f"  kvc - floor: {(best['kvc'] - best['floor']) * 1e6:.2f} µs")
    finally:
        service.stop()


def _answer_of(stack: Stack, raw: bytes, loop) -> bytes:
    loop.run_until_complete(stack.one(raw))
    return stack.transport.last_body


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
