"""Fields a registration carries that its shape does not declare (docs/api.md, POST
/register, "Unknown fields"), on V3 and on the Mooncake dialect alike.

Clients send extra fields (a newer client, a field of another conductor), so a field we
do not know is accepted, but never silently: :class:`UnknownFieldWarnings` names it in
a WARN once per (instance, field), so a misspelled ``store_onyl`` is seen once in the
log instead of leaving its default in place unnoticed. The (instance, field) pairs it
remembers are bounded (the oldest are forgotten first and would be named again).
"""

from __future__ import annotations

import collections
import logging
import threading

import msgspec

__all__ = ["UnknownFieldWarnings", "unknown_fields"]

_KEYS_JSON = msgspec.json.Decoder(dict[str, msgspec.Raw])
_KEYS_MSGPACK = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])

#: The (instance, field) pairs remembered (then the oldest are forgotten).
REMEMBERED = 4096
#: Fields named in one WARN line (the rest are counted), and characters of each name.
NAMED = 20
NAME_CHARS = 100


def unknown_fields(body: bytes, msgpack: bool, shape: type[msgspec.Struct]) -> list[str]:
    """The top-level keys of ``body`` (a map, already decoded as ``shape``) that are not
    fields of ``shape`` by their wire names, sorted."""
    try:
        doc = (_KEYS_MSGPACK if msgpack else _KEYS_JSON).decode(body)
    except msgspec.DecodeError:  # the shape decoded it, so this does not happen
        return []
    known = shape.__struct_encode_fields__
    return sorted(k for k in doc if k not in known)


class UnknownFieldWarnings:
    """One WARN per registration naming its fields not yet named for its instance.
    Thread-safe; at most ``capacity`` (instance, field) pairs kept."""

    def __init__(self, logger: logging.Logger, what: str, capacity: int = REMEMBERED) -> None:
        self.log = logger
        self.what = what
        self.capacity = capacity
        self._seen: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def warn(self, instance_id: str, fields: list[str]) -> list[str]:
        """WARN about the ``fields`` not named yet for ``instance_id``; returns them."""
        if not fields:
            return []
        new = []
        with self._lock:
            for f in fields:
                key = (instance_id, f[:NAME_CHARS])
                if key in self._seen:
                    continue
                new.append(key[1])
                self._seen[key] = None
                if len(self._seen) > self.capacity:
                    self._seen.popitem(last=False)
        if new:
            more = f" and {len(new) - NAMED} more" if len(new) > NAMED else ""
            self.log.warning(
                "%s: fields ignored: %s%s (instance_id=%s; not fields of a registration: "
                "their defaults apply)",
                self.what,
                ", ".join(new[:NAMED]),
                more,
                instance_id,
            )
        return new
