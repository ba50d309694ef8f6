"""The Coordinator client's errors and its circuit breaker (docs/client.md).

:class:`ConductorError` is what every failed call raises; :class:`CircuitBreaker` is the
consecutive-failure breaker one client shares across its routes (the rules are in
:mod:`kvconductor.coordinator.core`'s docstring). Standard library only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass

__all__ = [
    "BREAKER_COOLDOWN",
    "BREAKER_THRESHOLD",
    "CircuitBreaker",
    "CircuitOpenError",
    "ConductorError",
]

# The logger keeps the name of the module this code lived in (kvconductor.client).
logger = logging.getLogger("kvconductor.client")

BREAKER_THRESHOLD = 3
BREAKER_COOLDOWN = 30.0


@dataclass(eq=False, repr=False)
class ConductorError(Exception):
    """A conductor call failed.

    Attributes: ``route`` (``"POST /query"``), ``status_code`` (``None`` when
    no HTTP answer was received), ``server_error`` (the server's ``error``
    field or body text), ``url`` (base URL of the conductor).
    """

    message: str
    _: KW_ONLY
    route: str
    status_code: int | None = None
    server_error: str | None = None
    url: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)  # str() and args: the message, as before


class CircuitOpenError(ConductorError):
    """The call was not attempted: the circuit breaker is open."""


class CircuitBreaker:
    """Consecutive-failure breaker: closed -> open -> half-open -> closed/open.

    ``clock`` returns seconds (monotonic); inject a fake one in tests.
    Thread-safe; the async client uses it from one event loop.
    """

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    def __init__(
        self,
        threshold: int = BREAKER_THRESHOLD,
        cooldown: float = BREAKER_COOLDOWN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold < 1:
            raise ValueError("breaker threshold must be >= 1")
        if cooldown < 0:
            raise ValueError("breaker cooldown must be >= 0")
        self.threshold = threshold
        self.cooldown = cooldown
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False
        self._state = self.CLOSED

    @property
    def state(self) -> str:
        """Current state; an open breaker whose cooldown passed still reads ``open``
        until a call takes the half-open slot."""
        return self._state

    @property
    def failures(self) -> int:
        return self._failures

    def retry_in(self) -> float:
        """Seconds until the half-open attempt is allowed (0 when not open)."""
        with self._lock:
            if self._state != self.OPEN:
                return 0.0
            return max(0.0, self._opened_at + self.cooldown - self._clock())

    def allow(self) -> bool:
        """May a call go out now? Takes the single half-open slot when due."""
        with self._lock:
            if self._state == self.CLOSED:
                return True
            if self._state == self.OPEN:
                if self._clock() - self._opened_at >= self.cooldown:
                    self._state = self.HALF_OPEN
                    self._probing = True
                    logger.info("conductor circuit half-open: trying one call")
                    return True
                return False
            # HALF_OPEN: one probe at a time.
            if self._probing:
                return False
            self._probing = True
            return True

    def record_success(self) -> None:
        with self._lock:
            if self._state != self.CLOSED:
                logger.info("conductor circuit closed")
            self._state = self.CLOSED
            self._failures = 0
            self._probing = False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            self._probing = False
            if self._state == self.HALF_OPEN or self._failures >= self.threshold:
                if self._state != self.OPEN:
                    logger.warning(
                        "conductor circuit OPEN after %d consecutive failures (cooldown %.0f s)",
                        self._failures,
                        self.cooldown,
                    )
                self._state = self.OPEN
                self._opened_at = self._clock()

    def release(self) -> None:
        """The half-open probe ended without a verdict (e.g. cancelled): free the slot."""
        with self._lock:
            self._probing = False
