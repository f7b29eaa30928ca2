"""Request and response models shared by the SDK, the node daemon and the gateway.

One definition per message: the HTTP API, the OpenAPI document and the SDK all come
from these classes. Binary fields (``stdout``, ``stdin``...) travel as base64 in JSON.
This package does no I/O.

Owns the import path ``dsec.models``: every model and parser is importable from here, whichever
module of the package defines it (``common``, ``sandbox``, ``exec``, ``trajectory``, ``images``,
``node``); the sandbox surface's models are imported from their own module, :mod:`dsec.models.surface`. Must
never define a model itself.
"""

from dsec.models.common import (
    BackendName,
    LimitHit,
    NetworkEntry,
    SandboxState,
    check_mapping,
    id_hash,
    ids_digest,
    parse_network,
    parse_pairs,
    parse_size,
)
from dsec.models.common import Model as Model
from dsec.models.common import Size as Size
from dsec.models.exec import (
    CallBatch,
    CallBatchResult,
    CallOptions,
    CallOutcome,
    CallRequest,
    CallResult,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
)
from dsec.models.images import (
    ImageBuildEvent,
    ImageBuildRequest,
    ImageConfig,
    ImageInfo,
)
from dsec.models.images import ImagePullRequest as ImagePullRequest
from dsec.models.node import (
    AdmissionStatistics,
    AuditEntry,
    ComponentHealth,
    CounterSample,
    LifecycleEvent,
    NodeInfo,
    NodeLoad,
    NodeOverview,
    NodeStatistics,
    PoolConfig,
    PoolStatistics,
)
from dsec.models.node import AuditOutcome as AuditOutcome
from dsec.models.node import ComponentState as ComponentState
from dsec.models.node import LifecycleKind as LifecycleKind
from dsec.models.sandbox import (
    BatchCreateEvent,
    BatchCreateRequest,
    BatchDestroyRequest,
    BatchDestroyResult,
    ForkRequest,
    KeyboardRequest,
    MouseRequest,
    NetworkRequest,
    NodeEndpoint,
    SandboxInfo,
    SandboxRecord,
    SandboxSpec,
    SandboxStats,
    SnapshotRef,
    TimeoutRequest,
)
from dsec.models.trajectory import (
    LoggedCall,
    TrajectoryForkRequest,
    TrajectoryInfo,
    TrajectoryStatus,
)

__all__ = [
    "AdmissionStatistics",
    "AuditEntry",
    "BackendName",
    "BatchCreateEvent",
    "BatchCreateRequest",
    "BatchDestroyRequest",
    "BatchDestroyResult",
    "CallBatch",
    "CallBatchResult",
    "CallOptions",
    "CallOutcome",
    "CallRequest",
    "CallResult",
    "ComponentHealth",
    "CounterSample",
    "ExecEvent",
    "ExecRequest",
    "ExecResult",
    "FileEntry",
    "ForkRequest",
    "ImageBuildEvent",
    "ImageBuildRequest",
    "ImageConfig",
    "ImageInfo",
    "KeyboardRequest",
    "LifecycleEvent",
    "LimitHit",
    "LoggedCall",
    "MouseRequest",
    "NetworkEntry",
    "NetworkRequest",
    "NodeEndpoint",
    "NodeInfo",
    "NodeLoad",
    "NodeOverview",
    "NodeStatistics",
    "PoolConfig",
    "PoolStatistics",
    "SandboxInfo",
    "SandboxRecord",
    "SandboxSpec",
    "SandboxState",
    "SandboxStats",
    "SnapshotRef",
    "TimeoutRequest",
    "TrajectoryForkRequest",
    "TrajectoryInfo",
    "TrajectoryStatus",
    "check_mapping",
    "id_hash",
    "ids_digest",
    "parse_network",
    "parse_pairs",
    "parse_size",
]
