"""DSec: isolated, stateful sandboxes for training and evaluating AI agents.

This module is the public API and nothing else; everything it names is listed in ``__all__``
(a test keeps the two in step). Implementation lives in private modules (``dsec._sdk``) and in the
daemon packages, which users never need to import.
"""

from dsec._sdk.client import Client
from dsec._sdk.sandbox import AsyncSandbox
from dsec._sdk.sync import Sandbox
from dsec._version import __version__
from dsec.errors import (
    BackendUnavailable,
    BuildFailed,
    CacheFull,
    CallFailed,
    ConnectionFailed,
    DaemonStopping,
    DSecError,
    Forbidden,
    ImageCorrupt,
    ImageNotFound,
    InvalidRequest,
    NotFound,
    NotSupported,
    QuotaExceeded,
    RateLimited,
    RemoteError,
    ReplayDivergence,
    SandboxError,
    SandboxLost,
    SandboxNotFound,
    SandboxStateError,
    SandboxTimeout,
    StoreUnavailable,
    Unauthorized,
)
from dsec.models import (
    AuditEntry,
    ExecEvent,
    ExecResult,
    FileEntry,
    ImageInfo,
    LifecycleEvent,
    NodeOverview,
    NodeStatistics,
    PoolConfig,
    SandboxInfo,
    SandboxSpec,
    SandboxStats,
)

__all__ = [
    "AsyncSandbox",
    "AuditEntry",
    "BackendUnavailable",
    "BuildFailed",
    "CacheFull",
    "CallFailed",
    "Client",
    "ConnectionFailed",
    "DSecError",
    "DaemonStopping",
    "ExecEvent",
    "ExecResult",
    "FileEntry",
    "Forbidden",
    "ImageCorrupt",
    "ImageInfo",
    "ImageNotFound",
    "InvalidRequest",
    "LifecycleEvent",
    "NodeOverview",
    "NodeStatistics",
    "NotFound",
    "NotSupported",
    "PoolConfig",
    "QuotaExceeded",
    "RateLimited",
    "RemoteError",
    "ReplayDivergence",
    "Sandbox",
    "SandboxError",
    "SandboxInfo",
    "SandboxLost",
    "SandboxNotFound",
    "SandboxSpec",
    "SandboxStateError",
    "SandboxStats",
    "SandboxTimeout",
    "StoreUnavailable",
    "Unauthorized",
    "__version__",
]
