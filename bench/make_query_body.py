"""Write a ``/query`` body file for ``wrk`` (``python bench/make_query_body.py``).

The prompt is the first N tokens of the benchmark document that
``bench/load_chain.py`` loads (and ``bench/e2e_query.py`` uses), so a query with it
is a full hit. Formats: ``json`` (send with ``Content-Type: application/json``),
``msgpack`` (a map with an integer array) and ``packed`` (a map whose ``token_ids``
is one bin of little-endian u32); both msgpack forms go with
``Content-Type: application/msgpack``.

    python bench/make_query_body.py --tokens 4096 --format msgpack -o bench/wrk/q4k.body
"""

from __future__ import annotations

import argparse

from e2e_query import BLOCK, MODEL, bodies, tokens

DOC_SEED = 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, required=True, help="prompt length in tokens")
    ap.add_argument("--format", choices=["json", "msgpack", "packed"], default="msgpack")
    ap.add_argument("-o", "--output", required=True, help="file to write")
    args = ap.parse_args()
    body, ctype = bodies(tokens(args.tokens, DOC_SEED))[args.format]
    with open(args.output, "wb") as f:
        f.write(body)
    print(
        f"{args.output}: {len(body):,} bytes, {args.tokens:,} tokens, model {MODEL!r}, "
        f"block size {BLOCK}, Content-Type: {ctype}"
    )


if __name__ == "__main__":
    main()
