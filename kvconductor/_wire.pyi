from array import array
from collections.abc import Sequence

class WireError(ValueError):
    """A malformed /query or /query_by_hash body; ``str(err)`` is a short detail."""

def parse_query(
    body: bytes | bytearray | memoryview, msgpack: bool, by_hash: bool
) -> tuple[str, int, str, array, str | None]: ...
def encode_result(
    hits: Sequence[tuple[str, int, int, int, int]], tenant: str, block_size: int, msgpack: bool
) -> bytes: ...
def encode_error(message: str, msgpack: bool) -> bytes: ...
