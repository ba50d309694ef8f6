"""The I/O shells of the Coordinator client: :class:`ConductorClient` (sync, one
``httpx.Client`` and its connection pool) and :class:`AsyncConductorClient`
(``httpx.AsyncClient``). Both are context managers; close them when done.

Everything but sending lives in :class:`~kvconductor.coordinator.core.ConductorCore`:
each route method here runs the core's plan of the same name (``query`` runs
``query_plan``) and does nothing but the HTTP exchanges the plan asks for.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import ssl
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

import httpx

from kvconductor.coordinator.core import ConductorCore
from kvconductor.coordinator.exchange import (
    Plan,
    Reply,
    Request,
    TransportFailure,
    omitted_header,
    resume,
)
from kvconductor.schema import TOP_K_OMITTED_HEADER

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["ConductorClient", "AsyncConductorClient", "tls_verify"]

P = ParamSpec("P")
T = TypeVar("T")


def tls_verify(verify: Any = True, cert: Any = None) -> Any:
    """The ``verify=`` for httpx of a ``verify`` and a client ``cert``.

    ``verify``: ``True`` (the default CAs), ``False``, a CA bundle path or an
    ``ssl.SSLContext``. ``cert``: a PEM file holding the client certificate and
    key, or ``(cert_file, key_file)`` / ``(cert_file, key_file, password)``, for
    a server started with ``--tls-client-ca``. httpx 0.28 deprecates its own
    ``cert=`` and string ``verify=``, so both become one ``SSLContext`` here.
    """
    if cert is None and not isinstance(verify, (str, os.PathLike)):
        return verify
    if isinstance(verify, ssl.SSLContext):
        ctx = verify
    elif verify is False:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif isinstance(verify, (str, os.PathLike)):
        path = os.fspath(verify)
        ctx = (
            ssl.create_default_context(capath=path)
            if os.path.isdir(path)
            else ssl.create_default_context(cafile=path)
        )
    else:
        try:
            import certifi  # what httpx trusts by default

            ctx = ssl.create_default_context(cafile=certifi.where())
        except ImportError:  # pragma: no cover
            ctx = ssl.create_default_context()
    if cert is not None:
        if isinstance(cert, (str, os.PathLike)):
            ctx.load_cert_chain(cert)
        else:
            ctx.load_cert_chain(*cert)
    return ctx


def _http_options(
    core: ConductorCore, pool_size: int, transport: Any, trust_env: bool, verify: Any, cert: Any
) -> dict[str, Any]:
    """The keyword arguments of ``httpx.Client``/``httpx.AsyncClient`` for a client."""
    return {
        "base_url": core.base_url,
        "limits": httpx.Limits(
            max_connections=pool_size, max_keepalive_connections=pool_size, keepalive_expiry=30.0
        ),
        "timeout": core.register_timeout,
        "transport": transport,
        "trust_env": trust_env,
        "verify": tls_verify(verify, cert),
        "headers": core.default_headers,
    }


HttpT = TypeVar("HttpT", httpx.Client, httpx.AsyncClient)
TransportT = TypeVar("TransportT", httpx.BaseTransport, httpx.AsyncBaseTransport)


class _Shell(ConductorCore, Generic[HttpT, TransportT]):
    """What the sync and async shells share: their construction, one ``httpx`` client of
    the options :func:`_http_options` reads (the parameters: :class:`ConductorClient`)."""

    def __init__(
        self,
        base_url: str,
        *,
        pool_size: int = 32,
        transport: TransportT | None = None,
        trust_env: bool = False,
        verify: Any = True,
        cert: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(base_url, **options)
        self._http: HttpT = self._open(
            _http_options(self, pool_size, transport, trust_env, verify, cert)
        )

    def _open(self, options: dict[str, Any]) -> HttpT:
        """The shell's ``httpx`` client of ``options``."""
        raise NotImplementedError


def _request_options(req: Request) -> dict[str, Any]:
    return {"content": req.content, "headers": req.headers, "timeout": req.timeout}


def _reply(resp: httpx.Response) -> Reply:
    headers = resp.headers
    return Reply(
        resp.status_code,
        headers.get("content-type", ""),
        resp.content,
        omitted_header(headers.get(TOP_K_OMITTED_HEADER)),
    )


def _failure(exc: httpx.HTTPError) -> TransportFailure:
    return TransportFailure(exc, isinstance(exc, httpx.TimeoutException))


