"""Where DSec keeps things on a node, read from the environment once.

| variable | default | what |
| --- | --- | --- |
| ``DSEC_HOME`` | ``/var/lib/dsec`` | state: sandbox records, writable layers, sockets, logs |
| ``DSEC_IMAGES`` | ``$DSEC_HOME/images`` | the image store's local root (scratch space, locks) |
| ``DSEC_IMAGE_STORE`` | ``$DSEC_IMAGES/store`` | image chunks: a path (local, shared mount) or ``s3://B/P?endpoint=U``|
| ``DSEC_IMAGE_CACHE_MAX`` | none | size limit of the node's image chunk cache in bytes (LRU eviction) |
| ``DSEC_IMAGE_CACHE_MIN_FREE`` | 5% (1 GiB-20%) | free space the image cache keeps on its disk (bytes, ``N%``) |
| ``DSEC_URL`` | ``unix://$DSEC_HOME/run/dsec.sock`` | where clients find the daemon |
| ``DSEC_TOKEN`` | none | bearer token for the TCP API |
| ``DSEC_NODE`` | host name | node name reported in sandbox info |
| ``DSEC_UID_SHIFT`` | ``100000`` | host uid that container uid 0 maps to |
| ``DSEC_TRAJECTORY_DB`` | ``$DSEC_HOME/trajectories.db`` | trajectory log: a SQLite path or ``postgresql://...`` |
| ``DSEC_TRAJECTORY_SYNC`` | ``normal`` | SQLite log: ``normal`` (survives process crashes) or ``full`` (fsync) |
| ``DSEC_POOLS`` | none | warm pools, ``;``-separated ``IMAGE:BACKEND:min=N,max=N,...`` (as ``dsec serve --pool``) |
| ``DSEC_CREATE_SLOTS`` | ``32`` | creates run at once; more queue (see ``daemon/admission.py``) |
| ``DSEC_HOST_LIMITS`` | ``0`` | ``1``: raise pid_max, threads-max, inotify and file limits at start, restore at stop |
| ``DSEC_SANDBOX_CPU_IDLE`` | ``1`` | sandboxes sit in a SCHED_IDLE cgroup: the daemon preempts them when it wakes |
| ``DSEC_CONTROL_CPUS`` | none | housekeeping CPUs (``0``, ``0-1``): the daemon and its helpers; sandboxes keep all |
| ``DSEC_SNAPSHOT_STORE`` | the image store | where snapshots' chunks and records go (a path or ``s3://...``) |
| ``DSEC_AUDIT_DB`` | ``$DSEC_HOME/audit.db`` | the audit trail (SQLite): every command run in every sandbox |
| ``DSEC_AUDIT_MAX_ROWS`` | ``200000`` | commands the audit trail keeps (oldest evicted first) |
| ``DSEC_PORTS_BIND`` | ``127.0.0.1`` | the address exposed sandbox ports (``sb.expose``) listen on |
| ``DSEC_PORTS_ADVERTISE`` | ``DSEC_PORTS_BIND`` | the host name clients are given for them (the node's address) |
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Settings"]


@dataclass(frozen=True)
class Settings:
    """Node-local paths and identity."""

    home: Path = field(default_factory=lambda: Path(os.environ.get("DSEC_HOME", "/var/lib/dsec")))
    images_dir: Path | None = None
    node: str = field(default_factory=lambda: os.environ.get("DSEC_NODE") or socket.gethostname())
    uid_shift: int = field(default_factory=lambda: int(os.environ.get("DSEC_UID_SHIFT", "100000")))
    uid_count: int = 65536
    ports_bind: str = field(default_factory=lambda: os.environ.get("DSEC_PORTS_BIND", "127.0.0.1"))
    """Where exposed sandbox ports listen (``sb.expose``): loopback unless the node serves other machines."""
    ports_advertise: str | None = field(default_factory=lambda: os.environ.get("DSEC_PORTS_ADVERTISE") or None)
    """The host name clients are given for exposed ports (default: ``ports_bind``)."""
    trajectory_db: str | None = field(default_factory=lambda: os.environ.get("DSEC_TRAJECTORY_DB") or None)
    trajectory_sync: str = field(default_factory=lambda: os.environ.get("DSEC_TRAJECTORY_SYNC", "normal"))
    pools: tuple[str, ...] = field(
        default_factory=lambda: tuple(p for p in os.environ.get("DSEC_POOLS", "").split(";") if p.strip()))
    """Warm pools declared at start (``IMAGE:BACKEND[:min=N,max=N,cpu=C,memory=M,disk=D,pids=P,workdir=W]``)."""
    create_slots: int = field(default_factory=lambda: int(os.environ.get("DSEC_CREATE_SLOTS", "32")))
    """Creates that run at once; the rest queue in the admission."""
    host_limits: bool = field(default_factory=lambda: os.environ.get("DSEC_HOST_LIMITS", "0") == "1")
    """Raise the host's pid/thread/inotify/file limits at start and restore them at stop (opt-in)."""
    sandbox_cpu_idle: bool = field(default_factory=lambda: os.environ.get("DSEC_SANDBOX_CPU_IDLE", "1").strip().lower()
                                   not in {"0", "false", "no", "off"})
    """Put every sandbox's cgroups in a SCHED_IDLE group (``cpu.idle`` 1): the node's own processes (the daemon,
    the exec helper) preempt any sandbox when they wake (``cgroups.background_group``); ``0``: normal weight."""
    control_cpus: str | None = field(default_factory=lambda: os.environ.get("DSEC_CONTROL_CPUS", "").strip() or None)
    """Housekeeping CPUs (a CPU list): the daemon pins itself there at start, and so its exec helper, zygotes and
    crun; each sandbox's processes get the daemon's original CPUs back as they start (``isolation.affinity``)."""
    snapshot_store_url: str | None = None
    audit_db: Path | None = field(default_factory=lambda: Path(p) if (p := os.environ.get("DSEC_AUDIT_DB")) else None)
    audit_max_rows: int = field(default_factory=lambda: int(os.environ.get("DSEC_AUDIT_MAX_ROWS", "200000")))
    """Commands the audit trail keeps; older ones are evicted first."""

    def __post_init__(self) -> None:
        if self.images_dir is None:
            env = os.environ.get("DSEC_IMAGES")
            object.__setattr__(self, "images_dir", Path(env) if env else self.home / "images")

    @property
    def snapshot_store(self) -> str:
        """URL of the blob store snapshots go to (``DSEC_SNAPSHOT_STORE``; default the image store, where
        they share chunks with images and mount lazily like them)."""
        return self.snapshot_store_url or os.environ.get("DSEC_SNAPSHOT_STORE") or self.image_store

    @property
    def trajectory_log(self) -> str:
        """Where the trajectory log lives: a ``postgresql://`` URL or a SQLite file path."""
        return self.trajectory_db or str(self.home_trajectory_db)

    @property
    def home_trajectory_db(self) -> Path:
        """The home's own trajectory log file, where it lives unless ``DSEC_TRAJECTORY_DB`` names another."""
        return self.home / "trajectories.db"

    @property
    def audit_path(self) -> Path:
        """The audit trail's SQLite file."""
        return self.audit_db or self.home / "audit.db"

    @property
    def images(self) -> Path:
        """The image store directory."""
        assert self.images_dir is not None
        return self.images_dir

    @property
    def image_store(self) -> str:
        """URL of the image blob store (``DSEC_IMAGE_STORE``; default ``$DSEC_IMAGES/store``)."""
        return os.environ.get("DSEC_IMAGE_STORE") or str(self.images / "store")

    @property
    def build_root(self) -> Path:
        """Where Dockerfile builds keep buildah's storage (the layer cache) and their work directories
        (``DSEC_BUILD_ROOT``; default ``/var/lib/dsec-build``, the build user's home). Node-local; the build
        user must be able to reach it."""
        return Path(os.environ.get("DSEC_BUILD_ROOT") or "/var/lib/dsec-build")

    @property
    def image_cache_limit(self) -> int | None:
        """Byte limit of the node's image chunk cache (``DSEC_IMAGE_CACHE_MAX``), or None."""
        value = os.environ.get("DSEC_IMAGE_CACHE_MAX")
        return int(value) if value else None

    @property
    def image_cache_min_free(self) -> str | None:
        """Free space the image cache keeps on its disk (``DSEC_IMAGE_CACHE_MIN_FREE``: bytes or ``N%``), or None
        for the default (see :func:`dsec.images.cache.free_reserve`)."""
        return os.environ.get("DSEC_IMAGE_CACHE_MIN_FREE") or None

    @property
    def run_dir(self) -> Path:
        """Sockets and the pid file."""
        return self.home / "run"

    @property
    def socket_path(self) -> Path:
        """The daemon's unix socket."""
        return self.run_dir / "dsec.sock"

    @property
    def tokens_file(self) -> Path:
        """The TCP API's token file (job / admin tokens with rate limits): ``$DSEC_TOKENS`` or under the home."""
        return Path(os.environ.get("DSEC_TOKENS") or self.home / "tokens.json")

    @property
    def pid_file(self) -> Path:
        """Pid of a daemon started by ``dsec up``."""
        return self.run_dir / "dsec.pid"

    @property
    def log_file(self) -> Path:
        """Log of a daemon started by ``dsec up``."""
        return self.home / "log" / "dsec.log"

    @property
    def state_db(self) -> Path:
        """The sandbox records (SQLite, ``daemon/state.py``)."""
        return self.home / "sandboxes.db"

    @property
    def legacy_state_dir(self) -> Path:
        """Where an older daemon kept one JSON file per record: moved into :attr:`state_db` at start."""
        return self.home / "sandboxes"

    @property
    def default_url(self) -> str:
        """URL clients use when ``DSEC_URL`` is unset."""
        return os.environ.get("DSEC_URL") or f"unix://{self.socket_path}"
