"""``python -m kvconductor``: same as the ``kv-conductor`` command."""

from kvconductor.serve.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
