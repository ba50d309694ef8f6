"""``run_coro``: ``asyncio.run`` for a test process that also drives Falcon's TestClient.

On Python 3.10 ``asyncio.run`` ends with ``asyncio.set_event_loop(None)``. Falcon's
``async_to_sync`` (behind ``falcon.testing.TestClient`` for ASGI apps) uses an
``asyncio.Runner`` on 3.11+, but on 3.10 it takes
``asyncio.get_event_loop_policy().get_event_loop()``, which raises "There is no current
event loop in thread 'MainThread'" once the loop was set to None. So on 3.10 one
``asyncio.run`` anywhere in the session broke every later TestClient request.

``run_coro`` runs the coroutine on a private loop and cleans up like ``asyncio.run``
(pending tasks cancelled, async generators and the default executor shut down) but
never sets or clears the thread's current loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_coro(coro: Coroutine[Any, Any, T]) -> T:
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()
