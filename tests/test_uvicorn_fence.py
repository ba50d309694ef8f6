"""kvconductor.http.fence: what kv-conductor relies on of uvicorn and httptools, named.

``kvconductor/http/direct.py`` and ``kvconductor/http/limits.py`` subclass uvicorn's
``HttpToolsProtocol`` (and ``H11Protocol``); ``kvconductor/serve/single.py``,
``worker.py``, ``owner.py`` and ``gunicorn.py`` subclass ``uvicorn.Server`` and build
``uvicorn.Config``. Every attribute, method and constant they use is listed here and
checked on the running uvicorn: when a release moves one, the failing case names it and
the file that relies on it. Then either adapt that file or keep the release out of
:data:`kvconductor.http.fence.UVICORN_RANGE` (``pyproject.toml`` says the same; a test
ties them); outside the range the service answers queries through ASGI
(``--query-path asgi``, logged).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import logging
import re

import httptools
import pytest
import tomllib
import uvicorn
from uvicorn.protocols.http import h11_impl, httptools_impl
from uvicorn.server import ServerState

from kvconductor.http import fence
from kvconductor.http.direct import DirectQueries
from kvconductor.http.limits import HttpLimits, protocol_class
from kvconductor.serve.settings import Settings
from kvconductor.serve.single import uvicorn_config
from tests.helpers.api import stored
from tests.helpers.server import ROOT, registration, running
from tests.helpers.transport import Recorder

VERSION = uvicorn.__version__

# -- what is relied on -----------------------------------------------------------------------

#: Module-level names: (module, name, who relies on it).
MODULE_NAMES = [
    (httptools_impl, "HttpToolsProtocol", "http/limits.py (subclassed)"),
    (httptools_impl, "STATUS_LINE", "http/framing.py (the same status lines as the ASGI path)"),
    (httptools_impl, "RequestResponseCycle", "http/limits.py, http/direct.py (cycle read)"),
    (h11_impl, "H11Protocol", "http/limits.py (subclassed)"),
    (uvicorn, "Server", "serve/single.py (KvServer)"),
    (uvicorn, "Config", "serve/single.py (uvicorn_config)"),
    (uvicorn.server, "ServerState", "http/limits.py, http/direct.py (server_state)"),
]

#: Methods of ``HttpToolsProtocol`` overridden or called through ``super()``, with the
#: parameters (after ``self``) the overrides are written for.
HTTPTOOLS_METHODS = {
    "connection_made": ["transport"],
    "connection_lost": ["exc"],
    "data_received": ["data"],
    "on_message_begin": [],
    "on_headers_complete": [],
    "on_body": ["body"],
    "on_message_complete": [],
    "on_response_complete": [],
    "shutdown": [],
    "send_400_response": ["msg"],
}
#: Methods of ``H11Protocol`` overridden or called through ``super()``.
H11_METHODS = {
    "connection_made": ["transport"],
    "connection_lost": ["exc"],
    "data_received": ["data"],
    "on_response_complete": [],
    "shutdown": [],
    "send_400_response": ["msg"],
}
#: Instance attributes of ``HttpToolsProtocol`` once a connection is made (read or set by
#: http/direct.py and http/limits.py).
HTTPTOOLS_CONNECTION_ATTRS = [
    "app",
    "access_log",
    "root_path",
    "limit_concurrency",
    "parser",
    "transport",
    "flow",
    "cycle",
    "pipeline",
    "server_state",
    "loop",
    "client",
]
#: ... once a request head arrived (``on_message_begin``/``on_url``/``on_header``).
HTTPTOOLS_REQUEST_ATTRS = ["url", "headers", "expect_100_continue", "scope"]
#: Attributes of the request cycle (``RequestResponseCycle``) read or set by http/limits.py
#: (``_in_app``, ``_can_answer``, ``_reject``, ``OneWrite``) and stood in for by
#: http/direct.py's ``_InFlight``.
CYCLE_ATTRS = [
    "transport",
    "response_started",
    "response_complete",
    "disconnected",
    "keep_alive",
    "message_event",
]
#: ``ServerState`` attributes: connections and tasks (serve/single.py's drain),
#: total_requests and default_headers (http/direct.py).
SERVER_STATE_ATTRS = ["connections", "tasks", "total_requests", "default_headers"]
#: ``FlowControl`` (``protocol.flow``): http/direct.py does not answer while writing is paused.
FLOW_ATTRS = ["write_paused"]
#: ``httptools.HttpRequestParser`` methods http/direct.py calls.
PARSER_METHODS = ["get_method", "get_http_version", "should_upgrade", "should_keep_alive"]
#: ``uvicorn.Server`` methods overridden or called (serve/single.py, worker.py, owner.py,
#: gunicorn.py).
SERVER_METHODS = [
    "run",
    "serve",
    "startup",
    "shutdown",
    "on_tick",
    "handle_exit",
    "capture_signals",
]
#: ``uvicorn.Server`` attributes after ``__init__`` (``servers``, ``started`` and
#: ``lifespan`` are set while it serves: checked on the class's source).
SERVER_ATTRS = ["config", "server_state", "should_exit", "force_exit"]
SERVER_STARTUP_ATTRS = ["servers", "started", "lifespan"]
#: The lifespan object's members serve/single.py's ``startup``/``shutdown`` use.
LIFESPAN_ATTRS = ["startup", "shutdown", "should_exit", "state"]
#: ``uvicorn.Config`` keyword arguments serve/single.py and worker.py pass.
CONFIG_KWARGS = [
    "app",
    "loop",
    "http",
    "ws",
    "lifespan",
    "log_config",
    "access_log",
    "timeout_keep_alive",
    "timeout_graceful_shutdown",
    "server_header",
    "date_header",
    "proxy_headers",
    "forwarded_allow_ips",
    "h11_max_incomplete_event_size",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_ca_certs",
    "ssl_cert_reqs",
]
#: ``uvicorn.Config`` attributes read (once loaded: ``http_protocol_class``).
CONFIG_ATTRS = [
    "app",
    "loop",
    "http",
    "ssl",
    "backlog",
    "forwarded_allow_ips",
    "timeout_graceful_shutdown",
    "loaded",
    "load",
    "http_protocol_class",
    "lifespan_class",
]


def moved(what: str, who: str) -> str:
    return (
        f"uvicorn {VERSION} (httptools {httptools.__version__}): {what} is gone or changed; "
        f"{who} relies on it. Adapt that file, or keep this release outside "
        f"kvconductor/http/fence.py's UVICORN_RANGE {fence.UVICORN_RANGE} and pyproject.toml "
        "(outside it the service answers queries through ASGI, --query-path asgi)"
    )


@pytest.mark.parametrize(("module", "name", "who"), MODULE_NAMES, ids=lambda x: str(x)[:40])
def test_module_names(module, name, who):
    assert hasattr(module, name), moved(f"{module.__name__}.{name}", who)


def test_status_line_is_the_one_the_protocol_writes_per_code():
    """The protocol's answers (``kvconductor.http.framing.STATUS_LINE``) and the ASGI
    path's (uvicorn's table) start with the same bytes, for every code."""
    from kvconductor.http.framing import STATUS_LINE

    table = httptools_impl.STATUS_LINE
    for code in range(100, 600):
        assert table.get(code) == STATUS_LINE[code], moved(
            f"STATUS_LINE[{code}] (b'HTTP/1.1 <code> <reason>\\r\\n', as http/framing.py's)",
            "http/framing.py",
        )


@pytest.mark.parametrize(
    ("cls", "methods"),
    [(httptools_impl.HttpToolsProtocol, HTTPTOOLS_METHODS), (h11_impl.H11Protocol, H11_METHODS)],
    ids=["HttpToolsProtocol", "H11Protocol"],
)
def test_protocol_methods_and_their_parameters(cls, methods):
    for name, params in methods.items():
        method = getattr(cls, name, None)
        assert callable(method), moved(f"{cls.__name__}.{name}()", "http/limits.py, http/direct.py")
        got = [p for p in inspect.signature(method).parameters if p != "self"]
        assert got == params, moved(
            f"{cls.__name__}.{name}{tuple(params)} (now {tuple(got)})",
            "http/limits.py, http/direct.py (overridden)",
        )


def test_protocol_constructor_takes_what_serve_single_passes():
    params = inspect.signature(httptools_impl.HttpToolsProtocol.__init__).parameters
    for name in ("config", "server_state", "app_state", "_loop"):
        assert name in params, moved(
            f"HttpToolsProtocol(..., {name}=...)", "serve/single.py (KvServer.startup)"
        )


def _app_config():
    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    config = uvicorn.Config(app, http="httptools", ws="none", lifespan="off", log_config=None)
    config.load()
    return config


async def _connection():
    state = ServerState()
    proto = httptools_impl.HttpToolsProtocol(
        config=_app_config(),
        server_state=state,
        app_state={},
        _loop=asyncio.get_running_loop(),
    )
    transport = Recorder()
    proto.connection_made(transport)
    return proto, transport, state


def test_instance_attributes_of_a_connection_and_its_request():
    async def main():
        proto, transport, state = await _connection()
        for name in HTTPTOOLS_CONNECTION_ATTRS:
            assert hasattr(proto, name), moved(
                f"HttpToolsProtocol().{name} (after connection_made)",
                "http/direct.py, http/limits.py",
            )
        for name in FLOW_ATTRS:
            assert hasattr(proto.flow, name), moved(f"protocol.flow.{name}", "http/direct.py")
        for name in PARSER_METHODS:
            assert callable(getattr(proto.parser, name, None)), moved(
                f"httptools.HttpRequestParser.{name}()", "http/direct.py (_start)"
            )
        assert proto.cycle is None and not proto.pipeline, moved(
            "a new connection's cycle None and an empty pipeline", "http/limits.py, http/direct.py"
        )
        proto.data_received(b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n")
        for name in HTTPTOOLS_REQUEST_ATTRS:
            assert hasattr(proto, name), moved(
                f"HttpToolsProtocol().{name} (after a request head)", "http/direct.py"
            )
        assert proto.url == b"/query", moved(
            "protocol.url (the raw target, bytes)", "http/direct.py"
        )
        assert (b"content-length", b"2") in proto.headers, moved(
            "protocol.headers (lower-cased (name, value) bytes pairs)", "http/direct.py"
        )
        assert proto.scope["headers"] is proto.headers, moved(
            "scope['headers'] is protocol.headers", "http/direct.py (_build_scope)"
        )
        assert proto.parser.get_method() == b"POST"
        assert proto.parser.get_http_version() == "1.1"
        assert proto.parser.should_keep_alive() and not proto.parser.should_upgrade()
        cycle = proto.cycle
        assert cycle is not None, moved(
            "protocol.cycle set by on_headers_complete", "http/limits.py"
        )
        for name in CYCLE_ATTRS:
            assert hasattr(cycle, name), moved(f"RequestResponseCycle.{name}", "http/limits.py")
        assert cycle.transport is transport, moved(
            "cycle.transport (the protocol's transport, replaced by OneWrite)", "http/limits.py"
        )
        proto.data_received(b"{}")
        for _ in range(200):
            if cycle.response_complete:
                break
            await asyncio.sleep(0.005)
        assert cycle.response_complete
        assert transport.data.startswith(b"HTTP/1.1 200 ")
        for name in SERVER_STATE_ATTRS:
            assert hasattr(state, name), moved(
                f"ServerState.{name}", "serve/single.py, http/direct.py"
            )
        assert state.total_requests == 1, moved(
            "ServerState.total_requests counted per request", "http/direct.py"
        )
        assert proto in state.connections, moved(
            "ServerState.connections holds the protocols", "serve/single.py"
        )
        proto.shutdown()

    asyncio.run(main())


#: ``H11Protocol`` instance attributes http/limits.py reads (``LimitedH11Protocol._sync``,
#: the limits mixin).
H11_CONNECTION_ATTRS = ["conn", "cycle", "transport", "server_state", "loop", "client"]


def test_h11_connection_attributes():
    import h11

    async def main():
        config = uvicorn.Config(lambda *a: None, http="h11", ws="none", lifespan="off")
        config.load()
        proto = h11_impl.H11Protocol(
            config=config,
            server_state=ServerState(),
            app_state={},
            _loop=asyncio.get_running_loop(),
        )
        proto.connection_made(Recorder())
        for name in H11_CONNECTION_ATTRS:
            assert hasattr(proto, name), moved(f"H11Protocol().{name}", "http/limits.py")
        assert isinstance(proto.conn, h11.Connection) and proto.conn.their_state is h11.IDLE, moved(
            "H11Protocol().conn (an h11.Connection: their_state read)", "http/limits.py"
        )
        proto.shutdown()

    asyncio.run(main())


def test_config_takes_a_protocol_class_as_http():
    cls = protocol_class(HttpLimits(), "httptools")
    config = uvicorn.Config(lambda *a: None, http=cls, ws="none", lifespan="off")
    config.load()
    assert config.http_protocol_class is cls, moved(
        "uvicorn.Config(http=<protocol class>) -> http_protocol_class", "serve/single.py"
    )


def test_server_and_its_lifespan():
    config = _app_config()
    server = uvicorn.Server(config)
    for name in SERVER_METHODS:
        assert callable(getattr(server, name, None)), moved(
            f"uvicorn.Server.{name}()", "serve/single.py"
        )
    for name in SERVER_ATTRS:
        assert hasattr(server, name), moved(
            f"uvicorn.Server().{name}", "serve/single.py, serve/worker.py"
        )
    source = inspect.getsource(uvicorn.Server)
    for name in SERVER_STARTUP_ATTRS:
        assert f"self.{name} =" in source, moved(
            f"uvicorn.Server.{name} (set by startup)", "serve/single.py, serve/owner.py"
        )
    lifespan = config.lifespan_class(config)  # what Server sets as its lifespan
    for name in LIFESPAN_ATTRS:
        assert hasattr(lifespan, name), moved(f"Server.lifespan.{name}", "serve/single.py")
    assert inspect.signature(uvicorn.Server.on_tick).parameters.keys() >= {"counter"}, moved(
        "Server.on_tick(counter)", "serve/single.py (heap trim)"
    )


def test_config_keywords_and_attributes():
    params = inspect.signature(uvicorn.Config.__init__).parameters
    for name in CONFIG_KWARGS:
        assert name in params, moved(f"uvicorn.Config({name}=...)", "serve/single.py")
    config = _app_config()
    for name in CONFIG_ATTRS:
        assert hasattr(config, name), moved(f"uvicorn.Config().{name}", "serve/single.py")
    assert isinstance(config.loop, str), moved(
        "Config.loop (a name: serve/single.py's run_in_loop reads it)", "serve/single.py"
    )


# -- no private uvicorn module, and the range declared once ----------------------------------


def test_no_private_uvicorn_module_is_imported():
    private = []
    for path in (ROOT / "kvconductor").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] in ("uvicorn", "httptools") and any(p.startswith("_") for p in parts):
                    private.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert not private, f"imports of private uvicorn/httptools modules: {private}"


def _requirement(deps: list[str], name: str) -> str:
    for dep in deps:
        if re.match(rf"{name}(\[[^\]]*\])?[<>=!~ ]", dep):
            return dep
    raise AssertionError(f"{name} not among the dependencies of pyproject.toml")


def test_pyproject_declares_the_tested_ranges():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for name, (lo, hi) in (
        ("uvicorn", fence.UVICORN_RANGE),
        ("httptools", fence.HTTPTOOLS_RANGE),
    ):
        spec = _requirement(deps, name)
        assert f">={lo}" in spec and f"<{hi}" in spec, (
            f"pyproject.toml declares {spec!r}; kvconductor/http/fence.py tests "
            f">={lo},<{hi}: keep the two the same"
        )
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"uvicorn=={fence.UVICORN_RANGE[0]}" in ci, (
        ".ci/run must run the HTTP tests on the lower bound of UVICORN_RANGE"
    )


def test_the_running_uvicorn_is_in_the_tested_range():
    assert fence.outside_tested_range() is None, (
        f"{fence.outside_tested_range()}: run the HTTP tests on it and move the bound "
        "(kvconductor/http/fence.py and pyproject.toml), or install a tested release"
    )


@pytest.mark.parametrize(
    ("version", "inside"),
    [
        ("0.30.5", False),
        ("0.30.6", True),
        ("0.55.0", True),
        ("0.55.9rc1", True),
        ("0.56.0", False),
        ("1.0", False),
        ("0.29", False),
    ],
)
def test_in_range(version, inside):
    assert fence.in_range(version, fence.UVICORN_RANGE) is inside


# -- --query-path ----------------------------------------------------------------------------


@pytest.fixture
def fresh_query_path():
    fence.query_path.cache_clear()
    yield
    fence.query_path.cache_clear()


def test_outside_the_range_protocol_falls_back_to_asgi_with_one_warning(
    monkeypatch, caplog, fresh_query_path
):
    monkeypatch.setattr(uvicorn, "__version__", "0.60.0")
    with caplog.at_level(logging.WARNING, logger="kvconductor"):
        assert fence.query_path("protocol") == "asgi"
        assert fence.query_path("protocol") == "asgi"
        assert Settings(query_path="protocol").query_path_used() == "asgi"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "uvicorn 0.60.0" in warnings[0] and "query_path=asgi" in warnings[0]
    assert "query_path=asgi" in Settings().describe()


def test_inside_the_range_protocol_stays(caplog, fresh_query_path):
    with caplog.at_level(logging.WARNING, logger="kvconductor"):
        assert Settings().query_path_used() == "protocol"
        assert Settings(query_path="asgi").query_path_used() == "asgi"
    assert not caplog.records
    assert "query_path=protocol" in Settings().describe()


def test_asgi_query_path_builds_a_protocol_without_the_direct_answers(fresh_query_path):
    limits = HttpLimits()
    assert issubclass(protocol_class(limits, "httptools"), DirectQueries)
    plain = protocol_class(limits, "httptools", direct=False)
    assert not issubclass(plain, DirectQueries)
    assert issubclass(plain, httptools_impl.HttpToolsProtocol)

    async def app(scope, receive, send):  # pragma: no cover (never called)
        pass

    for path, direct in (("protocol", True), ("asgi", False)):
        config = uvicorn_config(app, Settings(no_snapshots=True, query_path=path))
        assert issubclass(config.http, DirectQueries) is direct


def _query_through(srv) -> list[tuple[int, bytes, list[str]]]:
    """Register, store 8 blocks, then query them (JSON and msgpack, a hit and a miss, a bad
    body): (status, body, header names) of each query."""
    tokens = list(range(100, 132))
    r = srv.http.post("/register", json=registration("e1"))
    assert r.status_code == 201, r.text
    ev = {"instance_id": "e1", "events": [stored(1, list(range(7001, 7009)), tokens)]}
    assert srv.http.post("/events", json=ev).status_code == 200
    out = []
    for body, ctype in (
        (
            json.dumps({"model": "qwen", "block_size": 4, "token_ids": tokens}).encode(),
            "application/json",
        ),
        (
            json.dumps({"model": "qwen", "block_size": 4, "token_ids": [1, 2, 3, 4]}).encode(),
            "application/json",
        ),
        (b'{"model": "qwen", "block_size": 4, "token_ids": [1,', "application/json"),
        (json.dumps({"block_size": 4, "token_ids": tokens}).encode(), "application/json"),
    ):
        r = srv.http.post("/query", content=body, headers={"content-type": ctype})
        names = sorted(k.lower() for k in r.headers if k.lower() not in ("date",))
        out.append((r.status_code, r.content, names))
    return out


@pytest.mark.server
def test_query_path_asgi_serves_query_as_the_protocol_does(tmp_path):
    answers = {}
    for path in ("protocol", "asgi"):
        with running(tmp_path, "--host", "127.0.0.1", "--query-path", path) as srv:
            answers[path] = _query_through(srv)
            log = srv.log()
        start = [line for line in log.splitlines() if "KV conductor starting on" in line]
        assert len(start) == 1 and f"query_path={path}" in start[0], log
    assert [a[0] for a in answers["protocol"]][:2] == [200, 200], answers["protocol"]
    assert answers["asgi"] == answers["protocol"]


def test_ci_runs_the_http_tests_on_the_lower_bound():
    text = (ROOT / ".ci" / "run").read_text()
    block = text[text.index(f"uvicorn=={fence.UVICORN_RANGE[0]}") :]
    for test in ("tests/test_direct.py", "tests/test_server.py", "tests/test_uvicorn_fence.py"):
        assert test in block, f".ci/run's lower-bound step does not run {test}"


def test_no_other_module_names_a_uvicorn_release():
    # the range lives in one module; nothing else in kvconductor/ names a uvicorn version
    hits = []
    for path in (ROOT / "kvconductor").rglob("*.py"):
        if path.name == "fence.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"uvicorn[^\n]*\b0\.\d\d+\.\d", line) and "fence" not in line:
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, hits
