"""Publishers' own code, loaded from their installed PyPI wheels without their GPU stacks.

vLLM 0.33.0's wheel is not installed (its dependencies include torch): :func:`vllm_kv_events`
takes the one module it needs, ``vllm/distributed/kv_events.py``, from an installed
``vllm==0.33.0`` if there is one, else from the released wheel, fetched once per test
session with ``pip download --no-deps`` (336 MB; pip's cache keeps it) and read from the
zip, never installed. Importing ``vllm.distributed.kv_events`` the normal way would run
``vllm/__init__.py``, which imports torch; so that module file is executed on its own,
with its four imports that do not shape the bytes on the wire replaced:

* ``vllm.config.kv_events.KVEventsConfig``: the publisher's record of its own settings
  (``get_publisher_config``), vLLM's own (:func:`kv_config`), its ``vllm.config.utils.config``
  decorator rewritten (that module imports torch);
* ``vllm.logger.init_logger``: :func:`logging.getLogger`;
* ``vllm.utils.network_utils``: vLLM's own, from the same wheel (it binds ``tcp://*:0`` on
  the node's IP, ``VLLM_HOST_IP`` here ``127.0.0.1``), with ``psutil`` and ``vllm.envs``
  stubbed;
* ``vllm.v1.core.kv_cache_utils.ExternalBlockHash``: ``bytes | int``, its definition in
  vLLM 0.33.0.

:func:`vllm_route` gives what vLLM's API server answers on ``GET /kv_event_sources``
(``vllm/entrypoints/serve/instrumentator/basic.py`` and its ``KVEventsConfig``, a pydantic
dataclass as ``vllm.config.utils.config`` makes it; FastAPI stubbed).

Everything that encodes and sends (the event structs, ``KVEventBatch``,
``ZmqEventPublisher``) is vLLM's code as released. Outside CI a wheel that cannot be had
(no network to the package index) skips the tests that need it; in CI (``CI=true``) it
fails them.
"""

from __future__ import annotations

import ast
import glob
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import types
import typing
import zipfile

import pytest

VLLM_VERSION = "0.33.0"


def _need(what: str, why: str):
    msg = f"{what} cannot be had ({why})"
    if os.environ.get("CI") == "true":
        pytest.fail(msg)
    pytest.skip(msg)


