"""The service's settings: what the ``kv-conductor`` flags (or gunicorn's factory
arguments) resolve to, apart from the parser in :mod:`kvconductor.serve.cli`.

Kept in its own module so that the server, the app factory and the CLI all
import it without importing each other.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvconductor.schema import DEFAULT_PORT

DEFAULT_HOST = "::"
#: Re-exported: the default port lives with the contract (kvconductor.schema).
__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "Settings", "default_snapshot_dir", "state_home"]
#: The default snapshot directory of port P is ``<state home>/kvconductor/P``.
STATE_SUBDIR = "kvconductor"


def state_home(env: Mapping[str, str] | None = None) -> str | None:
    """The user's state directory: ``$XDG_STATE_HOME`` when it is an absolute path
    (the XDG base directory rule), else ``$HOME/.local/state`` (the home directory of
    the password database without ``HOME``); None when there is no absolute one."""
    env = os.environ if env is None else env
    xdg = env.get("XDG_STATE_HOME", "")
    if os.path.isabs(xdg):
        return xdg
    home = env.get("HOME") or _passwd_home()
    if not home or not os.path.isabs(home):
        return None
    return os.path.join(home, ".local", "state")


def _passwd_home() -> str | None:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_dir
    except (ImportError, KeyError, OSError):
        return None


def default_snapshot_dir(port: int, env: Mapping[str, str] | None = None) -> str | None:
    """``<state home>/kvconductor/<port>``, or None without a state home."""
    home = state_home(env)
    return None if home is None else os.path.join(home, STATE_SUBDIR, str(port))


@dataclass
class Settings:
    """Parsed flags."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    maintenance_interval_secs: int = 30
    pending_ttl_secs: int = 60
    content_ttl_secs: int = 300
    offload_ttl_secs: int = 600
    prediction_ttl_s: float = 2.0
    prediction_max_per_dp: int = 64
    prediction_max: int = 100_000
    prediction_max_blocks: int = 4_000_000
    loss_grace_secs: int = 600
    source_down_secs: int = 10
    source_purge_secs: int = 600
    max_sources: int = 4096
    replay_deadline_secs: int = 60
    max_message_mb: float = 256.0
    max_blocks_per_message: int = 1_000_000
    max_blocks_per_source: int = 4_000_000
    log_level: str = "info"
    log_format: str = "text"
    max_body_mb: float = 64.0
    api_key: str | None = None
    allow_bind_endpoints: bool = False
    allow_ipc_endpoints: bool = False
    endpoint_networks: tuple = ()
    # HTTP limits and network security (docs/security.md)
    max_header_kb: int = 64
    request_timeout_secs: float = 30.0
    keep_alive_secs: float = 5.0
    max_connections: int = 1000
    allow_origins: tuple[str, ...] = ()
    open_workers: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # warm start: a GET /debug/dump file loaded before serving (docs/dump.md)
    load_dump: str | None = None
    # warm restart: snapshots in a directory (docs/operations.md, "Warm restart")
    snapshot_dir: str | None = None
    snapshot_interval_secs: int = 60
    #: ``--no-snapshots``: no snapshot directory, not even the default one.
    no_snapshots: bool = False
    #: ``snapshot_dir`` is the default one (:meth:`with_snapshot_default`): a directory
    #: that cannot be used is a warning, not a failed start.
    snapshot_default: bool = False
    #: Why the default snapshot directory is not used, logged at start (a WARN line).
    snapshot_warning: str | None = None
    #: Seconds the start waits for another holder of the directory's lock (gunicorn's
    #: reload starts the new worker before the old one stops); 0: refuse at once.
    snapshot_lock_wait: float = 0.0
    # replicas sharing their state through Valkey (docs/operations.md, "Replicas")
    state_url: str | None = None
    # the state store's password when the URL has none (env KV_CONDUCTOR_STATE_PASSWORD)
    state_password: str | None = None
    replica_id: str | None = None
    lease_secs: float = 5.0
    # HTTP worker processes (docs/operations.md, "Several worker processes")
    workers: int = 1
    # the Mooncake conductor's dialect on its own port (docs/api.md); None: off
    mooncake_port: int | None = None
    # --mooncake-port-open: the dialect port needs no --api-key (docs/security.md)
    mooncake_open: bool = False
    # Dynamo's standalone indexer dialect on its own port (docs/api.md); None: off
    dynamo_port: int | None = None
    # --dynamo-port-open: that port needs no --api-key (docs/security.md)
    dynamo_open: bool = False
    # --workers N: a worker inside a read section of the shared index this long after the
    # ingest thread started waiting for it is stalled: the others go on, it is killed
    reader_stall_ms: int = 500
    #: ``--query-path``: ``protocol`` (answered by the HTTP protocol,
    #: :mod:`kvconductor.http.direct`) or ``asgi`` (by the ASGI app); see :meth:`query_path_used`.
    query_path: str = "protocol"

    def with_snapshot_default(
        self, port: int | None, env: Mapping[str, str] | None = None
    ) -> Settings:
        """These settings with the default snapshot directory of ``port`` (the port
        served; None: none, e.g. gunicorn on a UNIX socket) when no flag chose:
        ``<state home>/kvconductor/<port>`` (:func:`default_snapshot_dir`). None is
        chosen with ``--snapshot-dir`` (kept as given), ``--no-snapshots``,
        ``--state-url`` (the state store keeps the snapshots), ``--load-dump`` (the
        dump is the start state) or port 0 (a new port, so a new directory, at every
        start). Nothing is created here."""
        if self.snapshot_dir or self.no_snapshots or self.state_url or self.load_dump:
            return self
        if not port:
            return self
        directory = default_snapshot_dir(port, env)
        if directory is None:
            return dataclasses.replace(
                self,
                snapshot_warning=(
                    "no default snapshot directory: neither XDG_STATE_HOME nor HOME is "
                    "an absolute path; running without snapshots: a restart starts cold "
                    "(give --snapshot-dir DIR, or --no-snapshots to run without them on "
                    "purpose)"
                ),
            )
        return dataclasses.replace(self, snapshot_dir=directory, snapshot_default=True)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    def describe(self) -> str:
        """The settings as ``key=value`` pairs for the startup log line (no secrets)."""
        return (
            f"maintenance_interval={max(1, self.maintenance_interval_secs)}s "
            f"pending_ttl={self.pending_ttl_secs}s content_ttl={self.content_ttl_secs}s "
            f"offload_ttl={self.offload_ttl_secs}s loss_grace={self.loss_grace_secs}s "
            f"source_down={self.source_down_secs}s source_purge={self.source_purge_secs}s "
            f"max_sources={self.max_sources} "
            f"replay_deadline={max(1, self.replay_deadline_secs)}s "
            f"max_message_mb={self.max_message_mb:g} "
            f"max_blocks_per_message={self.max_blocks_per_message} "
            f"max_blocks_per_source={self.max_blocks_per_source} "
            f"max_body_bytes={self.max_body_bytes} "
            f"log_level={self.log_level} log_format={self.log_format} "
            f"auth={'on' if self.api_key else 'off'} "
            f"endpoints={self._endpoint_rule()} "
            f"snapshots={self._snapshot_rule()} "
            f"query_path={self.query_path_used()}"
        )

    def query_path_used(self) -> str:
        """The query path the servers take: ``asgi`` when asked, without httptools (the
        direct path needs its parser callbacks), or when uvicorn or httptools is outside
        the tested range (:func:`kvconductor.http.fence.query_path`, one WARN)."""
        import importlib.util

        from kvconductor.http.fence import query_path

        if importlib.util.find_spec("httptools") is None:
            return "asgi"
        return query_path(self.query_path)

    def _snapshot_rule(self) -> str:
        if self.state_url:
            return f"state-store@{self.snapshot_interval_secs}s lease={self.lease_secs:g}s"
        if not self.snapshot_dir:
            return "off"
        return f"{self.snapshot_dir}@{self.snapshot_interval_secs}s"

    def _endpoint_rule(self) -> str:
        rule = "tcp-connect"
        if self.allow_bind_endpoints:
            rule += "+bind"
        if self.allow_ipc_endpoints:
            rule += "+ipc"
        if self.endpoint_networks:
            rule += "@" + ",".join(str(n) for n in self.endpoint_networks)
        return rule

    def http_limits(self):
        """The :class:`kvconductor.http.limits.HttpLimits` of these flags."""
        from kvconductor.http.limits import HttpLimits

        return HttpLimits(
            max_head_bytes=self.max_header_kb * 1024,
            request_timeout=float(self.request_timeout_secs),
            keep_alive=float(self.keep_alive_secs),
            max_connections=self.max_connections,
        )

    def describe_http(self) -> str:
        """The network-security settings as ``key=value`` pairs (no secrets)."""
        return (
            f"tls={'on' if self.tls_cert else 'off'} "
            f"client_certs={'on' if self.tls_client_ca else 'off'} "
            f"allow_origins={','.join(self.allow_origins) or '-'} "
            f"workers={'open' if self.open_workers or not self.api_key else 'token'}"
        )

    def conductor_config(self):
        from kvconductor.ingest.host import IngestSettings
        from kvconductor.ingest.stats import Limits
        from kvconductor.predict import PredictionLimits
        from kvconductor.state.conductor import ConductorConfig
        from kvconductor.urls import UrlPolicy

        return ConductorConfig(
            maintenance_interval=max(1, self.maintenance_interval_secs),
            pending_ttl=float(self.pending_ttl_secs),
            content_ttl=float(self.content_ttl_secs),
            offload_ttl=float(self.offload_ttl_secs),
            predictions=PredictionLimits(
                self.prediction_ttl_s,
                self.prediction_max_per_dp,
                self.prediction_max,
                self.prediction_max_blocks,
            ),
            ingest=IngestSettings(
                loss_grace=float(self.loss_grace_secs),
                replay_deadline=float(max(1, self.replay_deadline_secs)),
                source_down=float(self.source_down_secs),
                source_purge=float(self.source_purge_secs),
                limits=Limits(
                    max_message_bytes=int(self.max_message_mb * 1024 * 1024),
                    max_blocks_per_message=self.max_blocks_per_message,
                    max_blocks_per_source=self.max_blocks_per_source,
                ),
            ),
            max_sources=self.max_sources,
            url_policy=UrlPolicy(
                allow_bind=self.allow_bind_endpoints,
                allow_ipc=self.allow_ipc_endpoints,
                networks=self.endpoint_networks,
            ),
        )
