"""Shared fixtures: the base image and the ``root`` marker; how the suite is split between pytest-xdist workers.

Missing prerequisites skip locally and fail under CI (``CI`` set), always naming the fix.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from container_support import SESSION_TAGS, home_tag, images_dir, short_home
from dsec.backends.base import ImageRef
from dsec.errors import ImageNotFound
from dsec.images.image_store import ImageStore
from dsec.isolation.network import dsec_tables

IN_CI = bool(os.environ.get("CI"))


def missing(reason: str) -> None:
    """Skip locally, fail in CI: a prerequisite CI must provide is absent."""
    if IN_CI:
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)




@pytest.fixture(scope="session")
def debian_python_image() -> Iterator[ImageRef]:
    """The ``debian-python`` image (built by ``scripts/setup``), lazily mounted for the whole session.

    Every container test runs on it, so they all exercise the real chunked EROFS + FUSE path; the
    mount and its FUSE server are removed at the end of the session.
    """
    from dsec.config import Settings
    from dsec.images.node import NodeImages

    home = short_home("dsec-img-")
    node = NodeImages(Settings(home=home, images_dir=images_dir()))
    try:
        ref = node.resolve("debian-python")
    except ImageNotFound:
        shutil.rmtree(home, ignore_errors=True)
        missing(f"image debian-python not in {images_dir()}: run ./scripts/setup "
                "(or `dsec image build debian-python`)")
        raise  # unreachable: missing() always raises
    except BaseException:
        node.aclose_sync(unmount=True)
        shutil.rmtree(home, ignore_errors=True)
        raise
    try:
        yield ref
    finally:
        node.release(ref)
        node.aclose_sync(unmount=True)
        shutil.rmtree(home, ignore_errors=True)


# Tests on the session's guest homes (vm_home, microvm_home), named by test id: the scheduler runs in pytest-xdist's
# controller, which sees only ids. Some pick a home at run time (``request.getfixturevalue``).
_GUEST_MODULES = frozenset({"tests/backends/test_microvm.py", "tests/backends/test_vm.py",
                            "tests/integration/functional/test_microvm_sdk.py",
                            "tests/integration/faults/test_qemu_killed.py",
                            "tests/integration/security/test_network_policy.py"})
_GUEST_TESTS = frozenset({"tests/integration/functional/test_examples.py::test_computer_use_example"})
_GUEST_PARAMS = {"tests/integration/security/test_redteam.py": ("vm-", "microvm-")}  # its arena comes first


def xdist_group(nodeid: str) -> str:
    """The group of a test under ``scripts/test``'s two workers (each group runs whole on one worker): every test on
    the session's guest homes runs on one worker, which cold-boots each template once (minutes under TCG); any
    other test runs with the rest of its module, so module- and class-scoped fixtures (a daemon, a shared sandbox, a
    PostgreSQL) start once."""
    module, _, rest = nodeid.partition("::")
    arenas = _GUEST_PARAMS.get(module)
    if module in _GUEST_MODULES or nodeid in _GUEST_TESTS or (arenas and rest.partition("[")[2].startswith(arenas)):
        return "guests"
    return module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` by :func:`xdist_group` (pytest-xdist's own reads a test id suffix that pytest 9.2 no
    longer shows, and so spreads a module's tests over both workers)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return Groups(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that asks for a session guest home by name must be in the guests group (else a second worker
    cold-boots its templates again)."""
    stray = [item.nodeid for item in items if {"vm_home", "microvm_home"} & set(getattr(item, "fixturenames", ()))
             and xdist_group(item.nodeid) != "guests"]
    if stray:
        raise pytest.UsageError(f"tests on vm_home/microvm_home outside tests/conftest.py's guest tables: {stray[:5]}")


_TERMINAL_ENV = ("COLUMNS", "LINES")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist's controller: the workers start with COLUMNS=80 and LINES=24 set, which the CLI's tables
    would obey; hand them this process's values instead."""
    node.workerinput["dsec_terminal_env"] = {name: os.environ.get(name) for name in _TERMINAL_ENV}


