"""Running buildah for Dockerfile builds: as an unprivileged build user where the node has one, in storage
that keeps the layer cache between builds.

Owns the buildah command lines (build, pull of an exported base, push as an OCI layout, inspect, tag), the
build user and the environment buildah runs in, the storage locations, and the reading of buildah's output
into an error that names the failing step. Rootless when the node has the build user with subordinate ids
(``scripts/setup`` makes ``dsec-build``): every ``RUN`` step then runs in a user namespace whose root is
that user, never the host's root; without one, buildah runs as root with runc. It never writes into
DSec's image store and never parses a Dockerfile (:mod:`dsec.images.dockerfile` does).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.config import Settings
from dsec.errors import BackendUnavailable, BuildFailed, DSecError

__all__ = ["BUILD_USER", "BuildOutput", "Builder", "PruneResult"]

BUILD_USER = "dsec-build"
"""The unprivileged user builds run as (``DSEC_BUILD_USER``); ``scripts/setup`` creates it with subordinate ids."""

_TAIL_LINES = 40
_STEP_RE = re.compile(r"^(?:\[(\d+)/(\d+)\] )?STEP (\d+)/(\d+): (.*)$")
_FAILED_RE = re.compile(r'^Error: building at STEP "(.*?)": (.*)$', re.S)
_EXIT_RE = re.compile(r"exit status (\d+)")


def _subordinate(user: str, path: Path) -> bool:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return False
    return any(line.split(":", 1)[0] == user for line in lines)


def build_user(name: str | None = None) -> pwd.struct_passwd | None:
    """The build user when it exists with subordinate uids and gids (what rootless buildah needs), else None."""
    name = name or os.environ.get("DSEC_BUILD_USER") or BUILD_USER
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return None
    if entry.pw_uid == 0 or not (_subordinate(name, Path("/etc/subuid")) and _subordinate(name, Path("/etc/subgid"))):
        return None
    return entry


@dataclass(frozen=True)
class PruneResult:
    """What :meth:`Builder.prune` removed: images and cache layers, leftover work directories, bytes freed."""

    images: int
    work_dirs: int
    bytes: int
    skipped: str | None = None
    """Why nothing was pruned (the storage caches builds for another store)."""


def _disk_usage(path: Path) -> int:
    total = 0
    for top, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
    return total


@dataclass
class BuildOutput:
    """What a build printed: every line goes to ``sink``; the last lines and the current step are kept."""

    sink: Callable[[str], None]
    step: str | None = None
    step_line: str | None = None

    def __post_init__(self) -> None:
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)

    def feed(self, line: str) -> None:
        self.tail.append(line)
        match = _STEP_RE.match(line)
        if match:
            self.step, self.step_line = match.group(5), line
        self.sink(line)

    def error(self, name: str, returncode: int) -> DSecError:
        """The error a failed build raises: the step buildah names (else the last one started), its exit
        status when a command failed, and the last lines of output."""
        output = "\n".join(self.tail)
        errors = [line for line in self.tail if line.startswith("Error: ")]
        last = errors[-1] if errors else ""
        match = _FAILED_RE.match(last)
        step = match.group(1) if match else self.step
        reason = (match.group(2) if match else last.removeprefix("Error: ")) or f"buildah exited {returncode}"
        exit_status = _EXIT_RE.search(reason) if match else None
        where = f" at step {step!r}" if step else ""
        status = f" (the command exited {exit_status.group(1)})" if exit_status else ""
        return BuildFailed(f"building image {name!r} failed{where}{status}: {reason}\n--- last output ---\n{output}",
                           image=name, step=step, exit_status=int(exit_status.group(1)) if exit_status else None,
                           output=output)


class Builder:
    """buildah on this node: where its storage is, which user it runs as, and the commands it runs."""

    def __init__(self, settings: Settings, user: pwd.struct_passwd | bool | None = True) -> None:
        exe = shutil.which("buildah")
        if exe is None:
            raise BackendUnavailable("Dockerfile builds need buildah: `apt-get install buildah` (scripts/setup "
                                     "installs it)", package="buildah")
        self.exe = exe
        self.user = build_user() if user is True else (user or None)
        self.root = settings.build_root
        key = hashlib.sha256(str(self.root.resolve()).encode()).hexdigest()[:12]
        self.runtime_dir = Path("/run/dsec-build") / f"{'user' if self.user else 'root'}-{key}"
        self.storage = self.root / ("storage" if self.user else "storage-root")
        self.work = self.root / "work"
        self.store_url = settings.image_store

    @property
    def rootless(self) -> bool:
        """True when builds run as the unprivileged build user."""
        return self.user is not None

    def prepare(self) -> None:
        """Create the storage, work and runtime directories, owned by the build user; record which store the
        builds go to (pruning keeps what that store has)."""
        for path in (self.root, self.storage, self.work, self.root / "digests", self.runtime_dir.parent,
                     self.runtime_dir):
            path.mkdir(mode=0o700 if path != self.runtime_dir.parent else 0o755, parents=True, exist_ok=True)
            if self.user is not None and path not in (self.runtime_dir.parent, self.root / "digests"):
                os.chown(path, self.user.pw_uid, self.user.pw_gid)
        marker = self.root / "store"
        if not marker.is_file() or marker.read_text().strip() != self.store_url:
            marker.write_text(self.store_url + "\n")
        if self.user is not None and not _reachable(self.root, self.user):
            raise BackendUnavailable(f"the build user {self.user.pw_name!r} cannot reach the build root "
                                     f"{self.root}: every directory above it must be searchable by others "
                                     "(set DSEC_BUILD_ROOT, default /var/lib/dsec-build)", path=str(self.root))

    def give(self, path: Path) -> None:
        """Hand ``path`` (a work directory and everything in it) to the build user."""
        if self.user is None:
            return
        uid, gid = self.user.pw_uid, self.user.pw_gid
        os.chown(path, uid, gid)
        for top, dirs, files in os.walk(path):
            for name in (*dirs, *files):
                os.lchown(os.path.join(top, name), uid, gid)

    def argv(self, *args: str) -> list[str]:
        """A buildah command line on this node's storage."""
        return [self.exe, "--root", str(self.storage), "--runroot", str(self.runtime_dir / "storage"),
                "--storage-driver", "overlay", *args]

    def env(self, tmp: Path) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "TMPDIR": str(tmp),
               "XDG_RUNTIME_DIR": str(self.runtime_dir), "LANG": "C.UTF-8", "BUILDAH_ISOLATION": "oci"}
        env["HOME"] = self.user.pw_dir if self.user is not None else "/root"
        return env

    def run_args(self) -> list[str]:
        """How ``RUN`` steps run: with runc (crun refuses hybrid cgroups), cgroupfs; as the build user, rootless
        isolation, whose private network is slirp4netns (OCI isolation would reach for a CNI bridge, which a user
        without privileges cannot create)."""
        runc = shutil.which("runc")
        args = ["--isolation", "rootless" if self.user is not None else "oci"]
        if runc is not None:
            args += ["--runtime", runc]
        return args

    def _popen(self, argv: Sequence[str], tmp: Path) -> subprocess.Popen[str]:
        kwargs: dict[str, object] = {}
        if self.user is not None:
            kwargs = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", env=self.env(tmp), cwd=str(tmp), start_new_session=True, **kwargs)

    def stream(self, argv: Sequence[str], tmp: Path, output: BuildOutput,
               cancel: threading.Event | None = None) -> int:
        """Run ``argv``, feeding each output line to ``output``; its exit status. ``cancel`` (set from another
        thread) stops it: SIGTERM to its process group, SIGKILL 10 s later."""
        with self._process(argv, tmp, cancel) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                output.feed(line.rstrip("\n"))
            return proc.wait()

    def run(self, argv: Sequence[str], tmp: Path, what: str) -> str:
        """Run a short buildah command; its output, or :class:`DSecError` quoting it."""
        with self._process(argv, tmp, None) as proc:
            out, _ = proc.communicate()
        if proc.returncode != 0:
            raise DSecError(f"buildah failed {what} (exit {proc.returncode}): {out.strip()[-2000:]}",
                            command=list(argv))
        return out

    @contextlib.contextmanager
    def _process(self, argv: Sequence[str], tmp: Path, cancel: threading.Event | None
                 ) -> Iterator[subprocess.Popen[str]]:
        proc = self._popen(argv, tmp)
        done = threading.Event()

        def watch() -> None:
            assert cancel is not None
            while not done.is_set():
                if cancel.wait(0.5):
                    _stop(proc)
                    return

        watcher = threading.Thread(target=watch, daemon=True, name="buildah-cancel") if cancel else None
        if watcher is not None:
            watcher.start()
        try:
            yield proc
        finally:
            done.set()
            if proc.poll() is None:
                _stop(proc)
            if proc.stdout is not None:
                proc.stdout.close()

    def prune(self, keep: Collection[str], grace: float = 3600.0) -> PruneResult:
        """Shrink the builder's storage to the layer cache of images the store still has (``keep``: their
        names): remove the built and base images of any other name, older than ``grace`` seconds; drop the
        names buildah gave base exports after their paths; remove the cache layers nothing leads to any more;
        remove work directories of builds that ended without cleaning up. Never touches DSec's store."""
        if not self.storage.is_dir():
            return PruneResult(0, 0, 0)
        marker = self.root / "store"
        if not marker.is_file():
            return PruneResult(0, 0, 0, skipped=f"no build has recorded its store in {self.root} yet")
        serves = marker.read_text().strip()
        if serves != self.store_url:
            return PruneResult(0, 0, 0, skipped=f"{self.root} caches the builds of store {serves}, not "
                               f"{self.store_url} (set DSEC_IMAGES/DSEC_IMAGE_STORE to it)")
        before = _disk_usage(self.storage)
        self.prepare()
        tmp = Path(tempfile.mkdtemp(prefix="prune-", dir=self.work))
        self.give(tmp)
        removed = 0
        try:
            cutoff = time.time() - grace
            for image in json.loads(self.run(self.argv("images", "--json"), tmp, "listing images") or "[]"):
                removed += self._prune_names(image, set(keep), cutoff, tmp)
            for _ in range(64):  # each pass frees the layers the previous one orphaned
                gone = self._prune_layers(cutoff, tmp)
                removed += gone
                if not gone:
                    break
            self._forget_bases(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        work = 0
        for entry in self.work.iterdir():
            if entry.is_dir() and entry.stat().st_mtime < time.time() - grace:
                shutil.rmtree(entry, ignore_errors=True)
                work += 1
        return PruneResult(removed, work, max(before - _disk_usage(self.storage), 0))

    def _prune_names(self, image: dict[str, Any], keep: set[str], cutoff: float, tmp: Path) -> int:
        names: list[str] = image.get("names") or []
        path_name = "localhost" + str(self.work.resolve())
        stale = [n for n in names if n.startswith(path_name)]
        old = float(image.get("created") or 0) < cutoff
        for name in names:
            short = name.removeprefix("localhost/").removeprefix("dsec-build/").removesuffix(":latest")
            if name.startswith("localhost/") and name not in stale and short not in keep and old:
                stale.append(name)
        ok = False
        for name in stale:
            # By name: only the name goes while the image has others; refused while a layer or container uses it.
            proc = self._popen(self.argv("rmi", name), tmp)
            proc.communicate()
            ok = proc.returncode == 0
        return int(ok and len(stale) == len(names))  # the image itself went with its last name

    def _prune_layers(self, cutoff: float, tmp: Path) -> int:
        """Remove unnamed images older than ``cutoff``: buildah refuses those a layer or a container (a build
        in flight) still uses, so only the cache layers nothing leads to go."""
        out = self.run(self.argv("images", "--all", "--json", "--filter", "dangling=true"), tmp, "listing layers")
        removed = 0
        for image in json.loads(out or "[]"):
            if image.get("names") or float(image.get("created") or 0) >= cutoff:
                continue
            proc = self._popen(self.argv("rmi", str(image["id"])), tmp)
            proc.communicate()
            removed += proc.returncode == 0
        return removed

    def _forget_bases(self, tmp: Path) -> None:
        """Drop the base-export records (digest -> image id) whose image is gone."""
        digests = self.root / "digests"
        for record in digests.iterdir() if digests.is_dir() else ():
            image_id = record.read_text().strip()
            if not image_id or not self.image_exists(image_id, tmp):
                record.unlink(missing_ok=True)

    def image_exists(self, image_id: str, tmp: Path) -> bool:
        """True when the builder's storage holds image ``image_id``."""
        proc = self._popen(self.argv("inspect", "--type", "image", "--format", "{{.FromImageID}}", image_id), tmp)
        proc.communicate()
        return proc.returncode == 0


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM the process group (buildah removes its working containers), SIGKILL what is left after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 30.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _reachable(path: Path, user: pwd.struct_passwd) -> bool:
    """Whether ``user`` can search every directory above ``path`` (owner, or the others' x bit)."""
    for parent in path.resolve().parents:
        st = parent.stat()
        if st.st_uid != user.pw_uid and not st.st_mode & 0o001:
            return False
    return True
