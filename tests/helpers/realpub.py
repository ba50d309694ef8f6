"""Publishers' own code, loaded from their installed PyPI wheels without their GPU stacks.

vLLM 0.33.0 is installed by ``.ci/run`` with ``pip install --no-deps vllm==0.33.0`` (its
dependencies include torch). Importing ``vllm.distributed.kv_events`` the normal way runs
``vllm/__init__.py``, which imports torch; so :func:`vllm_kv_events` executes that one
module file from the installed distribution, with its four imports that do not shape the
bytes on the wire replaced:

* ``vllm.config.kv_events.KVEventsConfig``: the publisher's record of its own settings
  (``get_publisher_config``), a plain attribute holder here;
* ``vllm.logger.init_logger``: :func:`logging.getLogger`;
* ``vllm.utils.network_utils``: only used to bind ``tcp://*:0`` (not used by the tests);
* ``vllm.v1.core.kv_cache_utils.ExternalBlockHash``: ``bytes | int``, its definition in
  vLLM 0.33.0.

Everything that encodes and sends (the event structs, ``KVEventBatch``,
``ZmqEventPublisher``) is vLLM's code as released. Outside CI a missing wheel skips the
tests that need it; in CI (``CI=true``) it fails them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import sys
import types

import pytest

VLLM_VERSION = "0.33.0"


def _need(what: str, why: str):
    msg = f"{what} is not installed ({why}); .ci/run installs it"
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


def vllm_kv_events() -> types.ModuleType:
    """vLLM 0.33.0's ``vllm/distributed/kv_events.py``, executed from the installed wheel."""
    global _VLLM
    if _VLLM is not None:
        return _VLLM
    try:
        dist = importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        _need(f"vllm=={VLLM_VERSION}", "pip install --no-deps")
    if dist.version != VLLM_VERSION:
        _need(f"vllm=={VLLM_VERSION}", f"found {dist.version}")
    path = str(dist.locate_file("vllm/distributed/kv_events.py"))
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
        spec = importlib.util.spec_from_file_location("vllm_0_33_kv_events", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    _VLLM = mod
    return mod