def _stub(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


_VLLM: types.ModuleType | None = None

#: The modules of the wheel the helpers read (one download for all of them).
_MODULES = (
    "vllm/distributed/kv_events.py",
    "vllm/utils/network_utils.py",
    "vllm/config/kv_events.py",
    "vllm/entrypoints/serve/instrumentator/basic.py",
    "vllm/v1/core/kv_cache_utils.py",  # vllm_block_hashing
    "vllm/utils/hashing.py",
)
_SOURCES: dict[str, tuple[str, str]] = {}


def _wheel_sources() -> dict[str, tuple[str, str]]:
    """The text of each of vLLM 0.33.0's :data:`_MODULES` and where it came from: the
    installed distribution, else the wheel downloaded (not installed) into a temporary
    directory."""
    try:
        dist = importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None and dist.version == VLLM_VERSION:
        out = {}
        for m in _MODULES:
            path = str(dist.locate_file(m))
            with open(path, encoding="utf-8") as f:
                out[m] = (f.read(), path)
        return out
    with tempfile.TemporaryDirectory(prefix="kvc-vllm-wheel-") as d:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        cmd += ["--only-binary=:all:", f"vllm=={VLLM_VERSION}", "-d", d]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            _need(f"vllm=={VLLM_VERSION}", "pip download timed out")
        wheels = glob.glob(os.path.join(d, "vllm-*.whl"))
        if r.returncode or not wheels:
            _need(f"vllm=={VLLM_VERSION}", f"pip download failed: {r.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[0]) as z:
            name = os.path.basename(wheels[0])
            return {m: (z.read(m).decode("utf-8"), f"{name}/{m}") for m in _MODULES}


def wheel_source(module: str) -> tuple[str, str]:
    """One of :data:`_MODULES`: its text and where it came from."""
    if not _SOURCES:
        _SOURCES.update(_wheel_sources())
    return _SOURCES[module]


def _execute(module: str, name: str, stubs: dict[str, types.ModuleType]) -> types.ModuleType:
    """Execute ``module`` of the wheel on its own as ``name``, with ``stubs`` in
    ``sys.modules`` while it runs (put back as they were after)."""
    source, path = wheel_source(module)
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        mod = types.ModuleType(name)
        mod.__file__ = path
        sys.modules[mod.__name__] = mod  # dataclasses and msgspec look their module up
        exec(compile(source, path, "exec"), mod.__dict__)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod


_LOGGER = {"vllm.logger": _stub("vllm.logger", init_logger=logging.getLogger)}


def _network_utils() -> types.ModuleType:
    envs = _stub("vllm.envs", VLLM_HOST_IP="127.0.0.1", VLLM_RPC_BASE_PATH=tempfile.gettempdir())
    stubs = {"vllm": _stub("vllm", __path__=[], envs=envs), "vllm.envs": envs, **_LOGGER}
    if importlib.util.find_spec("psutil") is None:
        stubs["psutil"] = _stub("psutil")
    return _execute("vllm/utils/network_utils.py", "vllm_0_33_network_utils", stubs)


def vllm_kv_events() -> types.ModuleType:
    """vLLM 0.33.0's ``vllm/distributed/kv_events.py``, executed from the installed wheel."""
    global _VLLM
    if _VLLM is not None:
        return _VLLM
    stubs = {
        "vllm": _stub("vllm", __path__=[]),
        "vllm.config": _stub("vllm.config", __path__=[]),
        "vllm.config.kv_events": _stub("vllm.config.kv_events", KVEventsConfig=kv_config()),
        **_LOGGER,
        "vllm.utils": _stub("vllm.utils", __path__=[]),
        "vllm.utils.network_utils": _network_utils(),
        "vllm.v1": _stub("vllm.v1", __path__=[]),
        "vllm.v1.core": _stub("vllm.v1.core", __path__=[]),
        "vllm.v1.core.kv_cache_utils": _stub(
            "vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int
        ),
    }
    _VLLM = _execute("vllm/distributed/kv_events.py", "vllm_0_33_kv_events", stubs)
    return _VLLM


def _vllm_config(cls=None, *, config=None, **kwargs):
    """``vllm.config.utils.config`` as vLLM 0.33.0 defines it (its module imports torch):
    a pydantic dataclass that forbids extra fields."""
    from pydantic import ConfigDict
    from pydantic.dataclasses import dataclass

    merged = ConfigDict(extra="forbid")
    if config is not None:
        merged.update(config)

    def decorator(c):
        return dataclass(c, config=merged, **kwargs)

    return decorator if cls is None else decorator(cls)


_KV_CONFIG: type | None = None


def kv_config() -> type:
    """vLLM 0.33.0's ``KVEventsConfig`` (``vllm/config/kv_events.py``): the publisher's
    record of its own settings, what ``get_publisher_config()`` returns."""
    global _KV_CONFIG
    if _KV_CONFIG is None:
        stubs = {"vllm.config.utils": _stub("vllm.config.utils", config=_vllm_config)}
        mod = _execute("vllm/config/kv_events.py", "vllm_0_33_config_kv_events", stubs)
        _KV_CONFIG = mod.KVEventsConfig
    return _KV_CONFIG


class _Router:
    """FastAPI's ``APIRouter`` as far as the route module uses it: its decorators."""

    def get(self, path: str):
        return lambda fn: fn


_ROUTE: tuple | None = None


def vllm_route() -> tuple:
    """``(KVEventsConfig, render)``: vLLM 0.33.0's config class, and ``render(sources)``,
    the body its API server answers on ``GET /kv_event_sources`` for an engine client
    whose ``get_kv_event_sources()`` is ``sources`` (DP rank -> ``KVEventsConfig``): the
    route function of ``basic.py`` called, its value serialized as FastAPI does (pydantic)."""
    global _ROUTE
    if _ROUTE is not None:
        return _ROUTE
    import asyncio

    from pydantic import TypeAdapter

    kv_cfg = kv_config()
    fastapi = _stub("fastapi", APIRouter=_Router, Request=object)
    stubs = {
        "fastapi": fastapi,
        "fastapi.responses": _stub("fastapi.responses", JSONResponse=dict),
        "vllm": _stub("vllm", __path__=[]),
        "vllm.engine": _stub("vllm.engine", __path__=[]),
        "vllm.engine.protocol": _stub("vllm.engine.protocol", EngineClient=object),
        "vllm.entrypoints": _stub("vllm.entrypoints", __path__=[]),
        "vllm.entrypoints.serve": _stub("vllm.entrypoints.serve", __path__=[]),
        "vllm.entrypoints.serve.tokenize": _stub("vllm.entrypoints.serve.tokenize", __path__=[]),
        "vllm.entrypoints.serve.tokenize.serving": _stub(
            "vllm.entrypoints.serve.tokenize.serving", ServingTokenization=object
        ),
        **_LOGGER,
        "vllm.version": _stub("vllm.version", __version__=VLLM_VERSION),
    }
    basic = _execute(
        "vllm/entrypoints/serve/instrumentator/basic.py", "vllm_0_33_serve_basic", stubs
    )
    body_of = TypeAdapter(dict[int, kv_cfg])

    def render(sources: dict) -> bytes:
        client = types.SimpleNamespace(get_kv_event_sources=lambda: dict(sources))
        request = types.SimpleNamespace(
            app=types.SimpleNamespace(state=types.SimpleNamespace(engine_client=client))
        )
        return body_of.dump_json(asyncio.run(basic.kv_event_sources(request)))

    _ROUTE = (kv_cfg, render)
    return _ROUTE


#: The functions of vLLM's block hashing :func:`vllm_block_hashing` takes from its source.
HASHING_FUNCTIONS = (
    "_gen_mm_extra_hash_keys",
    "_gen_lora_extra_hash_keys",
    "_gen_prompt_embeds_extra_hash_keys",
    "generate_block_hash_extra_keys",
    "to_event_extra_keys",
    "hash_block_tokens",
)


def _functions(module: str, names: tuple[str, ...], namespace: dict) -> None:
    """Execute the top-level functions ``names`` of vLLM's ``module`` (their own source,
    nothing else of the module) in ``namespace``."""
    source, path = wheel_source(module)
    tree = ast.parse(source, path)
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert sorted(n.name for n in defs) == sorted(names), path
    exec(compile(ast.Module(body=defs, type_ignores=[]), path, "exec"), namespace)


def vllm_block_hashing() -> types.SimpleNamespace:
    """vLLM 0.33.0's block hashing (``vllm/v1/core/kv_cache_utils.py``): the extra keys of
    a block (multimodal inputs with their offsets, LoRA, cache_salt), the event's untagged
    form of them and ``hash_block_tokens``, as released, over ``vllm.utils.hashing.sha256``
    (vLLM's own too); ``NONE_HASH`` from its default seed as ``init_none_hash`` derives it.
    The module itself imports torch and vLLM's config: only these functions are taken from
    its source and executed, with what they name (``Any``, ``BlockHash``, ``hashlib``)."""
    ns: dict = {"__name__": "vllm_0_33_kv_cache_utils", "Any": typing.Any, "hashlib": hashlib}
    ns["pickle"] = pickle
    ns["BlockHash"] = bytes  # NewType("BlockHash", bytes)
    ns["tensor_data"] = None  # prompt embeds only: not used here
    _functions("vllm/utils/hashing.py", ("sha256",), ns)
    _functions("vllm/v1/core/kv_cache_utils.py", HASHING_FUNCTIONS, ns)
    ns["NONE_HASH"] = ns["sha256"]("vllm-none-hash")  # DEFAULT_NONE_HASH_SEED
    return types.SimpleNamespace(**{k: v for k, v in ns.items() if not k.startswith("__")})
