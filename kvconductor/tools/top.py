"""``kv-conductor top --url URL``: a live view of a running service (docs/operations.md,
"Live view: kv-conductor top").

Every ``--interval`` seconds it reads ``GET /workers`` and ``GET /metrics`` and redraws
four tables: sources (state, event rate, last event age), indexes (blocks per tier),
queries (rate, p50/p99, hit ratio; over the last interval and since the server started)
and the server's recent warnings. Rates and quantiles come from the difference of two
consecutive polls, as Prometheus' ``rate()`` and ``histogram_quantile()`` compute them.

The logic (fetching, parsing, rates, quantiles, rows) is plain functions over plain
data; only :func:`render` and :func:`main` touch ``rich``, the optional ``top`` extra
(``pip install 'kvconductor[top]'``). HTTP is the standard library's ``urllib``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvconductor.http.metrics import MISS_REASONS
from kvconductor.tools.flags import decimal, number

__all__ = [
    "DEFAULT_URL",
    "FetchError",
    "Frame",
    "Poll",
    "QueryWindow",
    "build_frame",
    "fetch",
    "histogram_quantile",
    "main",
    "parse_metrics",
    "query_window",
    "render",
]

DEFAULT_URL = "http://127.0.0.1:13333"
API_KEY_ENV = "KV_CONDUCTOR_API_KEY"
NEEDS_RICH = "kv-conductor top needs the 'top' extra: pip install 'kvconductor[top]'"
#: Warnings shown (the newest; ``/workers`` keeps the last 50).
WARNINGS_SHOWN = 10
#: Column headers of the Sources table (docs/operations.md explains each).
SOURCE_COLUMNS = (
    "instance",
    "dp",
    "url",
    "model",
    "state",
    "events",
    "ev/s",
    "age",
    "losses",
    "drops",
)
MISS_HEADERS = ("unknown idx", "bs mismatch", "unknown lora", "no match")

#: ``(sample name, sorted label pairs) -> value`` of one /metrics exposition.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class FetchError(Exception):
    """The service could not be read; the message is one line for the user."""


# ---------------------------------------------------------------------------------------
# Fetching
# ---------------------------------------------------------------------------------------


@dataclass
class Poll:
    """One reading of the service: ``/workers`` as decoded JSON, ``/metrics`` samples,
    and when (``time.monotonic()``, for rates)."""

    at: float
    workers: dict[str, Any]
    samples: Samples


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, keyed by name and labels."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def check_url(url: str) -> str:
    """``url`` without a trailing slash; :class:`FetchError` unless it is http(s)://host."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise FetchError(f"invalid --url {url!r}: expected http://HOST:PORT or https://HOST:PORT")
    return url.rstrip("/")


def _get(url: str, path: str, api_key: str | None, timeout: float) -> bytes:
    req = urllib.request.Request(url + path)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read()
    except urllib.error.HTTPError as ex:
        if ex.code == 401:
            hint = "wrong --api-key" if api_key else f"give --api-key or set {API_KEY_ENV}"
            raise FetchError(f"GET {url}{path}: 401 unauthorized ({hint})") from None
        raise FetchError(f"GET {url}{path}: HTTP {ex.code} {_error_of(ex)}") from None
    except urllib.error.URLError as ex:
        reason = ex.reason
        if isinstance(reason, ssl.SSLError):
            reason = f"TLS: {reason.reason or reason}"
            if "CERTIFICATE_VERIFY_FAILED" in reason:
                reason += " (is the server's CA in SSL_CERT_FILE?)"
        elif isinstance(reason, OSError) and reason.strerror:
            reason = reason.strerror.lower()  # "connection refused"
        raise FetchError(f"cannot reach {url}: {reason}") from None
    except (OSError, ValueError, http.client.HTTPException) as ex:  # timeouts, resets, ...
        raise FetchError(f"cannot reach {url}: {ex}") from None


def _error_of(ex: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(ex.read())["error"])
    except Exception:
        return ex.reason or ""


