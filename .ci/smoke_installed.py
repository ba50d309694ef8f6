"""Smoke test of the built distributions and of kvconductor *installed* from the wheel
(built from the sdist), run from outside the source tree.

Usage: python smoke_installed.py SOURCE_TREE DIST_DIR

Checks that the sdist in DIST_DIR carries the Cython sources and no generated C, that the
wheel carries the compiled modules, stubs and declarations and no C/Cython sources, that
the package imported is the installed one (not SOURCE_TREE), that every
compiled module loaded from a shared object, that the typing files were installed and
no build leftovers were, that the ``kv-conductor`` script answers ``--version`` and
``--help``, and that a real server started by that script stores a block from
``/events`` and finds it with ``/query``. Exits non-zero on any failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
import zipfile
from pathlib import Path


def check(cond: bool, what: str) -> None:
    if not cond:
        sys.exit(f"smoke: FAILED: {what}")
    print(f"smoke: ok: {what}")


def post(base: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, json.loads(r.read())


# The inline C building blocks cimported by the compiled modules (no .pyx of their own).
CORE_PXD = {f"kvconductor/{m}.pxd" for m in ("_maps", "_pool", "_rwlock", "_cursor", "_readers")}
# The scanners included by the parser module (sdist only: compiled into _wire).
PARSER_PXI = {"kvconductor/_wire_json.pxi", "kvconductor/_wire_msgpack.pxi"}


def check_dists(dist: Path, modules: tuple[str, ...], version: str) -> None:
    (sdist,) = dist.glob(f"kvconductor-{version}.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    need = (
        {
            "LICENSE",
            "README.md",
            "pyproject.toml",
            "setup.py",
            "kvconductor/py.typed",
            "tests/conftest.py",
        }
        | CORE_PXD
        | PARSER_PXI
    )
    for m in modules:
        need |= {f"kvconductor/{m}.pyx", f"kvconductor/{m}.pxd", f"kvconductor/{m}.pyi"}
    check(need <= names, f"{sdist.name} has the sources to compile {sorted(need - names)}")
    generated = sorted(n for n in names if n.endswith((".c", ".so")))
    check(not generated, f"{sdist.name} has no generated C or shared objects {generated}")

    (wheel,) = dist.glob(f"kvconductor-{version}-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    so = {n.split(".", 1)[0] for n in names if n.startswith("kvconductor/_") and n.endswith(".so")}
    check(so == {f"kvconductor/{m}" for m in modules}, f"{wheel.name} has every compiled module")
    need = CORE_PXD | {"kvconductor/py.typed", f"kvconductor-{version}.dist-info/entry_points.txt"}
    for m in modules:
        need |= {f"kvconductor/{m}.pxd", f"kvconductor/{m}.pyi"}
    check(need <= names, f"{wheel.name} has the stubs and declarations {sorted(need - names)}")
    check(
        any(
            n.startswith(f"kvconductor-{version}.dist-info/") and n.endswith("LICENSE")
            for n in names
        ),
        f"{wheel.name} has the LICENSE",
    )
    junk = sorted(n for n in names if n.endswith((".c", ".pyx", ".html")))
    check(not junk, f"{wheel.name} has no C or Cython sources {junk}")


def main() -> None:
    source = Path(sys.argv[1]).resolve()
    import kvconductor

    check_dists(Path(sys.argv[2]), kvconductor.COMPILED_MODULES, kvconductor.__version__)

    pkg = Path(kvconductor.__file__).resolve().parent
    check(source not in pkg.parents, f"kvconductor imported from the install ({pkg})")
    check(
        kvconductor.is_available(),
        f"kvconductor.is_available() ({kvconductor.unavailable_reason()})",
    )
    for name in kvconductor.COMPILED_MODULES:
        mod = sys.modules[f"kvconductor.{name}"]
        check(
            Path(mod.__file__).parent == pkg and mod.__file__.endswith(".so"),
            f"kvconductor.{name} is a compiled module in the install",
        )
        check(
            (pkg / f"{name}.pyi").is_file() and (pkg / f"{name}.pxd").is_file(),
            f"{name}.pyi and {name}.pxd installed",
        )
    check((pkg / "py.typed").is_file(), "py.typed installed")
    leftovers = sorted(p.name for p in pkg.rglob("*") if p.suffix in (".c", ".pyx", ".html"))
    check(not leftovers, f"no build leftovers installed {leftovers}")

    exe = str(Path(sys.executable).parent / "kv-conductor")
    check(os.access(exe, os.X_OK), f"kv-conductor script installed next to this python ({exe})")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    check(
        out.returncode == 0 and out.stdout.strip() == f"kv-conductor {kvconductor.__version__}",
        f"kv-conductor --version -> {out.stdout.strip()!r}",
    )
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    check(out.returncode == 0 and "--port" in out.stdout, "kv-conductor --help")

    proc = subprocess.Popen(
        [exe, "--host", "127.0.0.1", "--port", "0", "--no-snapshots"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port: list[int] = []
        started = threading.Event()

        def read_log() -> None:
            for line in proc.stderr:
                sys.stderr.write(line)
                m = re.search(r"starting on 127\.0\.0\.1:(\d+)", line)
                if m:
                    port.append(int(m.group(1)))
                    started.set()

        threading.Thread(target=read_log, daemon=True).start()
        check(started.wait(30), "kv-conductor --port 0 logged its address")
        base = f"http://127.0.0.1:{port[0]}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    health = (r.status, r.read())
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        check(health == (200, b"OK"), f"GET /health -> {health}")
        reg = post(
            base,
            "/register",
            {
                "instance_id": "smoke-1",
                "type": "vLLM",
                "modelname": "qwen",
                "block_size": 4,
                "dp_rank": 0,
            },
        )
        check(reg == (201, {"status": "ok"}), f"POST /register -> {reg}")
        ev = post(
            base,
            "/events",
            {
                "instance_id": "smoke-1",
                "events": [
                    {
                        "event_id": 1,
                        "dp_rank": 0,
                        "type": "BlockStored",
                        "block_hashes": [100, 200],
                        "parent_block_hash": None,
                        "token_ids": list(range(1, 9)),
                        "block_size": 4,
                        "medium": "GPU",
                    }
                ],
            },
        )
        check(ev == (200, {"status": "ok", "events_applied": 1}), f"POST /events -> {ev}")
        q = post(
            base, "/query", {"model": "qwen", "block_size": 4, "token_ids": list(range(1, 11))}
        )
        want = {
            "default": {
                "smoke-1": {
                    "longest_matched": 8,
                    "DP": {
                        "0": {
                            "matched_tokens": 8,
                            "npu_blocks": 2,
                            "cpu_blocks": 0,
                            "disk_blocks": 0,
                        }
                    },
                }
            }
        }
        check(q == (200, want), f"POST /query -> {q}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    check(rc == 0, f"kv-conductor exited {rc} on SIGTERM")


if __name__ == "__main__":
    main()
