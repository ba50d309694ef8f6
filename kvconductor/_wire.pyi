from array import array

class WireError(ValueError):
    """A malformed /query or /query_by_hash body; ``str(err)`` is a short detail."""

def parse_query(
    body: bytes | bytearray | memoryview, msgpack: bool, by_hash: bool
) -> tuple[str, int, str, array, str | None]: ...
def read_u32_array(buf: bytes | bytearray | memoryview) -> array: ...
