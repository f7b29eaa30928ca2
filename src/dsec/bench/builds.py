"""``dsec bench builds``: a Dockerfile build into DSec's store against ``podman build`` of the same file.

Owns the build benchmark: one Dockerfile ``FROM debian-python`` (three ``RUN`` steps, a ``COPY``, ``ENV`` and
``WORKDIR``), built by DSec (rootless buildah, then the import into the chunked store: what it takes before
a sandbox can start from it) and by ``podman build`` (rootful, its own storage) on the same machine in the
same run, each with the base image already in its builder's storage: every step built (``--no-cache``), and
a rebuild with every step cached. The first DSec build, which also exports the base image once, is
reported alone. Everything lives in temporary directories removed at the end; the machine's image store is
only read.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from dsec.bench.container import BenchUnavailable
from dsec.bench.report import Row, Suite, summarize
from dsec.config import Settings

__all__ = ["DOCKERFILE", "run"]

DOCKERFILE = """\
FROM debian-python
ENV APP_HOME=/srv/app
WORKDIR /srv/app
COPY app.py requirements.txt ./
RUN python3 -m venv /opt/venv && /opt/venv/bin/python -c 'import sys; print(sys.version)'
RUN python3 -c 'open("/srv/app/data.bin", "wb").write(bytes(range(256)) * 40000)'
RUN useradd -m agent && chown -R agent /srv/app
"""


def _context(root: Path) -> Path:
    root.mkdir()
    (root / "Dockerfile").write_text(DOCKERFILE)
    (root / "app.py").write_text("print('hello')\n")
    (root / "requirements.txt").write_text("")
    return root


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _Podman:
    """``podman build`` on storage of its own, with the same base image loaded from DSec's export."""

    def __init__(self, work: Path) -> None:
        exe = shutil.which("podman")
        if exe is None:
            raise BenchUnavailable("podman is not installed: apt-get install podman")
        self.base = [exe, "--root", str(work / "podman-root"), "--runroot", str(work / "podman-run"),
                     "--storage-driver", "overlay"]

    def run(self, *args: str) -> str:
        proc = subprocess.run([*self.base, *args], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise BenchUnavailable(f"podman {args[0]} failed: {proc.stderr.strip()[-500:]}")
        return proc.stdout

    def load(self, layout: Path) -> None:
        image_id = self.run("pull", "--quiet", f"oci:{layout}").strip().splitlines()[-1]
        self.run("tag", image_id, "localhost/debian-python:latest")

    def build(self, context: Path, no_cache: bool) -> None:
        runc = shutil.which("runc") or "runc"
        self.run("build", "--runtime", runc, "--network", "none", "--layers", "--pull=never",
                 *(["--no-cache"] if no_cache else []), "-t", "localhost/bench-build", str(context))


def run(samples: int = 3, progress: Callable[[str], None] = lambda m: None) -> Suite:
    """Build the benchmark Dockerfile ``samples`` times each way (at least 2)."""
    from dsec.images.builder import build_user
    from dsec.images.dockerfile import build_dockerfile, node_bases
    from dsec.images.export import export_layout
    from dsec.images.image_store import ImageStore
    from dsec.models import ImageBuildRequest

    if os.geteuid() != 0:
        raise BenchUnavailable("dsec bench builds needs root")
    samples = max(2, samples)
    machine = ImageStore(Settings().images, Settings().image_store)
    if not machine.exists("debian-python"):
        raise BenchUnavailable("image debian-python is missing: run ./scripts/setup")
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-build-", dir="/var/tmp"))
    build_root = Path(tempfile.mkdtemp(prefix="bench-", dir="/var/lib/dsec-build"))
    os.environ["DSEC_BUILD_ROOT"] = str(build_root)
    try:
        settings = Settings(home=work / "home", images_dir=work / "images")
        store = ImageStore(settings.images)
        progress("copying debian-python into a private store")
        store.copy_image(machine, "debian-python")
        context = _context(work / "context")
        times: dict[str, list[float]] = {"first": [], "dsec_nocache": [], "dsec_cached": [],
                                         "podman_nocache": [], "podman_cached": []}
        with node_bases(settings, store) as bases:
            def dsec(no_cache: bool) -> None:
                request = ImageBuildRequest(name="bench-build", network="none", no_cache=no_cache, replace=True)
                build_dockerfile(store, bases, request, context, settings)

            progress("DSec: first build (exports the base once)")
            times["first"].append(_timed(lambda: dsec(False)))
            podman = _Podman(work)
            progress("podman: loading the same base image")
            ref = bases.resolve("debian-python")
            try:
                export_layout(ref.rootfs, ref.uid_shift, ref.config, work / "base", "debian-python")
            finally:
                bases.release(ref)
            podman.load(work / "base")
            podman.build(context, no_cache=False)  # warm podman's cache as DSec's first build warmed its own
            for i in range(samples):
                progress(f"round {i + 1}/{samples}: every step built")
                times["dsec_nocache"].append(_timed(lambda: dsec(True)))
                times["podman_nocache"].append(_timed(lambda: podman.build(context, no_cache=True)))
            # After the last full build: the same file again, every step from the cache (the image is unchanged).
            for i in range(samples):
                progress(f"round {i + 1}/{samples}: every step cached")
                times["dsec_cached"].append(_timed(lambda: dsec(False)))
                times["podman_cached"].append(_timed(lambda: podman.build(context, no_cache=False)))
        p50 = {k: summarize(v).p50 for k, v in times.items()}
        rootless = build_user() is not None
        suite = Suite("builds", latencies={k: summarize(v) for k, v in times.items()})
        suite.rows = [
            Row("Dockerfile build, every step built (p50)", "s", p50["dsec_nocache"], p50["podman_nocache"],
                "podman build --no-cache", target="reported",
                note="DSec: build + import into the chunked store"),
            Row("rebuild, every step cached (p50)", "s", p50["dsec_cached"], p50["podman_cached"],
                "podman build (cached)", target="reported"),
            Row("first build, base image exported once", "s", p50["first"], note="includes the base's export"),
        ]
        suite.extra = {"dockerfile": DOCKERFILE, "samples": samples, "rootless": rootless,
                       "builder": "buildah (rootless)" if rootless else "buildah (root)",
                       "peer": "podman build (root), runc, --network none"}
        return suite
    finally:
        from dsec.images.builder import Builder

        runtime = Builder(Settings()).runtime_dir
        os.environ.pop("DSEC_BUILD_ROOT", None)
        shutil.rmtree(build_root, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
