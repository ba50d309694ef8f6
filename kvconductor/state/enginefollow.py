"""Engines followed from their URL: a registration with ``engine_url`` is read again when
its subscriptions stay disconnected (docs/engines.md, "Registration from the engine's
URL").

An engine whose publishers bind port 0 comes back from a restart on new ports; the
registration's URLs then point at nothing. :class:`EngineFollower`, a thread of its own
(never the ingest thread, never the HTTP event loop), looks every :data:`TICK_SECS` at
each registered DP with an ``engine_url``: when none of its subscriptions has been
connected for :data:`REREAD_AFTER_SECS` it reads ``<engine_url>/kv_event_sources`` again
(:mod:`kvconductor.state.engineroute`), at most every :data:`BACKOFF_MIN_SECS` doubling
to :data:`BACKOFF_MAX_SECS` while nothing changes, and when the DP's publisher moved it
registers the DP again on the new endpoints, through the journal as ``POST /register``
does (so ``--workers N``'s owner and every ``--state-url`` replica apply the same). The
registration path treats the move as a restart of the publisher
(:func:`kvconductor.state.registration.register`). At start every such DP is read once
(after a restart, the registrations of a snapshot are of the engine's last
incarnation).

How the last read went is the DP's ``engine_url_state`` in ``/workers``: ``ok``,
``rereading`` (down, the engine still lists the same endpoints), ``error`` (with
``engine_url_error``: why the read or the registration failed).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvconductor.schema import RegisterRequest
from kvconductor.state.conductor import StateUnavailable
from kvconductor.state.dump import registration_request
from kvconductor.state.engineroute import (
    EngineRouteError,
    RankSource,
    read_sources,
    registrations_from,
)
from kvconductor.state.registration import RegistrationUnavailable
from kvconductor.state.registry import EndpointInfo, RegistrationError, WorkerEntry

if TYPE_CHECKING:
    from kvconductor.state.conductor import Conductor

__all__ = [
    "BACKOFF_MAX_SECS",
    "BACKOFF_MIN_SECS",
    "REREAD_AFTER_SECS",
    "TICK_SECS",
    "EngineFollower",
]

log = logging.getLogger("kvconductor")

#: Period of the follower's look at the registrations.
TICK_SECS = 0.5
#: Seconds a DP's subscriptions are all disconnected before its engine URL is read again.
REREAD_AFTER_SECS = 2.0
#: The wait between reads of one DP while it stays down: doubled up to the maximum.
BACKOFF_MIN_SECS = 1.0
BACKOFF_MAX_SECS = 5.0

#: (instance_id, dp_rank).
DpKey = tuple[str, int]


@dataclass
class _Watch:
    """One DP's follow-up (follower thread): since when it is down, its next read (None:
    none planned), the wait after that one."""

    next_read: float | None
    down_since: float | None = None
    backoff: float = BACKOFF_MIN_SECS

    def reset(self) -> None:
        self.next_read = self.down_since = None
        self.backoff = BACKOFF_MIN_SECS


@dataclass(frozen=True)
class _Due:
    key: DpKey
    engine_url: str
    down: bool


class EngineFollower:
    """The thread that follows registered engines to their new endpoints (module
    docstring). :meth:`start` once the conductor runs, :meth:`stop` before it stops."""

    def __init__(self, conductor: Conductor, *, tick: float = TICK_SECS) -> None:
        self.conductor = conductor
        self.tick = tick
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._main, name="kv-engine-url", daemon=True)
        #: Follower thread only.
        self._watches: dict[DpKey, _Watch] = {}

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.step(time.monotonic())
            except Exception:  # the follower goes on; the next look tries again
                log.exception("engine URL follower: look failed")
            await asyncio.sleep(self.tick)

    async def step(self, now: float) -> None:
        """One look: the DPs due for a read are read (one read per engine URL) and
        registered again where their publisher moved."""
        looked = await self.conductor.run(self._look)
        due: list[_Due] = []
        back: list[_Due] = []
        for key, (url, down) in looked.items():
            w = self._watches.get(key)
            if w is None:
                w = self._watches[key] = _Watch(next_read=now)  # read once when first seen
            if not down:
                if w.down_since is not None:
                    w.reset()  # up again: no read planned
                    back.append(_Due(key, url, False))
            elif w.down_since is None:
                w.down_since = now
                w.next_read = min(w.next_read or math.inf, now + REREAD_AFTER_SECS)
            if w.next_read is not None and now >= w.next_read:
                due.append(_Due(key, url, down))
                w.next_read = now + w.backoff if down else None
                if down:
                    w.backoff = min(BACKOFF_MAX_SECS, w.backoff * 2)
        for key in set(self._watches) - set(looked):
            del self._watches[key]
        for d in back:  # its sources connected again: what a read said before is past
            await self._state(d, "ok", None)
        reads: dict[str, dict[int, RankSource] | EngineRouteError] = {}
        for d in due:
            if d.engine_url not in reads:
                reads[d.engine_url] = await asyncio.to_thread(self._read, d.engine_url)
            # the registration as it is now, after the read (a Coordinator's may have
            # changed it meanwhile)
            req = await self.conductor.run(self._registration, d)
            if req is not None:
                await self._follow(d, req, reads[d.engine_url])

    def _read(self, url: str) -> dict[int, RankSource] | EngineRouteError:
        try:
            return read_sources(url, self.conductor.registry.url_policy)
        except EngineRouteError as ex:
            return ex

    def _look(self) -> dict[DpKey, tuple[str, bool]]:
        """Ingest thread: every DP registered with an engine URL, and whether all its
        subscriptions are disconnected."""
        subs = self.conductor.subs
        out: dict[DpKey, tuple[str, bool]] = {}
        for entry in self.conductor.registry.instances.values():
            for dp, ep in entry.endpoints.items():
                if ep.engine_url is None:
                    continue
                live = (subs.get(entry.instance_id, dp, url) for url, _ in ep.sources)
                down = not any(s is not None and (s.connected or s.passive) for s in live)
                out[(entry.instance_id, dp)] = (ep.engine_url, down)
        return out

    def _endpoint(self, d: _Due) -> tuple[WorkerEntry, EndpointInfo] | None:
        """Ingest thread: the DP's registration, None when it is gone or no longer of
        ``d.engine_url``."""
        entry = self.conductor.registry.get(d.key[0])
        ep = entry.endpoints.get(d.key[1]) if entry is not None else None
        if entry is None or ep is None or ep.engine_url != d.engine_url:
            return None
        return entry, ep

    def _registration(self, d: _Due) -> RegisterRequest | None:
        found = self._endpoint(d)
        return None if found is None else registration_request(*found)

    async def _follow(
        self, d: _Due, was: RegisterRequest, read: dict[int, RankSource] | EngineRouteError
    ) -> None:
        iid, dp = d.key
        try:
            if isinstance(read, EngineRouteError):
                raise read
            ((body, req),) = registrations_from(was, {dp: read[dp]} if dp in read else read)[:1]
            if (req.medium_endpoints, req.replay_endpoint) == (
                was.medium_endpoints,
                was.replay_endpoint,
            ):
                await self._state(d, "rereading" if d.down else "ok", None)
                return
            await self.conductor.mutate("register", body, req)
        except (EngineRouteError, RegistrationError, RegistrationUnavailable) as ex:
            await self._state(d, "error", str(ex))
            log.warning("engine URL read again instance_id=%s dp_rank=%d: %s", iid, dp, ex)
            return
        except StateUnavailable as ex:
            await self._state(d, "error", str(ex))
            return
        w = self._watches.get(d.key)
        if w is not None:
            w.reset()
        log.info(
            "engine found again instance_id=%s dp_rank=%d engine_url=%s endpoint=%s "
            "replay_endpoint=%s",
            iid,
            dp,
            d.engine_url,
            (req.medium_endpoints or {}).get("npu"),
            req.replay_endpoint,
        )

    async def _state(self, d: _Due, state: str, error: str | None) -> None:
        await self.conductor.run(self._set_state, d, state, error)

    def _set_state(self, d: _Due, state: str, error: str | None) -> None:
        found = self._endpoint(d)
        if found is not None:
            found[1].engine_url_state, found[1].engine_url_error = state, error
