"""Publishers' own code, loaded from their installed PyPI wheels without their GPU stacks.

vLLM 0.33.0's wheel is not installed (its dependencies include torch): :func:`vllm_kv_events`
takes the one module it needs, ``vllm/distributed/kv_events.py``, from an installed
``vllm==0.33.0`` if there is one, else from the released wheel, fetched once per test
session with ``pip download --no-deps`` (336 MB; pip's cache keeps it) and read from the
zip, never installed. Importing ``vllm.distributed.kv_events`` the normal way would run
``vllm/__init__.py``, which imports torch; so that module file is executed on its own,
with its four imports that do not shape the bytes on the wire replaced:

* ``vllm.config.kv_events.KVEventsConfig``: the publisher's record of its own settings
  (``get_publisher_config``), a plain attribute holder here;
* ``vllm.logger.init_logger``: :func:`logging.getLogger`;
* ``vllm.utils.network_utils``: only used to bind ``tcp://*:0`` (not used by the tests);
* ``vllm.v1.core.kv_cache_utils.ExternalBlockHash``: ``bytes | int``, its definition in
  vLLM 0.33.0.

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


class _Config:
    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


_VLLM: types.ModuleType | None = None


_MODULE = "vllm/distributed/kv_events.py"
#: vLLM's block hashing (:func:`vllm_block_hashing`): its functions, read from the source.
_HASHING = "vllm/v1/core/kv_cache_utils.py"
_HASH_FN = "vllm/utils/hashing.py"
_SOURCES: dict[str, tuple[str, str]] = {}


def _kv_events_source(module: str = _MODULE) -> tuple[str, str]:
    """The text of one of vLLM 0.33.0's modules (``kv_events.py`` by default) and where it
    came from: the installed distribution, else the wheel downloaded (not installed) into a
    temporary directory, once per session for the modules the tests read."""
    if module in _SOURCES:
        return _SOURCES[module]
    try:
        dist = importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None and dist.version == VLLM_VERSION:
        path = str(dist.locate_file(module))
        with open(path, encoding="utf-8") as f:
            return f.read(), path
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
            for m in (_MODULE, _HASHING, _HASH_FN):
                _SOURCES[m] = (z.read(m).decode("utf-8"), f"{os.path.basename(wheels[0])}/{m}")
    return _SOURCES[module]


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
    source, path = _kv_events_source(module)
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
    _functions(_HASH_FN, ("sha256",), ns)
    _functions(_HASHING, HASHING_FUNCTIONS, ns)
    ns["NONE_HASH"] = ns["sha256"]("vllm-none-hash")  # DEFAULT_NONE_HASH_SEED
    return types.SimpleNamespace(**{k: v for k, v in ns.items() if not k.startswith("__")})


def vllm_kv_events() -> types.ModuleType:
    """vLLM 0.33.0's ``vllm/distributed/kv_events.py``, executed from the installed wheel."""
    global _VLLM
    if _VLLM is not None:
        return _VLLM
    source, path = _kv_events_source()
    stubs = {
        "vllm": _stub("vllm", __path__=[]),
        "vllm.config": _stub("vllm.config", __path__=[]),
        "vllm.config.kv_events": _stub("vllm.config.kv_events", KVEventsConfig=_Config),
        "vllm.logger": _stub("vllm.logger", init_logger=logging.getLogger),
        "vllm.utils": _stub("vllm.utils", __path__=[]),
        "vllm.utils.network_utils": _stub(
            "vllm.utils.network_utils",
            get_ip=None,
            get_tcp_uri=None,
            is_valid_ipv6_address=None,
            split_zmq_path=None,
        ),
        "vllm.v1": _stub("vllm.v1", __path__=[]),
        "vllm.v1.core": _stub("vllm.v1.core", __path__=[]),
        "vllm.v1.core.kv_cache_utils": _stub(
            "vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int
        ),
    }
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        mod = types.ModuleType("vllm_0_33_kv_events")
        mod.__file__ = path
        sys.modules[mod.__name__] = mod  # dataclasses and msgspec look their module up
        exec(compile(source, path, "exec"), mod.__dict__)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    _VLLM = mod
    return mod
