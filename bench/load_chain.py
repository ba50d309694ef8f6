"""Load the benchmark index into a running server (``python bench/load_chain.py``).

Registers ``vllm-prefill-0`` (DP 0, model ``bench``, block size 16, HTTP-only) and
stores one HBM chain of the benchmark document through ``POST /events``: the same
tokens, engine hashes and event sizes as ``bench/e2e_query.py``, so the ``wrk`` rows
of docs/performance.md run against the same index (5M tokens = 312,500 blocks by
default).

    python bench/load_chain.py [--url http://127.0.0.1:13333] [--tokens 5000000]
"""

from __future__ import annotations

import argparse
import http.client
import time
from urllib.parse import urlsplit

from e2e_query import BLOCK, MODEL, load_chain, register, tokens

INSTANCE = "vllm-prefill-0"
DOC_SEED = 1  # e2e_query.py's document
BASE_HASH = 1 << 40  # e2e_query.py's engine hashes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:13333", help="server base URL")
    ap.add_argument("--tokens", type=int, default=5_000_000, help="document length in tokens")
    args = ap.parse_args()
    u = urlsplit(args.url)
    t0 = time.perf_counter()
    # NOTE: the document first: generating 5M tokens takes seconds, longer than the
    # server keeps an idle keep-alive connection open.
    doc = tokens(args.tokens, DOC_SEED)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=120)
    register(conn, INSTANCE, 0)
    load_chain(conn, INSTANCE, 0, doc, BASE_HASH)
    print(
        f"loaded {args.tokens // BLOCK:,} blocks of model {MODEL!r} (block size {BLOCK}) "
        f"for {INSTANCE} dp 0 in {time.perf_counter() - t0:.1f} s"
    )


if __name__ == "__main__":
    main()