def _route(plan: Callable[..., Any], method: Callable[..., Any]) -> Any:
    """``method`` under the name (``query_plan`` -> ``query``) and docstring of ``plan``."""
    functools.update_wrapper(method, plan)
    method.__name__ = method.__qualname__ = plan.__name__.removesuffix("_plan")
    method.__module__ = __name__
    sig = inspect.signature(plan)
    result = sig.return_annotation  # "Plan[dict]": the method returns (or awaits) a dict
    if isinstance(result, str) and result.startswith("Plan[") and result.endswith("]"):
        method.__signature__ = sig.replace(return_annotation=result[5:-1])  # type: ignore[attr-defined]
    return method


def _sync(
    plan: Callable[Concatenate[ConductorCore, P], Plan[T]],
) -> Callable[Concatenate[Any, P], T]:
    def method(self: ConductorClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(plan(self, *args, **kwargs))

    return _route(plan, method)


def _async(
    plan: Callable[Concatenate[ConductorCore, P], Plan[T]],
) -> Callable[Concatenate[Any, P], Awaitable[T]]:
    async def method(self: AsyncConductorClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._run(plan(self, *args, **kwargs))

    return _route(plan, method)


class ConductorClient(_Shell[httpx.Client, httpx.BaseTransport]):
    """Synchronous conductor client over one pooled ``httpx.Client``.

    ``base_url``: ``http://host:13333`` (IPv6: ``http://[::1]:13333``; see
    :func:`conductor_base_url`). ``query_encoding``: ``"msgpack"`` (default)
    or ``"json"``; anything else logs a warning and uses msgpack.
    ``packed``: send ``token_ids`` as a msgpack bin of little-endian u32
    (needs msgpack). ``transport``: an ``httpx`` transport (tests).
    ``trust_env`` is off by default so proxy variables cannot capture
    cluster-internal traffic. ``clock`` drives the breaker (tests).
    ``api_key``: sent as ``Authorization: Bearer <key>`` (a server started
    with ``--api-key`` requires it on ``/register``, ``/unregister``, ``/events``,
    ``/predict`` and ``/workers``). ``verify`` / ``cert``: for an HTTPS server (``--tls-cert``;
    ``cert`` for ``--tls-client-ca``), see :func:`tls_verify`.
    """

    def _open(self, options: dict[str, Any]) -> httpx.Client:
        return httpx.Client(**options)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, plan: Plan[T]) -> T:
        more, step = resume(plan)
        with contextlib.closing(plan):  # cancelled or interrupted: the plan frees its breaker slot
            while more:
                more, step = resume(plan, self._send(step))
        return step

    def _send(self, req: Request) -> Reply | TransportFailure:
        try:
            return _reply(self._http.request(req.method, req.path, **_request_options(req)))
        except httpx.HTTPError as exc:
            return _failure(exc)

    health = _sync(ConductorCore.health_plan)
    register = _sync(ConductorCore.register_plan)
    unregister = _sync(ConductorCore.unregister_plan)
    query = _sync(ConductorCore.query_plan)
    query_or_empty = _sync(ConductorCore.query_or_empty_plan)
    query_by_hash = _sync(ConductorCore.query_by_hash_plan)
    workers = _sync(ConductorCore.workers_plan)
    post_events = _sync(ConductorCore.post_events_plan)
    predict = _sync(ConductorCore.predict_plan)
    registered_services = _sync(ConductorCore.registered_services_plan)
    reregister_missing = _sync(ConductorCore.reregister_missing_plan)


class AsyncConductorClient(_Shell[httpx.AsyncClient, httpx.AsyncBaseTransport]):
    """``asyncio`` twin of :class:`ConductorClient` over one ``httpx.AsyncClient``."""

    def _open(self, options: dict[str, Any]) -> httpx.AsyncClient:
        return httpx.AsyncClient(**options)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self, plan: Plan[T]) -> T:
        more, step = resume(plan)
        with contextlib.closing(plan):
            while more:
                more, step = resume(plan, await self._send(step))
        return step

    async def _send(self, req: Request) -> Reply | TransportFailure:
        try:
            return _reply(await self._http.request(req.method, req.path, **_request_options(req)))
        except httpx.HTTPError as exc:
            return _failure(exc)

    health = _async(ConductorCore.health_plan)
    register = _async(ConductorCore.register_plan)
    unregister = _async(ConductorCore.unregister_plan)
    query = _async(ConductorCore.query_plan)
    query_or_empty = _async(ConductorCore.query_or_empty_plan)
    query_by_hash = _async(ConductorCore.query_by_hash_plan)
    workers = _async(ConductorCore.workers_plan)
    post_events = _async(ConductorCore.post_events_plan)
    predict = _async(ConductorCore.predict_plan)
    registered_services = _async(ConductorCore.registered_services_plan)
    reregister_missing = _async(ConductorCore.reregister_missing_plan)