def pytest_configure(config: pytest.Config) -> None:
    for name, value in getattr(config, "workerinput", {}).get("dsec_terminal_env", {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("root") is not None and os.geteuid() != 0:
        missing("needs root (run the tests as root: sudo ./scripts/test)")


def _session_tags(base: Path) -> set[str]:
    """Tags of every directory under this session's temporary root (each may be a test's DSEC_HOME)."""
    tags = set()
    for path in [base, *base.glob("*"), *base.glob("*/*"), *base.glob("*/*/*")]:
        if path.is_dir() and not path.is_symlink():
            tags.add(home_tag(path))
    return tags


def _host_footprint(tags: set[str]) -> set[str]:
    """Mounts under /run/dsec, DSec cgroup directories (container, microvm, function), the VM backends' run
    directories, dsec-init, QEMU and dsec-zygote processes of this session's homes.

    Only this session's tags count, so test runs in other checkouts on the same host do not trip it.
    """
    found = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point.startswith("/run/dsec/") and point.split("/")[3] in tags:
            found.add(f"mount {point}")
        if "/lazy/" in point and home_tag(Path(point.split("/lazy/")[0])) in tags:
            found.add(f"image mount {point}")  # NodeImages: EROFS images and the FUSE blob mount
    for state in Path("/dev/shm").glob("dsec-*/*/sb-*"):  # ContainerBackend.state_root: bundles, crun state
        if state.parent.parent.name.removeprefix("dsec-") in tags:
            found.add(f"sandbox state {state}")
    for cg in Path("/sys/fs/cgroup").glob("*/dsec-*"):
        tag = cg.name.removeprefix("dsec-").removesuffix("-fn")  # the function backend's parent: dsec-<tag>-fn
        if cg.is_dir() and not cg.parent.is_symlink() and tag in tags:
            found.add(f"cgroup {cg}")
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                # A zombie holds no resource; it waits for whichever pid 1 adopted it (a sandbox
                # re-adopted across a daemon restart is no longer the new daemon's child).
                comm = (proc / "comm").read_text().strip()
                if state != "Z" and comm == "dsec-mntns":  # a container home's mount holder: argv names its tag
                    argv = (proc / "cmdline").read_bytes().split(b"\0")
                    if len(argv) > 2 and argv[2].decode(errors="replace") in tags:
                        found.add(f"process dsec-mntns pid {proc.name}")
                    continue
                if state == "Z" or not (comm in ("dsec-init", "qemu-system-x86") or comm.startswith("dsec-zygote")):
                    continue
                cgroups = (proc / "cgroup").read_text()
                cmdline = (proc / "cmdline").read_bytes()
            except (OSError, IndexError):
                continue
            # microvm's run directories are /run/dsec-vm/<tag>/, vm's /run/dsec-vm/<tag>.vm/
            if comm == "qemu-system-x86" and any(f"/run/dsec-vm/{tag}/".encode() in cmdline
                                                 or f"/run/dsec-vm/{tag}.vm/".encode() in cmdline for tag in tags):
                found.add(f"process qemu pid {proc.name}")
            if comm != "qemu-system-x86" and any(f"/dsec-{tag}/" in cgroups or f"/dsec-{tag}-fn/" in cgroups
                                                for tag in tags):
                found.add(f"process {comm} pid {proc.name}")
    for name in dsec_tables():  # dsec_<tag> (container), dsec_<tag>_microvm
        if name.removeprefix("dsec_").split("_")[0] in tags:
            found.add(f"nft table {name}")
    for run in Path("/run/dsec-vm").glob("*"):  # microvm's /run/dsec-vm/<tag>, vm's /run/dsec-vm/<tag>.vm
        if run.name.removesuffix(".vm") in tags:
            found.add(f"VM run directory {run}")
    for netns in Path("/run/netns").glob("dsvm-*"):  # microvm's dsvm-<tag>-<id>, vm's dsvm-<tag>.vm-<id>
        if netns.name.split("-")[1].split(".")[0] in tags:
            found.add(f"network namespace {netns.name}")
    for proc in Path("/proc").iterdir():  # lazy image filesystem servers of this session's homes
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
        except OSError:
            continue
        if b"dsec.images.lazyfs" in argv and b"--cache" in argv:
            cache = Path(argv[argv.index(b"--cache") + 1].decode())
            if home_tag(cache.parent) in tags:
                found.add(f"process lazyfs pid {proc.name}")
    return found


def _session_home(variable: str, prefix: str) -> Iterator[Path]:
    """A session's home, removed afterwards, or the one ``variable`` names (kept: its templates outlive the run)."""
    kept = os.environ.get(variable)
    if kept:
        path = Path(kept)
        path.mkdir(parents=True, exist_ok=True)
        SESSION_TAGS.add(home_tag(path))
        yield path
        return
    path = short_home(prefix)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def vm_home() -> Iterator[Path]:
    """One DSEC_HOME for every module that runs the ``vm`` backend (tests/backends/test_vm.py, the red-team
    suite, the network policies, the computer-use example's daemon): they share its template of the
    ``debian-desktop`` image, so a session cold-boots that VM once (minutes under TCG) and every later sandbox is
    restored in seconds. ``DSEC_TEST_VM_HOME`` names a home to reuse across sessions instead (kept afterwards;
    its templates spare a developer the cold boot)."""
    yield from _session_home("DSEC_TEST_VM_HOME", "dsec-fvm-")


@pytest.fixture(scope="session")
def microvm_home() -> Iterator[Path]:
    """One DSEC_HOME for every module that only needs a working ``microvm`` backend (tests/backends/test_microvm.py,
    the network policies, the red-team suite, the SDK, inspect and QEMU-killed tests): they share its templates, so
    a session cold-boots each template shape once under TCG. Tests that break a template, re-adopt guests across a
    restart or sweep orphans use homes of their own. ``DSEC_TEST_MICROVM_HOME`` names a home to reuse across
    sessions instead (kept afterwards)."""
    from dsec.errors import DSecError
    from dsec.guest.kernel import default_guest_dir, find_kernel

    try:
        find_kernel(default_guest_dir())
    except DSecError as e:
        missing(str(e))
    yield from _session_home("DSEC_TEST_MICROVM_HOME", "dsec-fmv-")


@pytest.fixture(scope="session", autouse=True)
def no_host_leftovers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The whole run must leave no mount, cgroup or sandbox process behind, even when tests fail."""
    yield
    leaked = sorted(_host_footprint(_session_tags(tmp_path_factory.getbasetemp()) | SESSION_TAGS))
    assert not leaked, "tests left host resources behind:\n" + "\n".join(leaked[:50])


@pytest.fixture
def image_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[ImageStore, str], Path]]:
    """``image_root(store, name)``: the image mounted as a node mounts it (chunked EROFS over the lazy
    FUSE blob), to read what an import stored; every mount and server is removed at teardown."""
    from dsec.config import Settings
    from dsec.images.node import NodeImages

    nodes: dict[int, NodeImages] = {}
    base = tmp_path_factory.mktemp("image-root")

    def root(store: ImageStore, name: str) -> Path:
        node = nodes.get(id(store))
        if node is None:
            home = base / str(len(nodes))
            node = nodes[id(store)] = NodeImages(Settings(home=home, images_dir=store.root), store, tag_ttl=0)
        ref = node.resolve(name)
        node.release(ref)
        return ref.rootfs

    try:
        yield root
    finally:
        for node in nodes.values():
            node.aclose_sync(unmount=True)


# ------------------------------------------------------------------ red-team table (tests/integration/security)
_REDTEAM_PROPERTY = "dsec-redteam-cell"
# (attack, arena) -> (cell, note), filled by pytest_runtest_logreport in the process that reports: the controller
# under xdist, else the only one.
_REDTEAM_SEEN: dict[tuple[str, str], tuple[str, str]] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """Record each red-team attack's outcome per backend (``test_redteam.py``: params arena x attack_id)."""
    report: pytest.TestReport = yield
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "attack_id" in params and "arena" in params:
        import redteam

        reason = str(report.longrepr[2]) if report.skipped and isinstance(report.longrepr, tuple) else ""
        cell = redteam.outcome_of(report.when, report.outcome, reason, xfail=hasattr(report, "wasxfail"))
        if cell is not None:
            note = reason or (report.longreprtext.strip().splitlines() or [""])[-1][:300]
            # user_properties travel with the report from an xdist worker to the controller, which writes the table
            report.user_properties.append((_REDTEAM_PROPERTY, (params["attack_id"], params["arena"], cell, note)))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in report.user_properties:
        if name == _REDTEAM_PROPERTY:
            attack, arena, cell, note = value
            _REDTEAM_SEEN[(attack, arena)] = (cell, note)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    cells = _REDTEAM_SEEN
    if not cells or hasattr(config, "workerinput"):
        return
    # An xdist controller collects no test module, so the suite's directory is not on its path yet.
    security = str(Path(__file__).parent / "integration" / "security")
    if security not in sys.path:
        sys.path.insert(0, security)
    import redteam

    report = redteam.build_report(cells)
    path = redteam.report_path(config.rootpath)
    redteam.write_report(report, path)
    terminalreporter.section("red-team: attack x backend")
    terminalreporter.write_line(redteam.format_table(report))
    terminalreporter.write_line(f"(written to {path})")