def fetch(url: str, api_key: str | None = None, timeout: float = 5.0) -> Poll:
    """Read ``/workers`` and ``/metrics`` of the service at ``url`` (:class:`FetchError`)."""
    url = check_url(url)
    workers = _get(url, "/workers", api_key, timeout)
    at = time.monotonic()
    metrics = _get(url, "/metrics", api_key, timeout)
    try:
        doc = json.loads(workers)
        samples = parse_metrics(metrics.decode())
    except ValueError as ex:
        raise FetchError(f"{url} does not answer like kv-conductor: {ex}") from None
    if not isinstance(doc, dict) or "sources" not in doc or "indexer" not in doc:
        raise FetchError(f"{url}/workers does not answer like kv-conductor")
    return Poll(at, doc, samples)


# ---------------------------------------------------------------------------------------
# The numbers
# ---------------------------------------------------------------------------------------


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile (0..1) of cumulative histogram ``buckets`` ``[(le, count)]``
    (``le`` ascending, ``+Inf`` last), as Prometheus' ``histogram_quantile``: linear
    within the bucket the rank falls in (the first bucket's lower bound is 0); a rank in
    the ``+Inf`` bucket gives the highest finite bound. ``None`` without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > prev_count:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def _sum_by(samples: Samples, name: str, label: str | None = None) -> dict[str, float]:
    """Values of the samples ``name`` summed by the value of ``label`` (``""`` if None)."""
    out: dict[str, float] = {}
    for (n, labels), v in samples.items():
        if n == name:
            key = dict(labels).get(label, "") if label else ""
            out[key] = out.get(key, 0.0) + v
    return out


def _query_counters(samples: Samples) -> tuple[list[tuple[float, float]], dict[str, float]]:
    """(query-time buckets of both routes, misses by reason)."""
    by_le = _sum_by(samples, "kvconductor_query_seconds_bucket", "le")
    buckets = sorted((float(le), n) for le, n in by_le.items())
    misses = _sum_by(samples, "kvconductor_query_misses_total", "reason")
    return buckets, misses


@dataclass
class QueryWindow:
    """Query figures over a window: ``seconds`` is None for "since the server started"."""

    seconds: float | None
    queries: int
    rate: float | None
    p50: float | None
    p99: float | None
    #: 1 - misses / (queries - errors); None without answered queries.
    hit_ratio: float | None
    misses: dict[str, int]
    #: Requests answered with an error other than 404 (bad body, too large).
    errors: int = 0


def query_window(cur: Samples, prev: Samples | None = None, seconds: float = 0.0) -> QueryWindow:
    """Queries, rate, p50, p99 and hit ratio between two scrapes (``prev`` None: since
    the server started). A counter that went down (the server restarted) counts from 0."""
    buckets, misses = _query_counters(cur)
    errors = sum(v for (name, _), v in cur.items() if name == "kvconductor_query_errors_total")
    window: float | None = None
    if prev is not None:
        window = seconds
        old_buckets, old_misses = _query_counters(prev)
        old = dict(old_buckets)
        deltas = [(le, n - old.get(le, 0.0)) for le, n in buckets]
        if any(d < 0 for _, d in deltas):  # restarted: everything since then
            old, old_misses = {}, {}
        else:
            buckets = deltas
        misses = {r: n - old_misses.get(r, 0.0) for r, n in misses.items()}
        if any(n < 0 for n in misses.values()):
            misses = _query_counters(cur)[1]
        old_errors = sum(
            v for (name, _), v in prev.items() if name == "kvconductor_query_errors_total"
        )
        if errors >= old_errors:
            errors -= old_errors
    queries = int(round(buckets[-1][1])) if buckets else 0
    missed = {r: int(round(misses.get(r, 0.0))) for r in MISS_REASONS}
    nerr = int(round(errors))
    answered = queries - nerr
    return QueryWindow(
        seconds=window,
        queries=queries,
        rate=queries / window if window else None,
        p50=histogram_quantile(0.5, buckets),
        p99=histogram_quantile(0.99, buckets),
        hit_ratio=1.0 - sum(missed.values()) / answered if answered > 0 else None,
        misses=missed,
        errors=nerr,
    )


@dataclass
class SourceRow:
    instance_id: str
    dp_rank: int
    url: str
    model: str
    state: str
    events: int
    #: events per second over the last interval (None on the first poll).
    event_rate: float | None
    #: seconds since the source last received a batch (None if the metric lacks it).
    last_event_age: float | None
    losses: int
    dropped: int


@dataclass
class IndexRow:
    model: str
    tenant: str
    workers: int
    npu: int
    cpu: int
    disk: int
    total: int
    nbytes: int


@dataclass
class Frame:
    """Everything one screen shows."""

    url: str
    when: str
    version: str = ""
    registrations: int | None = None
    sources: list[SourceRow] = field(default_factory=list)
    indexes: list[IndexRow] = field(default_factory=list)
    #: The last interval (when there was a previous poll) and since the server started.
    queries: list[QueryWindow] = field(default_factory=list)
    warnings: list[dict[str, str]] = field(default_factory=list)
    #: Why this frame is stale (the last poll failed); None when fresh.
    error: str | None = None


def _source_media(workers: Iterable[dict[str, Any]]) -> dict[tuple[str, int, str], set[str]]:
    """(instance, DP, URL) -> the medium labels of the metrics that URL feeds."""
    out: dict[tuple[str, int, str], set[str]] = {}
    for w in workers:
        for dp, ep in (w.get("endpoints") or {}).items():
            for medium, url in (ep.get("medium_endpoints") or {}).items():
                out.setdefault((w["instance_id"], int(dp), url), set()).add(medium.upper())
    return out


def _ages(samples: Samples) -> dict[tuple[str, int, str], float]:
    out = {}
    for (name, labels), v in samples.items():
        if name == "kvconductor_source_last_event_age_seconds":
            d = dict(labels)
            out[(d["instance_id"], int(d["dp_rank"]), d["medium"])] = v
    return out


def source_rows(cur: Poll, prev: Poll | None = None) -> list[SourceRow]:
    """One row per ``/workers.sources`` entry; the event rate is the difference of its
    ``events`` counter since ``prev`` over the seconds between the polls."""
    media = _source_media(cur.workers.get("workers", []))
    ages = _ages(cur.samples)
    before: dict[tuple[str, int, str], int] = {}
    dt = 0.0
    if prev is not None:
        dt = cur.at - prev.at
        for s in prev.workers.get("sources", []):
            before[(s["instance_id"], s["dp_rank"], s["url"])] = s["events"]
    rows = []
    for s in cur.workers.get("sources", []):
        key = (s["instance_id"], s["dp_rank"], s["url"])
        rate = None
        if key in before and dt > 0:
            rate = max(0, s["events"] - before[key]) / dt
        found = [s["last_event_age_s"]] if s.get("last_event_age_s") is not None else []
        if not found:  # a server before /workers had the field: by the registered URLs
            found = [
                ages[(s["instance_id"], s["dp_rank"], m)]
                for m in sorted(media.get(key, ()))
                if (s["instance_id"], s["dp_rank"], m) in ages
            ]
        rows.append(
            SourceRow(
                instance_id=s["instance_id"],
                dp_rank=s["dp_rank"],
                url=s["url"],
                model=s.get("model", ""),
                state=s["state"],
                events=s["events"],
                event_rate=rate,
                last_event_age=min(found) if found else None,
                losses=s.get("losses", 0),
                dropped=sum((s.get("dropped") or {}).values()),
            )
        )
    return rows


def index_rows(workers: dict[str, Any]) -> list[IndexRow]:
    """One row per ``/workers.indexer`` entry: blocks per tier, as the server counts them."""
    return [
        IndexRow(
            model=i["model_name"],
            tenant=i["tenant_id"],
            workers=i["worker_count"],
            npu=i["hbm_blocks"],
            cpu=i["cpu_blocks"],
            disk=i["disk_blocks"],
            total=i["total_blocks"],
            nbytes=i["bytes"],
        )
        for i in workers.get("indexer", [])
    ]


def build_frame(url: str, cur: Poll, prev: Poll | None = None) -> Frame:
    """The screen for poll ``cur``; rates over the interval since ``prev`` when given."""
    version = next(
        (dict(lb).get("version", "") for (n, lb) in cur.samples if n == "kvconductor_build_info"),
        "",
    )
    regs = cur.samples.get(("kvconductor_registrations", ()))
    queries = [query_window(cur.samples)]
    if prev is not None:
        queries.insert(0, query_window(cur.samples, prev.samples, cur.at - prev.at))
    return Frame(
        url=url,
        when=datetime.now(timezone.utc).strftime("%H:%M:%S UTC"),
        version=version,
        registrations=None if regs is None else int(regs),
        sources=source_rows(cur, prev),
        indexes=index_rows(cur.workers),
        queries=queries,
        warnings=list(cur.workers.get("recent_warnings", []))[-WARNINGS_SHOWN:],
    )


# ---------------------------------------------------------------------------------------
# Text of the cells
# ---------------------------------------------------------------------------------------


def fmt_seconds(s: float | None) -> str:
    """``85 µs``, ``2.50 ms``, ``1.20 s``; ``-`` for None."""
    if s is None:
        return "-"
    if s < 0.001:
        return f"{s * 1e6:.0f} µs"
    if s < 1.0:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_rate(r: float | None) -> str:
    return "-" if r is None else f"{r:.1f}/s"


def fmt_age(s: float | None) -> str:
    return "-" if s is None else f"{s:.1f} s"


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{100.0 * r:.1f}%"


def fmt_bytes(n: int) -> str:
    """``512 B``, ``1.5 KiB``, ``2.0 MiB``, ``3.1 GiB``."""
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024 or unit == "GiB":
            break
    return f"{size:.1f} {unit}"


# ---------------------------------------------------------------------------------------
# Rendering (rich)
# ---------------------------------------------------------------------------------------


def _table(title: str) -> Any:
    from rich import box
    from rich.table import Table

    return Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD)


