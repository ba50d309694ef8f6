"""kvconductor.ingest.http_events: an event's ids and names hold no control character."""

from __future__ import annotations

import msgspec
import pytest

from kvconductor.ingest.http_events import EventError, normalize_events
from kvconductor.schema import CONTROL_WORDS, events_decoder

EVENT = {"event_id": 1, "event_type": "stored", "blocks": [{"block_hash": 1, "tokens_hash": 2}]}


def batch(*events: dict):
    return events_decoder.decode(msgspec.json.encode({"instance_id": "i", "events": events}))


@pytest.mark.parametrize("bad", ["a\nb", "\x00", "\x1b[0m", "\x7f", "\x9b", "tab\t"])
@pytest.mark.parametrize(
    ("field", "nested", "path"),
    [
        ("backend_id", False, "$.events[1].backend_id"),
        ("medium", False, "$.events[1].medium"),
        ("lora_name", False, "$.events[1].lora_name"),
        ("type", False, "$.events[1].type"),
        ("legacy_type", False, "$.events[1].legacy_type"),
        ("medium", True, "$.events[1].data.medium"),
    ],
)
def test_a_control_character_names_its_event_and_field(field, nested, path, bad):
    ev = {**EVENT, "data": {field: bad}} if nested else {**EVENT, field: bad}
    with pytest.raises(EventError) as ei:
        normalize_events(batch(EVENT, ev))
    assert str(ei.value) == f"invalid JSON request body: {CONTROL_WORDS} - at `{path}`"


def test_printable_names_pass():
    ops = normalize_events(batch({**EVENT, "backend_id": "10.0.0.1 é ✓", "medium": "cpu"}))
    assert [op.backend_id for op in ops] == ["10.0.0.1 é ✓"]
