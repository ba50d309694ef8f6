from array import array

class WireError(ValueError):
    """A malformed /query or /query_by_hash body; ``str(err)`` is a short detail."""

TOP_K_RANGE: str

def parse_query(
    body: bytes | bytearray | memoryview, msgpack: bool, by_hash: bool, ext: bool = False
) -> tuple: ...
def read_u32_array(buf: bytes | bytearray | memoryview) -> array: ...
