"""POST one body file back to back for a while (``python bench/post_loop.py``).

One keep-alive connection, one request at a time: the "1M-token queries from one
Python client" beside ``wrk`` in docs/performance.md. Prints the number of
requests, their rate, and the median round trip and server time
(``Server-Timing``).

    python bench/post_loop.py --body bench/wrk/q1m.body --seconds 6
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import time
from urllib.parse import urlsplit

from e2e_query import server_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:13333/query")
    ap.add_argument("--body", required=True, help="body file (bench/make_query_body.py)")
    ap.add_argument("--content-type", default="application/msgpack")
    ap.add_argument("--seconds", type=float, default=6.0)
    args = ap.parse_args()
    with open(args.body, "rb") as f:
        body = f.read()
    u = urlsplit(args.url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=60)
    headers = {"Content-Type": args.content_type}
    rt, srv = [], []
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        conn.request("POST", u.path or "/", body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
        rt.append((time.perf_counter() - t0) * 1e3)
        if r.status != 200:
            raise SystemExit(f"{u.path}: HTTP {r.status}: {data[:200]!r}")
        ms = server_ms(r.getheader("Server-Timing"))
        if ms is not None:
            srv.append(ms)
    conn.close()
    print(
        f"{len(rt)} requests in {args.seconds:g} s ({len(rt) / args.seconds:.1f}/s), "
        f"round trip median {statistics.median(rt):.2f} ms"
        + (f", server median {statistics.median(srv):.2f} ms" if srv else "")
    )


if __name__ == "__main__":
    main()