def render(frame: Frame, interval: float | None = None) -> Any:
    """The frame as one rich renderable (a title line and four tables)."""
    from rich.console import Group
    from rich.text import Text

    title = Text(f"kv-conductor top  {frame.url}", style="bold")
    if frame.version:
        title.append(f"  version {frame.version}")
    if frame.registrations is not None:
        title.append(f"  registrations {frame.registrations}")
    if frame.when:
        title.append(f"  {frame.when}")
    if interval:
        title.append(f"  every {interval:g} s")
    parts: list[Any] = [title]
    if frame.error:
        stale = f"; the tables are from {frame.when}" if frame.when else ""
        parts.append(Text(f"error: {frame.error}; retrying{stale}", style="bold red"))

    src = _table("Sources")
    for col in SOURCE_COLUMNS:
        left = col in ("instance", "url", "model", "state")
        src.add_column(col, justify="left" if left else "right", no_wrap=True)
    state_style = {"live": "green", "degraded": "yellow", "replaying": "cyan"}
    for s in frame.sources:
        src.add_row(
            s.instance_id,
            str(s.dp_rank),
            s.url,
            s.model,
            Text(s.state, style=state_style.get(s.state, "red")),
            str(s.events),
            fmt_rate(s.event_rate),
            fmt_age(s.last_event_age),
            str(s.losses),
            str(s.dropped),
        )
    parts.append(src)

    idx = _table("Indexes (blocks per tier)")
    for col in ("model", "tenant", "workers", "npu", "cpu", "disk", "total", "memory"):
        left = col in ("model", "tenant")
        idx.add_column(col, justify="left" if left else "right", no_wrap=True)
    for i in frame.indexes:
        idx.add_row(
            i.model,
            i.tenant,
            str(i.workers),
            str(i.npu),
            str(i.cpu),
            str(i.disk),
            str(i.total),
            fmt_bytes(i.nbytes),
        )
    parts.append(idx)

    qt = _table("Queries")
    for col in ("window", "queries", "rate", "p50", "p99", "hit ratio", *MISS_HEADERS):
        qt.add_column(col, justify="left" if col == "window" else "right", no_wrap=True)
    for q in frame.queries:
        qt.add_row(
            "since start" if q.seconds is None else f"last {q.seconds:.1f} s",
            str(q.queries),
            fmt_rate(q.rate),
            fmt_seconds(q.p50),
            fmt_seconds(q.p99),
            fmt_ratio(q.hit_ratio),
            *(str(q.misses[r]) for r in MISS_REASONS),
        )
    parts.append(qt)

    wt = _table("Recent warnings")
    wt.expand = True
    wt.add_column("time (UTC)", no_wrap=True)
    wt.add_column("level", no_wrap=True)
    wt.add_column("message", overflow="ellipsis", no_wrap=True, ratio=1)
    for w in frame.warnings:
        ts = w.get("ts", "")
        wt.add_row(ts[11:19] if len(ts) >= 19 else ts, w.get("level", ""), w.get("message", ""))
    parts.append(wt)
    return Group(*parts)


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


