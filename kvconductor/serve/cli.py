"""Command line: ``kv-conductor [--host H] [--port P] ...`` (docs/operations.md, "Starting it").

Every bad flag value stops the process before anything starts, with one
line on stderr (``kv-conductor: error: ...``) and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from kvconductor import __version__
from kvconductor.http.fence import QUERY_PATHS
from kvconductor.logs import LOG_FORMATS, configure_logging
from kvconductor.serve.flagvalues import (  # the flags' values and checks, by job
    API_KEY_ENV,
    LOG_ENV,
    MAX_WORKERS,
    STATE_PASSWORD_ENV,
    STATE_URL_ENV,
    _dialect_problem,
    _env_level,
    _host,
    _int_in,
    _lease,
    _level,
    _megabytes,
    _networks,
    _origin,
    _port,
    _readable,
    _secs,
    _snapshot_problem,
    _source_problem,
    _timeout,
    _tls_problem,
    _ttl,
    _workers,
)
from kvconductor.serve.settings import DEFAULT_HOST, DEFAULT_PORT, Settings

__all__ = ["API_KEY_ENV", "LOG_ENV", "MAX_WORKERS", "FlagError", "build_parser", "main"]


class FlagError(ValueError):
    """A bad flag, from a parser built with ``raise_errors=True`` (gunicorn's factory)."""


class _Parser(argparse.ArgumentParser):
    raise_errors = False

    def error(self, message: str) -> NoReturn:  # one line, exit status 2, no usage dump
        if self.raise_errors:
            raise FlagError(f"{self.prog}: error: {message} (see --help)")
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        # flags wrong together
        problem = (
            _tls_problem(ns) or _source_problem(ns) or _snapshot_problem(ns) or _dialect_problem(ns)
        )
        if problem:
            self.error(problem)
        return ns


def build_parser(raise_errors: bool = False) -> argparse.ArgumentParser:
    """The ``kv-conductor`` argument parser.

    With ``raise_errors`` a bad flag raises :class:`FlagError` instead of
    printing it and exiting with status 2.
    """
    level, _ = _env_level()
    # No abbreviations: a misspelt flag (--pending-ttl-sec) is an error, never a guess.
    p = _Parser(
        prog="kv-conductor", description="KV-cache index service (V3 HTTP API)", allow_abbrev=False
    )
    p.raise_errors = raise_errors
    p.add_argument("--version", action="version", version=f"kv-conductor {__version__}")
    p.add_argument(
        "--host",
        type=_host,
        default=DEFAULT_HOST,
        help="IP address to bind (default :: dual-stack, 0.0.0.0 without IPv6)",
    )
    p.add_argument(
        "--port",
        "-p",
        type=_port,
        default=DEFAULT_PORT,
        help=f"HTTP port (default {DEFAULT_PORT}; 0 picks a free one)",
    )
    p.add_argument(
        "--mooncake-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="also serve the Mooncake conductor's HTTP dialect (kvcache-ai/Mooncake "
        "mooncake-conductor: /register, /unregister, /query, /services) on this port, "
        "beside the V3 API (default: off; with --workers N the workers listen on it; "
        "docs/api.md). With --api-key its /register, /unregister and /services need the "
        "same bearer token as V3's",
    )
    p.add_argument(
        "--mooncake-port-open",
        action="store_true",
        help="with --api-key, leave the --mooncake-port dialect open: anyone who reaches "
        "that port may register, re-point and unregister engines without the key (for "
        "Mooncake clients that cannot send an Authorization header; default: the key is "
        "needed there too)",
    )
    p.add_argument(
        "--dynamo-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="also serve the HTTP API of Dynamo's standalone KV indexer (python -m "
        "dynamo.indexer: /register, /unregister, /query, /query_by_hash, /workers) on this "
        "port, beside the V3 API, from the same index (default: off; with --workers N the "
        "workers answer its queries; docs/api.md). With --api-key its /register, /unregister "
        "and /workers need the same bearer token as V3's",
    )
    p.add_argument(
        "--dynamo-port-open",
        action="store_true",
        help="with --api-key, leave the --dynamo-port dialect open: anyone who reaches "
        "that port may register and unregister engines without the key (Dynamo's clients "
        "send no Authorization header; default: the key is needed there too)",
    )
    p.add_argument(
        "--workers",
        type=_workers,
        default=1,
        metavar="N|auto",
        help="HTTP worker processes sharing the port (default 1: one process does "
        "everything; auto: one per CPU). With N > 1 an owner process keeps the index "
        "and the ingest, and N workers serve HTTP (docs/operations.md)",
    )
    p.add_argument(
        "--reader-stall-ms",
        type=_int_in(0, 600_000),
        default=500,
        metavar="MS",
        help="with --workers N: a worker still inside a read of the shared index this many "
        "ms after the ingest thread started waiting for it is stalled (stopped, frozen, "
        "swapping): the other workers' queries go on, the stalled worker is killed and "
        "restarted; a worker that does not answer the owner's heartbeat for this long "
        "(at least 500 ms) is too (default 500; 0: wait for either without bound)",
    )
    p.add_argument(
        "--maintenance-interval-secs",
        type=_secs,
        default=30,
        help="maintenance period in seconds (default 30; effective max(1, n))",
    )
    p.add_argument(
        "--pending-ttl-secs",
        type=_secs,
        default=60,
        help="TTL of pool confirmations waiting for an offload (default 60)",
    )
    p.add_argument(
        "--content-ttl-secs",
        type=_secs,
        default=300,
        help="TTL of retained confirmed content (default 300)",
    )
    p.add_argument(
        "--offload-ttl-secs",
        type=_secs,
        default=600,
        help="TTL of unconfirmed engine offloads (default 600)",
    )
    p.add_argument(
        "--prediction-ttl-s",
        type=_ttl,
        default=2.0,
        help="how long a router's prediction (POST /predict) counts in answers, in "
        "seconds (default 2; 0: predictions off)",
    )
    for flag, what, most in (
        ("-per-dp", "predictions per (instance, DP)", 64),
        ("", "predictions in all", 100_000),
        ("-blocks", "predicted blocks in all", 4_000_000),
    ):
        p.add_argument(
            "--prediction-max" + flag,
            type=_int_in(1, 2**32 - 1),
            default=most,
            help=f"live {what} at most; over it the oldest go (default {most})",
        )
    p.add_argument(
        "--loss-grace-secs",
        type=_secs,
        default=600,
        help="after events from a source were lost for good, blocks it held then "
        "that are not announced again within this many seconds are dropped "
        "(default 600; nothing is dropped at the loss itself)",
    )
    p.add_argument(
        "--source-down-secs",
        type=_int_in(1, 86_400),
        default=10,
        help="a ZeroMQ engine source not ready (disconnected, or replaying) this many "
        "seconds stops contributing its (instance, DP)'s HBM hits until it is ready "
        "again; its blocks are kept (default 10)",
    )
    p.add_argument(
        "--source-purge-secs",
        type=_secs,
        default=600,
        help="a source not ready this many seconds has its HBM blocks dropped "
        "(default 600; 0: never; at least --source-down-secs)",
    )
    p.add_argument(
        "--replay-deadline-secs",
        type=_secs,
        default=60,
        help="a vLLM replay not finished within this many seconds counts as lost "
        "(default 60; a replay also ends after 5 s without a reply)",
    )
    p.add_argument(
        "--max-message-mb",
        type=_megabytes,
        default=256.0,
        help="a ZeroMQ event message larger than this is refused and counted (default 256)",
    )
    p.add_argument(
        "--max-blocks-per-message",
        type=_int_in(1, 2**32 - 1),
        default=1_000_000,
        help="a message storing or removing more blocks (a store-only chunk counts as the "
        "blocks it stands for) is refused and counted (default 1000000)",
    )
    p.add_argument(
        "--max-blocks-per-source",
        type=_int_in(1, 2**32 - 1),
        default=4_000_000,
        help="an engine source's HBM blocks (and a store-only source's CPU/Disk blocks) at "
        "most; messages that would pass it are refused and counted (default 4000000)",
    )
    p.add_argument(
        "--max-sources",
        type=_int_in(1, 1_000_000),
        default=4096,
        help="ZeroMQ subscriptions (one per registered instance, DP and URL) at most; "
        "registrations beyond get 503 (default 4096; the process needs about "
        "4 open files per source)",
    )
    p.add_argument(
        "--log-level",
        type=_level,
        default=level,
        help=f"trace|debug|info|warning|error (default info; env {LOG_ENV})",
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text: '<UTC time> <LEVEL> <message>' lines; json: one JSON object per line "
        "with the same fields (default text)",
    )
    p.add_argument(
        "--max-body-mb",
        type=_megabytes,
        default=64.0,
        help="request body limit in MiB (default 64)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer <key>' on /register, /unregister, "
        f"/events and /workers (env {API_KEY_ENV})",
    )
    p.add_argument(
        "--allow-bind-endpoints",
        action="store_true",
        help="accept bind-mode endpoint URLs (tcp://*:PORT): the server then listens "
        "for publishers on that port (off by default)",
    )
    p.add_argument(
        "--allow-ipc-endpoints",
        action="store_true",
        help="accept ipc:// endpoint URLs (off by default)",
    )
    p.add_argument(
        "--endpoint-networks",
        type=_networks,
        default=(),
        metavar="CIDR[,CIDR...]",
        help="only accept TCP endpoint URLs whose IP address is in these networks "
        "(host names are then refused)",
    )
    # HTTP limits and network security (docs/security.md)
    p.add_argument(
        "--max-header-kb",
        type=_int_in(1),
        default=64,
        metavar="KIB",
        help="limit of a request's line and headers in KiB; over it: 431 and close (default 64)",
    )
    p.add_argument(
        "--request-timeout-secs",
        type=_timeout,
        default=30.0,
        metavar="SECS",
        help="seconds a connection has to send a complete request (head and body), "
        "counted from the request's first byte or from opening; then it is "
        "closed, with 408 if it sent part of one (default 30; also the TLS "
        "handshake deadline)",
    )
    p.add_argument(
        "--keep-alive-secs",
        type=_timeout,
        default=5.0,
        metavar="SECS",
        help="idle keep-alive connections are closed after this many seconds "
        "between requests (default 5)",
    )
    p.add_argument(
        "--max-connections",
        type=_int_in(1),
        default=1000,
        metavar="N",
        help="open HTTP connections at most; at the cap the longest-idle one is "
        "closed for a new one, or the new one gets 503 when none is idle "
        "(default 1000; lowered to fit the open-file limit)",
    )
    p.add_argument(
        "--query-path",
        choices=QUERY_PATHS,
        default=QUERY_PATHS[0],
        help="who answers POST /query and /query_by_hash: protocol (the HTTP protocol "
        "itself, below ASGI; falls back to asgi, logged, when uvicorn or httptools is "
        "outside the tested range) or asgi (the ASGI app, same answers) (default protocol)",
    )
    p.add_argument(
        "--allow-origin",
        dest="allow_origins",
        action="append",
        type=_origin,
        default=[],
        metavar="ORIGIN",
        help="web origin (scheme://host[:port]) allowed to call /register, "
        "/unregister and /events from a browser; repeatable. Requests with any "
        "other Origin header get 403 (default: none; programs send no Origin)",
    )
    p.add_argument(
        "--load-dump",
        type=_readable,
        metavar="FILE",
        default=None,
        help="warm start: load this GET /debug/dump file (registrations and indexes) "
        "before serving; a bad file stops the start",
    )
    p.add_argument(
        "--snapshot-dir",
        metavar="DIR",
        default=None,
        help="warm restart: write a snapshot (registrations, sequence cursors, every index) "
        "into DIR periodically and at shutdown, and load the newest valid one at start; "
        "the sources then replay from their cursors. One server per directory (a second "
        "one is refused). Default: $XDG_STATE_HOME/kvconductor/PORT (else "
        "~/.local/state/kvconductor/PORT); none with --port 0, --load-dump or --state-url",
    )
    p.add_argument(
        "--no-snapshots",
        action="store_true",
        help="no snapshot directory, not even the default one: nothing is written to "
        "disk and a restart starts cold",
    )
    p.add_argument(
        "--snapshot-interval-secs",
        type=_secs,
        default=60,
        help="seconds between snapshots (default 60; 0: only at shutdown); with a "
        "snapshot directory one is also written about a second after each registration "
        "change (not with 0)",
    )
    p.add_argument(
        "--state-url",
        metavar="URL",
        default=os.environ.get(STATE_URL_ENV) or None,
        help="replicas: share registrations, events and every index with the other "
        "kv-conductor processes of this Valkey (or Redis <= 7.2) database: "
        "redis://HOST:PORT/DB, unix:///PATH?db=N, or "
        f"redis+sentinel://HOST:PORT[,HOST:PORT]/SERVICE/DB (env {STATE_URL_ENV}; "
        f"a password not in the URL: env {STATE_PASSWORD_ENV}; default: none)",
    )
    p.add_argument(
        "--replica-id",
        metavar="ID",
        default=None,
        help="this replica's name in the state store (default: host:pid:random)",
    )
    p.add_argument(
        "--lease-secs",
        type=_lease,
        default=5.0,
        help="with --state-url: a source whose consuming replica stops renewing its lease "
        "this long is taken over by another (default 5)",
    )
    p.add_argument(
        "--open-workers",
        action="store_true",
        help="with --api-key, leave GET /workers (it lists every endpoint), POST /explain "
        "and GET /metrics open (default: they need the bearer token too)",
    )
    p.add_argument(
        "--tls-cert",
        type=_readable,
        metavar="FILE",
        help="serve HTTPS with this PEM certificate chain (the key may be in the same "
        "file; unencrypted)",
    )
    p.add_argument(
        "--tls-key",
        type=_readable,
        metavar="FILE",
        help="PEM private key of --tls-cert (unencrypted)",
    )
    p.add_argument(
        "--tls-client-ca",
        type=_readable,
        metavar="FILE",
        help="require client certificates signed by these PEM CA certificates "
        "(mutual TLS; needs --tls-cert)",
    )
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    return Settings(
        host=args.host,
        port=args.port,
        maintenance_interval_secs=args.maintenance_interval_secs,
        pending_ttl_secs=args.pending_ttl_secs,
        content_ttl_secs=args.content_ttl_secs,
        offload_ttl_secs=args.offload_ttl_secs,
        prediction_ttl_s=args.prediction_ttl_s,
        prediction_max_per_dp=args.prediction_max_per_dp,
        prediction_max=args.prediction_max,
        prediction_max_blocks=args.prediction_max_blocks,
        loss_grace_secs=args.loss_grace_secs,
        source_down_secs=args.source_down_secs,
        source_purge_secs=args.source_purge_secs,
        max_sources=args.max_sources,
        replay_deadline_secs=args.replay_deadline_secs,
        max_message_mb=args.max_message_mb,
        max_blocks_per_message=args.max_blocks_per_message,
        max_blocks_per_source=args.max_blocks_per_source,
        log_level=args.log_level,
        log_format=args.log_format,
        max_body_mb=args.max_body_mb,
        api_key=args.api_key or None,
        allow_bind_endpoints=args.allow_bind_endpoints,
        allow_ipc_endpoints=args.allow_ipc_endpoints,
        endpoint_networks=args.endpoint_networks,
        load_dump=args.load_dump,
        snapshot_dir=args.snapshot_dir,
        snapshot_interval_secs=args.snapshot_interval_secs,
        no_snapshots=args.no_snapshots,
        state_url=args.state_url,
        state_password=os.environ.get(STATE_PASSWORD_ENV) or None,
        replica_id=args.replica_id,
        lease_secs=args.lease_secs,
        workers=args.workers,
        mooncake_port=args.mooncake_port,
        mooncake_open=args.mooncake_port_open,
        dynamo_port=args.dynamo_port,
        dynamo_open=args.dynamo_port_open,
        reader_stall_ms=args.reader_stall_ms,
        **_http_fields(args),
    )


def _http_fields(args: argparse.Namespace) -> dict:
    """The HTTP limit and security settings among ``args``."""
    return {
        "max_header_kb": args.max_header_kb,
        "request_timeout_secs": args.request_timeout_secs,
        "keep_alive_secs": args.keep_alive_secs,
        "max_connections": args.max_connections,
        "query_path": args.query_path,
        "allow_origins": tuple(args.allow_origins),
        "open_workers": args.open_workers,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "tls_client_ca": args.tls_client_ca,
    }


#: ``kv-conductor <command> ...``: tools that talk to a running service; each module has
#: ``main(argv) -> int``. Anything else is the service's own flags.
SUBCOMMANDS = {
    "top": "kvconductor.tools.top",
    "explain": "kvconductor.tools.explain",
    "load-dump": "kvconductor.state.dump",
}


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        return int(importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:]))
    args = build_parser().parse_args(argv)
    settings = settings_from_args(args).with_snapshot_default(args.port)
    configure_logging(settings.log_level, settings.log_format)
    _, warning = _env_level()
    if warning and args.log_level == "info":
        logging.getLogger("kvconductor").warning(warning)
    if settings.workers > 1:
        from kvconductor.serve.owner import serve_owner

        return serve_owner(settings)
    from kvconductor.serve.single import serve

    return serve(settings)
