"""Command line: ``kv-conductor [--host H] [--port P] ...``."""
from __future__ import annotations

import argparse
import sys

from kvconductor import __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kv-conductor", description="KV-cache index service")
    p.add_argument("--version", action="version", version=f"kv-conductor {__version__}")
    p.add_argument("--host", default="::")
    p.add_argument("--port", "-p", type=int, default=13333)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(f"kv-conductor {__version__}: server not built yet ({args.host}:{args.port})", file=sys.stderr)
    return 1