def _interval(value: str) -> float:
    return number(
        value,
        float,
        "interval",
        "seconds expected",
        lambda s: 0.1 <= s <= 3600,
        "must be within 0.1..3600",
    )


def _positive(value: str) -> int:
    return number(value, decimal, "count", "an integer expected", lambda n: n >= 1, "must be >= 1")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kv-conductor top",
        description="Live view of a running kv-conductor: sources, indexes, queries, warnings",
        allow_abbrev=False,
    )
    p.add_argument("--url", default=DEFAULT_URL, help=f"the service (default {DEFAULT_URL})")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"bearer token of a server run with --api-key (env {API_KEY_ENV})",
    )
    p.add_argument(
        "--interval",
        type=_interval,
        default=1.0,
        help="seconds between polls; rates are over this interval (default 1)",
    )
    p.add_argument(
        "--once",
        action="store_true",
        help="poll twice --interval apart, print one frame and exit (scripts, no terminal)",
    )
    p.add_argument("--iterations", type=_positive, default=None, help="exit after this many frames")
    return p


def main(argv: list[str] | None = None, console: Any = None) -> int:
    """``kv-conductor top``: 0 on Ctrl-C or after ``--once``/``--iterations``; 1 when the
    service cannot be read (``--once``, or the first poll of a frame count); 2 on a bad
    flag or without rich. ``console``: a rich Console to draw on (tests record one)."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        print(NEEDS_RICH, file=sys.stderr)
        return 2
    try:
        url = check_url(args.url)
    except FetchError as ex:
        print(f"kv-conductor top: {ex}", file=sys.stderr)
        return 1
    if console is None:
        # Piped (--once into a file): wide enough for every column, unless COLUMNS says.
        wide = not sys.stdout.isatty() and not os.environ.get("COLUMNS")
        console = Console(width=160) if wide else Console()
    try:
        if args.once:
            try:
                first = fetch(url, args.api_key)
                time.sleep(args.interval)
                frame = build_frame(url, fetch(url, args.api_key), first)
            except FetchError as ex:
                print(f"kv-conductor top: {ex}", file=sys.stderr)
                return 1
            console.print(render(frame))
            return 0
        return _live(url, args, console, Live)
    except KeyboardInterrupt:
        return 0


def _live(url: str, args: argparse.Namespace, console: Any, live_cls: Any) -> int:
    prev: Poll | None = None
    frame = Frame(url=url, when="")
    shown = 0
    with live_cls(render(frame, args.interval), console=console, auto_refresh=False) as live:
        while True:
            started = time.monotonic()
            try:
                cur = fetch(url, args.api_key)
            except FetchError as ex:
                frame.error = str(ex)  # the tables keep the last good poll
            else:
                frame = build_frame(url, cur, prev)
                prev = cur
            live.update(render(frame, args.interval), refresh=True)
            shown += 1
            if args.iterations is not None and shown >= args.iterations:
                return 1 if prev is None else 0
            time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
