"""Building images from Debian packages with ``mmdebstrap``, then importing them into the store.

This module owns the build recipes (``debian-python`` ...) and the mmdebstrap command line, including
which of the host's apt sources and apt options are passed on. It never edits the host's apt
configuration and never writes into the store except through :meth:`ImageStore.import_dir`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from dsec.config import Settings
from dsec.errors import BackendUnavailable, DSecError, InvalidRequest
from dsec.images.image_store import ImageStore, validate_name
from dsec.models import ImageConfig, ImageInfo

__all__ = ["RECIPES", "apt_options", "apt_sources", "build", "mmdebstrap_command", "run_mmdebstrap"]

RECIPES: dict[str, tuple[str, ...]] = {
    "debian-python": ("python3", "python3-venv", "git", "build-essential", "ca-certificates"),
}
"""Named images ``dsec image build NAME`` knows how to build (Debian packages over minbase)."""

_APT = Path("/etc/apt")
_PACKAGE_RE = r"^[a-z0-9][a-z0-9+.:=~-]*$"


def apt_sources(apt_dir: Path = _APT) -> list[Path]:
    """The host's apt sources: ``sources.list`` (if non-empty) and ``sources.list.d/*.{list,sources}``."""
    found: list[Path] = []
    main = apt_dir / "sources.list"
    if main.is_file() and any(line.strip() and not line.lstrip().startswith("#")
                              for line in main.read_text(errors="replace").splitlines()):
        found.append(main)
    parts = apt_dir / "sources.list.d"
    if parts.is_dir():
        found.extend(p for p in sorted(parts.iterdir())
                     if p.is_file() and p.suffix in (".list", ".sources"))
    return found


def apt_options(apt_dir: Path = _APT) -> list[Path]:
    """Files of ``apt.conf.d`` that set ``Acquire::`` options (proxies, mirrors, date checks), sorted."""
    conf = apt_dir / "apt.conf.d"
    if not conf.is_dir():
        return []
    found: list[Path] = []
    for path in sorted(conf.iterdir()):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if path.is_file() and "Acquire::" in text:
            found.append(path)
    return found


def check_packages(packages: Sequence[str]) -> None:
    """:class:`InvalidRequest` naming the first entry that is not a Debian package name (or ``name=version``)."""
    for pkg in packages:
        if not re.match(_PACKAGE_RE, pkg):
            raise InvalidRequest(f"invalid Debian package name {pkg!r}")


def mmdebstrap_command(packages: Sequence[str], suite: str, target: Path,
                       apt_dir: Path = _APT, hooks: Sequence[str] = ()) -> list[str]:
    """The mmdebstrap argv that builds ``packages`` over a minbase ``suite`` into ``target``; ``hooks`` are
    extra ``--*-hook=`` options."""
    check_packages(packages)
    if not re.fullmatch(r"[a-z][a-z0-9-]*", suite):
        raise InvalidRequest(f"invalid Debian suite {suite!r}")
    exe = shutil.which("mmdebstrap")
    if exe is None:
        raise BackendUnavailable("mmdebstrap is not installed: `apt-get install mmdebstrap`",
                                 package="mmdebstrap")
    argv = [exe, "--variant=minbase", "--mode=root", "--format=directory"]
    if packages:
        argv.append("--include=" + ",".join(packages))
    argv += [f"--aptopt={p}" for p in apt_options(apt_dir)]
    argv += list(hooks)
    argv += [suite, str(target)]
    argv += [str(p) for p in apt_sources(apt_dir)]  # none: mmdebstrap picks Debian's default mirror
    return argv


def run_mmdebstrap(argv: list[str], name: str, log: Path | None = None) -> None:
    """Run mmdebstrap; its output goes to ``log`` when given, and its tail is quoted in the error."""
    with tempfile.TemporaryFile() as out:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, check=False)
        out.seek(0)
        output = out.read().decode(errors="replace")
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(output)
    if proc.returncode != 0:
        tail = "\n".join(output.splitlines()[-20:])
        raise DSecError(f"mmdebstrap failed (exit {proc.returncode}) building {name!r}:\n{tail}",
                        image=name, command=argv)


def build(
    store: ImageStore,
    name: str,
    packages: Sequence[str] | None = None,
    suite: str = "bookworm",
    uid_shift: int | None = None,
    replace: bool = False,
    log: Path | None = None,
) -> ImageInfo:
    """Bootstrap ``suite`` with ``packages`` (default: the recipe called ``name``) and import it as ``name``.

    Needs root (mmdebstrap's root mode, then the uid shift). The build happens in a temporary
    directory next to the store so the copy can use reflinks; it is always removed. mmdebstrap's
    output goes to ``log`` when given, and its tail is quoted in the error when it fails.
    """
    validate_name(name)
    if packages is None:
        if name not in RECIPES:
            raise InvalidRequest(f"no recipe for image {name!r}: give packages explicitly "
                                 f"(known recipes: {', '.join(sorted(RECIPES))})", image=name)
        packages = RECIPES[name]
    packages = list(packages)
    shift = Settings().uid_shift if uid_shift is None else uid_shift
    store.root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".build-{name}-", dir=store.root))
    try:
        target = work / "rootfs"
        run_mmdebstrap(mmdebstrap_command(packages, suite, target), name, log)
        source = f"mmdebstrap:{suite}:{','.join(packages)}"
        return store.import_dir(name, target, uid_shift=shift, source=source,
                                config=ImageConfig(workdir="/workspace"), replace=replace, move=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
