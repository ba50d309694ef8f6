"""What registered but dead engine sources cost a server at rest: CPU of the whole process
while N sources point at closed ports, for several reconnect caps.

ZeroMQ reconnects a SUB whose peer is gone every RECONNECT_IVL, doubling up to
RECONNECT_IVL_MAX (kvconductor.ingest.source). A low cap brings an engine back
quickly after an outage; each dead source then costs one refused TCP connect per cap.
Each cap runs in its own server (the constant is set before the service starts), after
the back-off ramp, for ``--secs`` seconds; the servers run one after the other.

    python bench/dead_sources.py --sources 1000 --caps 30000,2000,1000
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(sources: int, cap_ms: int, secs: float, ramp: float) -> float:
    """Percent of one core the server used over ``secs`` with ``sources`` dead sources."""
    port = free_port()
    code = (
        "import sys; import kvconductor.ingest.source as s; "
        f"s.RECONNECT_IVL_MAX_MS = {cap_ms}; from kvconductor.serve.cli import main; "
        f"sys.exit(main(['--port', '{port}', '--log-level', 'warning', '--no-snapshots']))"
    )
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
            for _ in range(200):
                try:
                    if http.get("/health").text == "OK":
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            dead = [free_port() for _ in range(sources)]
            for i, p in enumerate(dead):
                body = {
                    "instance_id": f"dead-{i}",
                    "type": "vLLM",
                    "modelname": "m",
                    "block_size": 16,
                    "dp_rank": 0,
                    "medium_endpoints": {"npu": f"tcp://127.0.0.1:{p}"},
                }
                r = http.post("/register", json=body)
                r.raise_for_status()
            time.sleep(ramp)  # past the back-off ramp (and the mute after 10 s)
            c0, t0 = cpu_seconds(proc.pid), time.monotonic()
            time.sleep(secs)
            return 100.0 * (cpu_seconds(proc.pid) - c0) / (time.monotonic() - t0)
        finally:
            proc.terminate()
            proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", type=int, default=1000)
    ap.add_argument("--caps", default="30000,2000,1000", help="RECONNECT_IVL_MAX values, ms")
    ap.add_argument("--secs", type=float, default=20.0)
    ap.add_argument("--ramp", type=float, default=40.0)
    a = ap.parse_args()
    print(f"{a.sources} dead sources, {a.secs:g} s after a {a.ramp:g} s ramp:")
    for cap in (int(c) for c in a.caps.split(",")):
        pct = run(a.sources, cap, a.secs, a.ramp)
        print(f"  reconnect cap {cap:6d} ms: {pct:5.1f} % of one core")


if __name__ == "__main__":
    main()
