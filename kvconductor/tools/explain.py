"""``kv-conductor explain``: ask a running kv-conductor why a prompt does or does not hit.

Wraps ``POST /explain`` (docs/api.md) and prints one line per instance and DP rank:
matched blocks per tier, where each tier's walk stopped and why, the source states,
then the answer's warnings. ``--json`` prints the raw answer instead. Exit status: 0 with
an answer, 1 when the server cannot be reached or refuses the request (one line on
stderr), 2 for bad arguments. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from typing import Any

#: The environment variable ``kv-conductor`` reads its API key from (kvconductor.serve.cli).
API_KEY_ENV = "KV_CONDUCTOR_API_KEY"

#: Each stop reason in words (docs/api.md, POST /explain, "Stop reasons").
STOP_WORDS = {
    "end_of_prompt": "matched to the end of the prompt",
    "parent_mismatch": "holds the next block's content, but after a different prefix",
    "not_held": "the tier holds the next block, this DP does not",
    "no_first_block": "no block of the tier starts with the prompt's first block",
    "tier_exhausted": "nothing cached after this prefix in the tier",
    "muted": "muted: its source is down, its blocks give no hits",
    "no_worker": "no worker on this tier",
}
TIERS = ("npu", "cpu", "disk")
#: Drop reasons that need words (docs/events.md, "Drop reasons").
DROP_WORDS = {
    "parent_not_found": ": blocks stored after a parent block this source never announced, "
    "lost or published before it connected; not indexed",
    "replay_failed": ": the replay endpoint did not answer in full",
}


class ExplainError(Exception):
    """The request failed: connection error or an HTTP error answer."""


def parse_tokens(text: str) -> list[int]:
    """A JSON array of ints, or ints separated by whitespace and/or commas."""
    text = text.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except ValueError as ex:
            raise ValueError(f"not a JSON array of token ids: {ex}") from None
        if not isinstance(values, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in values
        ):
            raise ValueError("the JSON array must hold integer token ids only")
        return values
    parts = [p for p in re.split(r"[\s,]+", text) if p]
    try:
        return [int(p) for p in parts]
    except ValueError as ex:
        raise ValueError(f"token ids must be integers: {ex}") from None


def request(
    url: str,
    body: dict[str, Any],
    api_key: str | None = None,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """POST ``body`` to ``url``/explain; the decoded answer or :class:`ExplainError`."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(
        url.rstrip("/") + "/explain",
        data=json.dumps(body).encode(),
        headers=headers,
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as ex:
        detail = ex.read().decode("utf-8", "replace")
        try:
            detail = json.loads(detail)["error"]
        except (ValueError, KeyError, TypeError):
            pass
        raise ExplainError(f"HTTP {ex.code} from {req.full_url}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as ex:
        reason = getattr(ex, "reason", ex)
        raise ExplainError(f"cannot reach {req.full_url}: {reason}") from None


def _tier(name: str, t: dict[str, Any]) -> str:
    words = STOP_WORDS.get(t["stop"], t["stop"])
    return f"{name} {t['blocks']} (to block {t['at_block']}: {t['stop']}, {words})"


def _source_details(s: dict[str, Any], indent: str) -> list[str]:
    """The loss and drop lines of one source (absent from older servers' answers)."""
    lines = []
    loss = s.get("last_loss")
    if s.get("losses"):
        since = s.get("degraded_since")
        state = f"degraded since {_clock(since)}" if since is not None else "live again"
        why = f"; last: {loss['why']} (at {_clock(loss['at'])})" if loss else ""
        lines.append(f"{indent}{s['losses']} loss(es), {state}{why}")
    dropped = s.get("dropped") or {}
    for reason, n in sorted(dropped.items()):
        lines.append(f"{indent}{n} events dropped ({reason}{DROP_WORDS.get(reason, '')})")
    return lines


def _clock(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def report(doc: dict[str, Any]) -> list[str]:
    """The readable report of an explain answer, one string per line."""
    lines = [
        f"model={doc['model']} tenant={doc['tenant']} block_size={doc['block_size']} "
        f"query_blocks={doc['query_blocks']}"
        + (f" lora_name={doc['lora_name']}" if doc.get("lora_name") else "")
    ]
    if not doc["index_found"]:
        lines.append("index: not found")
    else:
        sizes = ", ".join(str(s) for s in doc["registered_block_sizes"]) or "none"
        lines.append(f"index: found; registered block sizes: {sizes}")
    for inst in doc["instances"]:
        reg = "" if inst["registered"] else " [not registered]"
        total = inst["npu_blocks"] + inst["cpu_blocks"] + inst["disk_blocks"]
        tiers = "; ".join(_tier(t, inst["tiers"][t]) for t in TIERS)
        lines.append(f"{inst['instance_id']} DP {inst['dp_rank']}{reg}: {total} blocks: {tiers}")
        for s in inst["sources"]:
            age = s["last_event_age_s"]
            if age < 0:
                since = "no event yet"
            elif s["events"]:
                since = f"last event {age:.1f}s ago"
            else:
                since = f"no event since it opened {age:.1f}s ago"
            lines.append(
                f"    source {s['url']} ({'/'.join(s['media'])}): {s['state']}, "
                f"{s['events']} events, {since}"
            )
            lines += _source_details(s, "        ")
        if inst.get("engine_url"):
            state = inst.get("engine_url_state")
            err = inst.get("engine_url_error")
            lines.append(
                f"    engine URL {inst['engine_url']}/kv_event_sources: last read {state}"
                + (f": {err}" if err else "")
            )
        for p in inst.get("predictions", []):
            lines.append(
                f"    predicted by a router: {p['blocks']} blocks of this query "
                f"({p['predicted_blocks']} predicted, {p['age_s']:.1f}s ago, "
                f"expires in {p['expires_in_s']:.1f}s; counted in HBM)"
            )
    for s in doc.get("pool_sources", []):
        lines.append(f"pool source {s['url']}: {s['state']}, {s['events']} events")
        lines += _source_details(s, "    ")
    for w in doc["warnings"]:
        lines.append(f"warning: {w}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kv-conductor explain",
        description="Why does (or doesn't) a prompt hit the KV cache? (POST /explain)",
    )
    p.add_argument("--url", required=True, help="kv-conductor base URL, http://host:13333")
    p.add_argument("--model", required=True)
    p.add_argument("--tenant", default=None, help="tenant_id (default: the default tenant)")
    p.add_argument("--block-size", type=int, default=128, help="tokens per block (128)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--tokens-file", help="token ids: a JSON array, or integers separated by spaces/commas"
    )
    src.add_argument("--tokens", help='token ids inline, "1,2,3"')
    p.add_argument("--lora-name", default=None, help="LoRA adapter of the request")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"bearer token when the server runs with --api-key (env {API_KEY_ENV})",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="seconds (30)")
    p.add_argument("--json", action="store_true", help="print the raw answer")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.tokens_file is not None:
            with open(args.tokens_file, encoding="utf-8") as f:
                tokens = parse_tokens(f.read())
        else:
            tokens = parse_tokens(args.tokens)
    except (OSError, ValueError) as ex:
        print(f"kv-conductor explain: error: {ex}", file=sys.stderr)
        return 2
    body: dict[str, Any] = {"model": args.model, "block_size": args.block_size, "token_ids": tokens}
    if args.tenant is not None:
        body["tenant_id"] = args.tenant
    if args.lora_name:
        body["lora_name"] = args.lora_name
    try:
        doc = request(args.url, body, args.api_key, args.timeout)
    except ExplainError as ex:
        print(f"kv-conductor explain: {ex}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print("\n".join(report(doc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
