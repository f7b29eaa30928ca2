"""``dsec/__init__.py`` is the public API and nothing else."""

from __future__ import annotations

import types

import dsec

EXPECTED = {
    "Sandbox", "AsyncSandbox", "Client", "ExecResult", "ExecEvent", "FileEntry", "SandboxInfo",
    "SandboxStats", "SandboxSpec", "DSecError", "SandboxNotFound", "SandboxTimeout", "ImageNotFound",
    "QuotaExceeded", "SandboxLost", "BackendUnavailable", "ReplayDivergence", "InvalidRequest", "NotSupported",
    "SandboxStateError", "SandboxError", "ConnectionFailed", "Unauthorized", "NotFound", "__version__",
    "RemoteError", "CallFailed", "DaemonStopping",
    "ImageCorrupt", "StoreUnavailable", "CacheFull",
    "PoolConfig", "NodeStatistics",
    "Forbidden", "RateLimited",
    "AuditEntry", "LifecycleEvent", "NodeOverview",
    "BuildFailed", "ImageInfo",
    "BatchDestroyResult",  # what close_many answers
    # the sandbox surface: process handles, shell sessions, file operations and their errors, ports
    "AsyncFiles", "AsyncProcess", "AsyncProcesses", "AsyncShell", "Files", "Process", "Processes", "Shell",
    "AsyncWatch", "Watch",
    "FileEvent", "FileStat", "PortInfo", "ProcessEvent", "ProcessInfo", "ShellInfo", "ShellResult",
    "SandboxFileError", "FileNotFound", "IsADirectory", "NotADirectory", "FileExists", "DirectoryNotEmpty",
    "PermissionDenied", "UserNotFound", "ProcessNotFound",
    # trajectories by name: listed, ended, deleted
    "AsyncTrajectory", "Trajectory", "TrajectoryInfo",
}


def test_all_is_exactly_the_public_api() -> None:
    assert set(dsec.__all__) == EXPECTED
    assert len(dsec.__all__) == len(EXPECTED)
    for name in dsec.__all__:
        assert hasattr(dsec, name), name


def test_nothing_private_leaks() -> None:
    # Submodules appear as attributes once imported; anything else public must be in __all__.
    public = {n for n in vars(dsec) if not n.startswith("_")}
    extra = {n for n in public - set(dsec.__all__) if not isinstance(getattr(dsec, n), types.ModuleType)}
    assert extra == set()
    for name in dsec.__all__:
        obj = getattr(dsec, name)
        if isinstance(obj, type):
            assert not obj.__name__.startswith("_"), name


def test_errors_share_one_root_and_version_is_a_string() -> None:
    objects = [getattr(dsec, n) for n in dsec.__all__]
    errors = [o for o in objects if isinstance(o, type) and issubclass(o, Exception)]
    assert len(errors) == 33
    assert all(issubclass(e, dsec.DSecError) for e in errors)
    assert isinstance(dsec.__version__, str) and dsec.__version__.count(".") == 2
