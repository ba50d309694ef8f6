"""Registration from an engine's URL (``engine_url``) against a running server: what the
read of ``GET /kv_event_sources`` adds to a registration, and how long an engine restarted
on new ports takes to be found again.

The engine is vLLM 0.33.0's own ``ZmqEventPublisher`` (port 0) and a plain HTTP server
answering the body vLLM's own route function makes (tests/helpers/enginehttp.py; the
wheel is read, never installed). Prints the median and max milliseconds of ``--n``
registrations with ``engine_url`` beside ``--n`` with the same endpoints given as URLs
(client round trip included), then, ``--restarts`` times, the seconds from the engine's
restart on new ports (from going down, and from its route listing the new port) to its
new blocks answered by ``/query``, for an engine down ``--down-secs`` seconds.

    PYTHONPATH=$PWD python bench/engine_url.py --n 40 --restarts 3 --down-secs 0,8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from tests.helpers.enginehttp import Engine, EngineHttp, until_hits
from tests.helpers.server import Server, registration


def _ms(http, bodies: list[dict]) -> list[float]:
    out = []
    for b in bodies:
        t0 = time.perf_counter()
        r = http.post("/register", json=b)
        out.append(1000 * (time.perf_counter() - t0))
        if r.status_code != 201:
            raise SystemExit(f"registration: {r.status_code} {r.text}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument(
        "--down-secs",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[0.0, 8.0],
        help="how long the engine is down before it is back on new ports (a list)",
    )
    args = ap.parse_args()
    web = EngineHttp()
    eng = Engine(web, {0: "tcp://*:0"})
    try:
        with tempfile.TemporaryDirectory() as d:
            srv = Server(Path(d), "--log-level", "warning")
            try:
                srv.wait_ready()
                ep = eng.pubs[0].get_publisher_config()
                urls = {"medium_endpoints": {"npu": ep.endpoint}}
                urls["replay_endpoint"] = ep.replay_endpoint
                by_url = [registration(f"u-{i}", engine_url=web.url) for i in range(args.n)]
                fixed = [registration(f"f-{i}", **urls) for i in range(args.n)]
                a, b = _ms(srv.http, fixed), _ms(srv.http, by_url)
                for name, xs in (("endpoint URLs", a), ("engine_url", b)):
                    print(
                        f"register with {name:13}: median {statistics.median(xs):6.2f} ms, "
                        f"max {max(xs):6.2f} ms (n={len(xs)})"
                    )
                time.sleep(2.0)  # the follower's first read of each registration is done
                n = 0  # restarts so far: each one's blocks are new
                for gap in args.down_secs:
                    took = []
                    for _ in range(args.restarts):
                        n += 1
                        tokens = list(range(1000 * n, 1000 * n + 8))
                        t_down = time.monotonic()
                        eng.pubs[0].shutdown()
                        time.sleep(max(0.0, t_down + gap - time.monotonic()))
                        t_up = time.monotonic()
                        eng.up(0)
                        hashes = [10 * n + 1, 10 * n + 2]
                        until_hits(srv.http, "u-0", eng, 0, hashes, tokens)
                        t = time.monotonic()
                        took.append((t - t_down, t - t_up))
                    print(
                        f"engine down {gap:g} s, back on new ports: answered after "
                        f"{', '.join(f'{a:.2f}' for a, _ in took)} s from going down, "
                        f"{', '.join(f'{b:.2f}' for _, b in took)} s from listing its new port"
                    )
            finally:
                srv.terminate()
    finally:
        eng.shutdown()
        web.close()


if __name__ == "__main__":
    main()
