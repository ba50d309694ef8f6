AVAILABLE: bool
WHY: str

def recv_messages(socket: int, limit: int, out: list[list[bytes]]) -> int: ...
