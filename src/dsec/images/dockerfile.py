"""Dockerfile builds: a build context and a Dockerfile become an image in DSec's store.

Owns the pipeline of ``dsec image build NAME --file Dockerfile [CONTEXT]``: stage the context in a work
directory of the build user, find the images the Dockerfile starts from (``FROM`` and ``COPY --from``, with
``ARG`` defaults and build args substituted, stage names left alone), hand each one that DSec's store holds
to buildah (exported once per image digest, :mod:`dsec.images.export`), refuse early a short name that
neither the store nor a configured registry can serve, run the build (:mod:`dsec.images.builder`: build
args, targets, multi-stage, ``.dockerignore``, the layer cache), push the result as an OCI layout and import
it with the usual digests (:func:`dsec.images.oci_import.import_image`). A failed build stores nothing: the tag is
written last, by the import. It never edits the Dockerfile and never reads outside the context it is given.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import tarfile
import threading
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

import dockerfile

from dsec.config import Settings
from dsec.errors import DSecError, ImageNotFound, InvalidRequest
from dsec.images.builder import Builder, BuildOutput
from dsec.images.export import export_layout
from dsec.images.image_store import ImageStore, validate_name
from dsec.images.oci_import import Progress, import_image, open_source
from dsec.images.ref import ImageRef
from dsec.models import ImageBuildRequest, ImageInfo

__all__ = ["BaseImages", "BaseRef", "base_references", "build_dockerfile", "node_bases", "unqualified_registries"]

_VAR_RE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?[-+]([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
_STORE_REF_RE = re.compile(r"(?:localhost/)?([a-z0-9][a-z0-9._-]{0,127})(?::latest)?")
_REGISTRIES_CONF = Path("/etc/containers/registries.conf")
_INSTRUCTIONS = frozenset({"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
                           "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"})


class BaseImages(Protocol):
    """Where the images of DSec's store are mounted for an export (``NodeImages`` implements it)."""

    def resolve(self, name: str) -> ImageRef:
        """Mount and pin image ``name``."""
        ...

    def release(self, ref: ImageRef) -> None:
        """Unpin it."""
        ...


@dataclass(frozen=True)
class BaseRef:
    """An image a Dockerfile starts from: the reference as written (variables substituted) and its line."""

    reference: str
    line: int
    instruction: str


