"""A transport for driving an HTTP protocol in process."""

from __future__ import annotations

import asyncio


class Recorder(asyncio.Transport):
    """A transport that records each write call (``writelines`` as one call)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[bytes] = []
        self.closed = False

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 13333), "peername": ("127.0.0.1", 40000)}.get(
            name, default
        )

    def write(self, data) -> None:
        self.calls.append(bytes(data))

    def writelines(self, chunks) -> None:
        self.calls.append(b"".join(chunks))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    @property
    def data(self) -> bytes:
        return b"".join(self.calls)