def _substitute(text: str, values: dict[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(3)
        value = values.get(name, "")
        alt = match.group(2)
        if alt is not None and match.group(0).find(":+") > 0:
            return alt if value else ""
        if alt is not None and not value:
            return alt
        return value

    return _VAR_RE.sub(one, text)


def _parse(text: str) -> tuple[dockerfile.Command, ...]:
    try:
        commands: tuple[dockerfile.Command, ...] = dockerfile.parse_string(text)
        return commands
    except dockerfile.GoParseError as exc:
        raise InvalidRequest(f"the Dockerfile does not parse: {exc}") from None


def base_references(text: str, build_args: dict[str, str]) -> list[BaseRef]:
    """The images ``text`` starts from (``FROM``, ``COPY --from=IMAGE``), in order, without ``scratch`` and
    the names of its own stages; global ``ARG`` defaults and ``build_args`` are substituted as docker does."""
    commands = _parse(text)
    for c in commands:
        if c.cmd.upper() not in _INSTRUCTIONS:
            raise InvalidRequest(f"Dockerfile line {c.start_line}: unknown instruction {c.cmd.upper()} "
                                 f"({c.original!r})", line=c.start_line)
    if not any(c.cmd.upper() == "FROM" for c in commands):
        raise InvalidRequest("the Dockerfile has no FROM instruction")
    values: dict[str, str] = {}
    stages: set[str] = set()
    found: list[BaseRef] = []
    seen_from = False
    for c in commands:
        cmd = c.cmd.upper()
        if cmd == "ARG" and not seen_from:
            for item in c.value:
                key, _, default = item.partition("=")
                values[key] = build_args.get(key, _substitute(default, values))
        elif cmd == "FROM":
            seen_from = True
            if not c.value:
                raise InvalidRequest(f"line {c.start_line}: FROM names no image")
            ref = _substitute(c.value[0], values)
            if len(c.value) >= 3 and c.value[1].upper() == "AS":
                stages.add(c.value[2].lower())
            if ref.lower() not in stages and ref != "scratch":
                found.append(BaseRef(ref, c.start_line, "FROM"))
        elif cmd in ("COPY", "ADD"):
            for flag in c.flags:
                if flag.startswith("--from="):
                    ref = flag.split("=", 1)[1]
                    if ref.lower() not in stages and not ref.isdigit():
                        found.append(BaseRef(ref, c.start_line, cmd))
    return found


def unqualified_registries(conf: Path = _REGISTRIES_CONF) -> list[str]:
    """The registries a short image name is searched in (``unqualified-search-registries`` of the host's
    containers registries.conf and its ``.d`` drop-ins)."""
    found: list[str] = []
    drop_ins = sorted((conf.parent / "registries.conf.d").glob("*.conf")) if conf.parent.is_dir() else []
    for path in [conf, *drop_ins]:
        try:
            doc = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError):
            continue
        listed = doc.get("unqualified-search-registries")
        if isinstance(listed, list):
            found = [str(r) for r in listed]
    return found


def _store_name(reference: str) -> str | None:
    match = _STORE_REF_RE.fullmatch(reference)
    return match.group(1) if match else None


def _names_registry(reference: str) -> bool:
    first, slash, _ = reference.partition("/")
    return bool(slash) and ("." in first or ":" in first or first == "localhost")


def _extract(stream: IO[bytes], target: Path) -> None:
    """Unpack a context tar into ``target``; absolute names, ``..``, links out of it and devices are refused."""
    try:
        with tarfile.open(fileobj=stream, mode="r|*") as tar:
            tar.extractall(target, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise InvalidRequest(f"the build context is not a usable tar archive: {exc}") from None


def _copy(source: Path, target: Path) -> None:
    if not source.is_dir():
        raise InvalidRequest(f"build context {source} is not a directory", path=str(source))
    shutil.copytree(source, target, symlinks=True)


class _Build:
    """One build's work directory, its base images in the builder's storage, and its buildah run."""

    def __init__(self, store: ImageStore, bases: BaseImages, request: ImageBuildRequest, settings: Settings,
                 output: BuildOutput, progress: Progress | None, cancel: threading.Event | None) -> None:
        self.store, self.bases, self.request, self.settings = store, bases, request, settings
        self.output, self.progress, self.cancel = output, progress, cancel
        self.builder = Builder(settings)
        self.builder.prepare()
        # Not mkdtemp's name: buildah names a base export after its path, and a random part ending in "_" is no
        # valid reference.
        self.dir = self.builder.work / f"build-{secrets.token_hex(8)}"
        self.dir.mkdir(mode=0o700)
        self.tmp = self.dir / "tmp"
        self.tmp.mkdir()
        self.builder.give(self.dir)
        self.refs: list[BaseRef] = []

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def dockerfile_text(self, context: Path) -> str:
        if self.request.dockerfile_text is not None:
            return self.request.dockerfile_text
        path = (context / self.request.dockerfile).resolve()
        if not path.is_relative_to(context.resolve()):
            raise InvalidRequest(f"dockerfile {self.request.dockerfile!r} is outside the build context")
        try:
            return path.read_text()
        except FileNotFoundError:
            raise InvalidRequest(f"no Dockerfile {self.request.dockerfile!r} in the build context") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"cannot read Dockerfile {self.request.dockerfile!r}: {exc}") from None

    def check_bases(self, refs: list[BaseRef]) -> list[str]:
        """The store images among ``refs``; :class:`ImageNotFound` for a short name nothing can serve."""
        from_store: list[str] = []
        search = unqualified_registries()
        for ref in refs:
            name = _store_name(ref.reference)
            if name is not None and self.store.exists(name):
                if name not in from_store:
                    from_store.append(name)
            elif not _names_registry(ref.reference) and not search:
                names = self.store.names()
                have = ", ".join(names) if names else "the store is empty"
                raise ImageNotFound(
                    f"{ref.instruction} {ref.reference} (Dockerfile line {ref.line}): no image "
                    f"{name or ref.reference!r} in DSec's store ({have}), and the name gives no registry to pull it "
                    "from: build or import it first, or write the full reference (host[:port]/repo:tag)",
                    image=ref.reference, line=ref.line, available=names)
        return from_store

    def provide(self, name: str) -> None:
        """Make store image ``name`` the builder's ``localhost/NAME:latest``, exporting it once per digest."""
        ref = self.bases.resolve(name)
        try:
            known = self.builder.root / "digests" / (ref.digest or "")
            image_id = known.read_text().strip() if ref.digest and known.is_file() else ""
            if not image_id or not self.builder.image_exists(image_id, self.tmp):
                image_id = self._export(name, ref)
                if ref.digest:
                    known.write_text(image_id + "\n")
        finally:
            self.bases.release(ref)
        self.builder.run(self.builder.argv("tag", image_id, f"localhost/{name}:latest"), self.tmp, f"tagging {name}")

    def _export(self, name: str, ref: ImageRef) -> str:
        layout = self.dir / f"base-{name}"
        advance = self.progress.task(f"export {name}", None) if self.progress else (lambda n: None)
        labels = {"dsec.image": name, **({"dsec.image.digest": ref.digest} if ref.digest else {})}
        ref_name = f"localhost/{name}:latest"
        export_layout(ref.rootfs, ref.uid_shift, ref.config, layout, ref_name, labels, advance)
        self.builder.give(layout)
        try:
            out = self.builder.run(self.builder.argv("pull", "--quiet", f"oci:{layout}:{ref_name}"), self.tmp,
                                   f"loading base image {name}")
        finally:
            shutil.rmtree(layout, ignore_errors=True)
        return out.strip().splitlines()[-1]

    def build_argv(self, dockerfile_path: Path, context: Path, iidfile: Path) -> list[str]:
        r = self.request
        args = ["build", "--layers", "--force-rm", "--pull=missing", *self.builder.run_args(),
                "--file", str(dockerfile_path), "--iidfile", str(iidfile),
                "--tag", f"localhost/dsec-build/{r.name}:latest"]
        for key, value in r.build_args.items():
            args += ["--build-arg", f"{key}={value}"]
        if r.target:
            args += ["--target", r.target]
        if r.network == "none":
            args += ["--network", "none"]
        if r.no_cache:
            args.append("--no-cache")
        if r.insecure:
            args.append("--tls-verify=false")
        if r.username is not None:
            args += ["--authfile", str(self._authfile())]
        return self.builder.argv(*args, str(context))

    def _authfile(self) -> Path:
        """Registry credentials in a file only the builder reads (never on a command line)."""
        import base64
        import json

        token = base64.b64encode(f"{self.request.username}:{self.request.password or ''}".encode()).decode()
        registries = {ref.reference.split("/", 1)[0] for ref in self.refs if _names_registry(ref.reference)}
        path = self.dir / "auth.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"auths": {r: {"auth": token} for r in registries}}, f)
        self.builder.give(path)
        return path

    def run(self, context_source: Path | IO[bytes]) -> ImageInfo:
        r = self.request
        context = self.dir / "context"
        if isinstance(context_source, Path):
            _copy(context_source, context)
        else:
            context.mkdir()
            _extract(context_source, context)
        text = self.dockerfile_text(context)
        dockerfile_path = self.dir / "Dockerfile.dsec"
        dockerfile_path.write_text(text)
        self.refs = base_references(text, r.build_args)
        for name in self.check_bases(self.refs):
            self.provide(name)
        iidfile = self.dir / "iid"
        self.builder.give(self.dir)
        code = self.builder.stream(self.build_argv(dockerfile_path, context, iidfile), self.tmp, self.output,
                                   self.cancel)
        if self.cancel is not None and self.cancel.is_set():
            raise DSecError(f"building image {r.name!r} was cancelled", image=r.name)
        if code != 0 or not iidfile.is_file():
            raise self.output.error(r.name, code)
        image_id = iidfile.read_text().strip()
        current = self.store.tag(r.name)
        known = self.builder.root / "digests" / (current or "sha256:").removeprefix("sha256:")
        if current is not None and known.is_file() and known.read_text().strip() == image_id:
            self.output.feed(f"image {r.name} is unchanged: the store already holds this build ({current[:19]})")
            return self.store.get(r.name)
        layout = self.dir / "out"
        self.builder.run(self.builder.argv("push", "--quiet", image_id, f"oci:{layout}:{r.name}"), self.tmp,
                         f"exporting image {r.name}")
        source = open_source(layout)
        if source is None:
            raise DSecError(f"buildah wrote no OCI layout for {r.name!r} at {layout}", image=r.name)
        info, _ = import_image(self.store, r.name, source, uid_shift=self.settings.uid_shift, replace=r.replace,
                               progress=self.progress)
        digest = self.store.tag(r.name)
        if digest is not None:
            (self.builder.root / "digests" / digest.removeprefix("sha256:")).write_text(image_id + "\n")
        return info


def build_dockerfile(store: ImageStore, bases: BaseImages, request: ImageBuildRequest,
                     context: Path | IO[bytes], settings: Settings | None = None,
                     output: Callable[[str], None] = lambda line: None, progress: Progress | None = None,
                     cancel: threading.Event | None = None) -> ImageInfo:
    """Build ``request`` from ``context`` (a directory, or a tar stream) and store it as ``request.name``.

    ``output`` gets each line the builder prints; ``progress`` draws the base export and the import;
    ``cancel``, set from another thread, stops the build. Blocking: call it from a thread in async code.
    Raises :class:`~dsec.errors.BuildFailed` naming the failing step, :class:`~dsec.errors.ImageNotFound`
    for a base nothing serves, :class:`~dsec.errors.InvalidRequest` for a bad name, context or Dockerfile.
    """
    validate_name(request.name)
    if store.exists(request.name) and not request.replace:
        raise InvalidRequest(f"image {request.name!r} already exists (remove it or pass replace=True)",
                             image=request.name)
    build = _Build(store, bases, request, settings or Settings(), BuildOutput(output), progress, cancel)
    try:
        return build.run(context)
    finally:
        build.close()


@contextlib.contextmanager
def node_bases(settings: Settings, store: ImageStore) -> Iterator[BaseImages]:
    """The node's images for a build outside the daemon (the CLI): mounted lazily, unmounted after unless a
    daemon took them over."""
    from dsec.daemon.server import daemon_answers
    from dsec.images.node import NodeImages

    images = NodeImages(settings, store=store, cache_limit=settings.image_cache_limit, prefetch=False)
    try:
        yield images
    finally:
        if not daemon_answers(settings):
            images.close_own_sync()
