"""``dsec image`` and ``dsec snapshot``: the node's image and snapshot stores from the command line.

Owns the image commands (import, pull, build, build-vm, derive-vm, ls, inspect, rm, copy, gc) and the
snapshot commands (ls, rm), which work on the stores directly, without a daemon. Must never reach a
daemon or a sandbox; :mod:`dsec.cli` adds these groups to ``dsec``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dsec._term import Column, console
from dsec._term import table as fit_table
from dsec.cli_ops import age as _age
from dsec.errors import InvalidRequest
from dsec.models import parse_pairs

if TYPE_CHECKING:
    from dsec.images.image_store import ImageStore
    from dsec.images.layers import FlattenStats
    from dsec.models import ImageInfo
    from dsec.trajectory.snapshots import SnapshotStore


__all__ = ["register"]


# ----- images -------------------------------------------------------------------------------------


def _store() -> ImageStore:
    from dsec.config import Settings
    from dsec.images.image_store import ImageStore

    settings = Settings()
    return ImageStore(settings.images, settings.image_store)


@contextlib.contextmanager
def _upload_progress(what: str) -> Iterator[Callable[[str, int, int], None]]:
    """A rich progress bar on stderr fed by ``ImageStore`` ``progress(stage, done, total)`` callbacks (bytes)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, Any] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(f"{what}: {stage}", total=total)
            bar.update(tasks[stage], completed=done, total=total)

        yield update


def _image_row(info: ImageInfo) -> tuple[str, ...]:
    size = f"{info.size_bytes / 1024**2:.1f} MiB"
    made = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.created_at))
    return info.name, size, str(info.files), made, info.source


@click.group()
def image() -> None:
    """Manage the node's images (works without a daemon)."""


@image.command(name="import")
@click.argument("name")
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option("--tag", help="Which image of a multi-image archive or layout (its tag / ref.name).")
@click.option("--replace", is_flag=True, help="Replace an existing image of that name.")
def image_import(name: str, source: Path, tag: str | None, replace: bool) -> None:
    """Import SOURCE as image NAME.

    SOURCE is a root filesystem directory, a `docker save` archive, or an OCI image layout (a directory or
    a tar), detected from its contents. Layers are flattened and their digests verified.
    """
    from dsec.config import Settings
    from dsec.images.oci_import import import_image, open_source

    shift = Settings().uid_shift
    archive = open_source(source, tag)
    if archive is None:
        if tag is not None:
            raise InvalidRequest(f"--tag applies to archives and OCI layouts; {source} is a plain directory")
        with _upload_progress(f"importing {name}") as upload:
            info = _store().import_dir(name, source, uid_shift=shift, replace=replace, progress=upload)
    else:
        with _progress() as progress:
            info, stats = import_image(_store(), name, archive, uid_shift=shift, replace=replace, progress=progress)
        _import_notes(stats)
    click.echo(f"imported {info.name}: {info.files} files, {info.size_bytes / 1024**2:.1f} MiB")


@image.command(name="pull")
@click.argument("reference")
@click.option("--name", help="Image name in the store (default: the repository's last part, plus -TAG).")
@click.option("--insecure", is_flag=True, help="Plain HTTP (a registry on loopback without TLS).")
@click.option("--username", envvar="DSEC_REGISTRY_USERNAME", help="Registry user (basic or token auth).")
@click.option("--password", envvar="DSEC_REGISTRY_PASSWORD", help="Registry password (prefer the env var).")
@click.option("--replace", is_flag=True, help="Replace an existing image of that name.")
def image_pull(reference: str, name: str | None, insecure: bool, username: str | None, password: str | None,
               replace: bool) -> None:
    """Pull REFERENCE ([host[:port]/]repo[:tag][@sha256:...]) from an OCI registry."""
    from dsec.config import Settings
    from dsec.images.registry import pull

    with _progress() as progress:
        info, stats = pull(_store(), reference, uid_shift=Settings().uid_shift, name=name, insecure=insecure,
                           username=username, password=password, replace=replace, progress=progress)
    _import_notes(stats)
    click.echo(f"pulled {info.name}: {info.files} files, {info.size_bytes / 1024**2:.1f} MiB")


class _RichProgress:
    """``dsec.images.oci_import.Progress`` drawn as rich progress bars on stderr."""

    def __init__(self, bars: Any) -> None:
        self.bars = bars

    def task(self, description: str, total: int | None) -> Any:
        task_id = self.bars.add_task(description, total=total)
        return lambda n: self.bars.advance(task_id, n)

    def line(self, text: str) -> None:
        """A line of a tool's output, above the bars."""
        self.bars.console.print(escape(text), highlight=False, markup=False)


@contextlib.contextmanager
def _progress() -> Iterator[_RichProgress]:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bars:
        yield _RichProgress(bars)


def _import_notes(stats: FlattenStats) -> None:
    notes = []
    if stats.skipped_devices:
        notes.append(f"{stats.skipped_devices} device nodes/fifos skipped (sandboxes get their own /dev)")
    if stats.skipped_xattrs:
        notes.append(f"xattrs not kept: {', '.join(sorted(stats.skipped_xattrs))}")
    for note in notes:
        Console(stderr=True, highlight=False).print(f"[yellow]note: {escape(note)}[/yellow]")


# The brief's spelling; kept as an alias so scripts using it work.
image.add_command(click.Command("import-dir", callback=image_import.callback, params=image_import.params,
                                help=image_import.help, hidden=True))


@image.command(name="build")
@click.argument("name")
@click.argument("context", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option("-f", "--file", "dockerfile", type=click.Path(dir_okay=False, path_type=Path),
              help="Build from this Dockerfile (default CONTEXT/Dockerfile) with buildah instead of mmdebstrap.")
@click.option("--build-arg", "build_args", multiple=True, metavar="KEY=VALUE", help="An ARG value (repeatable).")
@click.option("--target", help="The stage to build (default: the last).")
@click.option("--network", type=click.Choice(["private", "none"]), default="private", show_default=True,
              help="RUN steps' network: private (outbound only, no host loopback) or none.")
@click.option("--no-cache", is_flag=True, help="Build every step again instead of reusing the layer cache.")
@click.option("--insecure", is_flag=True, help="Pull FROM images over plain HTTP (a registry on loopback).")
@click.option("--username", envvar="DSEC_REGISTRY_USERNAME", help="Registry user for FROM images.")
@click.option("--password", envvar="DSEC_REGISTRY_PASSWORD", help="Registry password (prefer the env var).")
@click.option("--packages", help="Comma-separated Debian packages (default: the recipe named NAME).")
@click.option("--suite", default="bookworm", show_default=True, help="Debian suite.")
@click.option("--replace", is_flag=True, help="Replace an existing image of that name.")
def image_build(name: str, context: Path | None, dockerfile: Path | None, build_args: tuple[str, ...],
                target: str | None, network: str, no_cache: bool, insecure: bool, username: str | None,
                password: str | None, packages: str | None, suite: str, replace: bool) -> None:
    """Build image NAME from a Dockerfile (CONTEXT and/or --file; rootless buildah, FROM an image of the
    store or a registry), or with mmdebstrap from Debian packages (needs root)."""
    if context is None and dockerfile is None:
        from dsec.images.build import build

        pkgs = [p.strip() for p in packages.split(",") if p.strip()] if packages else None
        info = build(_store(), name, packages=pkgs, suite=suite, replace=replace)
    else:
        if packages is not None:
            raise click.UsageError("--packages is for mmdebstrap builds; a Dockerfile build installs with RUN")
        info = _dockerfile_build(name, context or (dockerfile.parent if dockerfile else Path(".")), dockerfile,
                                 dict(parse_pairs(build_args, "--build-arg")), target=target, network=network,
                                 no_cache=no_cache, insecure=insecure, username=username, password=password,
                                 replace=replace)
    click.echo(f"built {info.name}: {info.files} files, {info.size_bytes / 1024**2:.1f} MiB")


def _dockerfile_build(name: str, context: Path, dockerfile: Path | None, build_args: dict[str, str],
                      **options: Any) -> ImageInfo:
    """A Dockerfile build on this node's store (no daemon needed), its output and progress on stderr."""
    from dsec.config import Settings
    from dsec.images.dockerfile import build_dockerfile, node_bases
    from dsec.models import ImageBuildRequest

    path = (dockerfile or context / "Dockerfile").resolve()
    inside = path.is_relative_to(context.resolve())
    try:
        text = None if inside else path.read_text()
    except OSError as exc:
        raise click.UsageError(f"cannot read the Dockerfile {path}: {exc}") from None
    request = ImageBuildRequest(name=name, build_args=build_args, dockerfile_text=text,
                                dockerfile=str(path.relative_to(context.resolve())) if inside else "Dockerfile",
                                **options)
    settings = Settings()
    store = _store()
    with _progress() as progress, node_bases(settings, store) as bases:
        return build_dockerfile(store, bases, request, context, settings, output=progress.line, progress=progress)


@image.command(name="build-vm")
@click.argument("name")
@click.option("--desktop", is_flag=True, help="Add Xorg, the twm window manager and xterm, started at boot.")
@click.option("--packages", help="Comma-separated extra Debian packages.")
@click.option("--suite", default="bookworm", show_default=True, help="Debian suite.")
@click.option("--disk-size", default="4Gi", show_default=True, help="Size of the root filesystem.")
@click.option("--replace", is_flag=True, help="Replace an existing VM image of that name.")
@click.option("--from", "from_image", metavar="IMAGE",
              help="Start from DSec image IMAGE's root (Debian-based) instead of a fresh mmdebstrap.")
def image_build_vm(name: str, desktop: bool, packages: str | None, suite: str, disk_size: str,
                   replace: bool, from_image: str | None) -> None:
    """Build VM disk image NAME for backend="vm" with mmdebstrap, or from a DSec image (needs root): Debian's
    kernel, systemd, the guest agent as a service, optionally a desktop. Stored under /var/lib/dsec/vm/images
    (DSEC_VM_DIR)."""
    from dsec.guest.vmimage import build_vm_image
    from dsec.models import parse_size

    pkgs = [p.strip() for p in packages.split(",") if p.strip()] if packages else None
    size = parse_size(disk_size)
    if from_image is None:
        img = build_vm_image(name, desktop=desktop, packages=pkgs, suite=suite, disk_bytes=size, replace=replace)
    else:
        with _mounted_image(from_image) as source:
            img = build_vm_image(name, desktop=desktop, packages=pkgs, disk_bytes=size, replace=replace,
                                 source=source)
    click.echo(f"built VM image {img.name}: {img.disk} (kernel {img.meta['kernel']}, "
               f"{img.disk.stat().st_size / 1024**2:.0f} MiB on disk{', desktop' if img.desktop else ''})")


@image.command(name="derive-vm")
@click.argument("name")
def image_derive_vm(name: str) -> None:
    """Derive the vm backend's disk of image NAME now (what its first backend="vm" create does otherwise, about a
    minute): its files and owners plus Debian's kernel, systemd and the agent, kept per image content."""
    from dsec.guest.vmderive import derive_in_helper

    with _mounted_image(name) as source:
        img = derive_in_helper(source)
    click.echo(f"vm disk of image {name}: {img.disk} (kernel {img.meta['kernel']}, "
               f"{img.disk.stat().st_size / 1024**2:.0f} MiB on disk)")


@contextlib.contextmanager
def _mounted_image(name: str) -> Iterator[Any]:
    """Store image ``name`` mounted (lazily) as the node mounts it, for a copy of its root."""
    from dsec.config import Settings
    from dsec.daemon.server import daemon_answers
    from dsec.images.node import NodeImages

    settings = Settings()
    # Its limits: if it starts the lazy server, a daemon started later adopts that server as it is.
    images = NodeImages(settings, cache_limit=settings.image_cache_limit, prefetch=False)
    source = images.resolve(name)
    try:
        yield source
    finally:
        images.release(source)
        # The node's daemon, if one runs, may have taken the mount over: it stays warm for it.
        if not daemon_answers(settings):
            images.close_own_sync()


@image.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def image_ls(as_json: bool) -> None:
    """List images and the backends each one is ready for (the vm backend boots a disk derived from a DSec image on
    its first vm create; VM images built with `dsec image build-vm` boot on vm only)."""
    from dsec.guest.vmderive import image_backends
    from dsec.guest.vmimage import list_vm_images

    store = _store()
    infos = store.list()
    ready = {info.name: image_backends(store, info.name) for info in infos}
    if as_json:  # the store's images (the VM images of `dsec image build-vm` are in the table only)
        click.echo(json.dumps([{**i.model_dump(mode="json"), "backends": ready[i.name]} for i in infos], indent=2))
        return
    vm_images = list_vm_images()
    rows = []
    for info in infos:
        name, size, files, made, source = _image_row(info)
        rows.append([escape(cell) for cell in (name, size, files, made, _backends_cell(ready[info.name]), source)])
    for v in vm_images:
        made = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(v.meta.get("built_at", 0))))
        size = f"{v.disk.stat().st_size / 1024**2:.1f} MiB"
        rows.append([escape(v.name), size, "-", made, "vm (a VM image)",
                     escape(f"build-vm{' --desktop' if v.desktop else ''}")])
    columns = (Column("NAME", rank=9), Column("SIZE", rank=6), Column("FILES", rank=2), Column("CREATED", rank=4),
               Column("BACKENDS", "text", rank=8), Column("SOURCE", "text", rank=3))
    out = console()
    out.print(fit_table(columns, rows, out.width))


def _backends_cell(backends: dict[str, str]) -> str:
    """``container function microvm vm``, with what is not ready yet said after it."""
    ready = [name for name, state in backends.items() if state == "ready"]
    rest = [f"{name}: {state}" for name, state in backends.items() if state != "ready"]
    return " ".join(ready) + (f" ({'; '.join(rest)})" if rest else "")


@image.command(name="inspect")
@click.argument("name")
def image_inspect(name: str) -> None:
    """Show an image's metadata and storage as JSON: size, chunks, dedup savings, bytes cached here."""
    from dsec.config import Settings
    from dsec.images.cache import ChunkCache

    store = _store()
    out: dict[str, Any] = {"image": store.get(name).model_dump(mode="json"), "storage": None}
    if store.tag(name) is not None:
        stats = store.stats(name)
        cache_dir = Settings().home / "image-cache"
        cached = (ChunkCache(cache_dir, store.blobs).cached_bytes(store.manifest(name))
                  if cache_dir.is_dir() else 0)
        out["storage"] = {
            "store": store.blobs.url, "digest": stats.digest, "blob_bytes": stats.blob_bytes,
            "metadata_bytes": stats.meta_bytes, "chunks": stats.chunks, "unique_bytes": stats.unique_bytes,
            "shared_with_other_images_bytes": stats.shared_bytes,
            # stored once although the image uses it more than once, or other images use it too
            "dedup_savings_bytes": stats.blob_bytes - stats.unique_bytes + stats.shared_bytes,
            "cached_on_this_node_bytes": cached,
        }
    click.echo(json.dumps(out, indent=2))


@image.command(name="rm")
@click.argument("names", nargs=-1, required=True)
def image_rm(names: tuple[str, ...]) -> None:
    """Remove images (their chunks stay until `dsec image gc`)."""
    store = _store()
    for name in names:
        store.remove(name)
        click.echo(name)


@image.command(name="copy")
@click.argument("names", nargs=-1, required=True)
@click.option("--to", "target", required=True, metavar="STORE",
              help="The store to copy into: a path or s3://BUCKET/PREFIX?endpoint=URL (e.g. a cluster's).")
def image_copy(names: tuple[str, ...], target: str) -> None:
    """Copy images of this node's store into another store (chunks it lacks, then the tag)."""
    from dsec.config import Settings
    from dsec.images.image_store import ImageStore

    into = ImageStore(Settings().images, target)
    source = _store()
    for name in names:
        with _upload_progress(f"copying {name}") as progress:
            manifest = into.copy_image(source, name, progress=progress)
        click.echo(f"{name}: {manifest.digest} in {into.blobs.url}")


@image.command(name="gc")
@click.option("--grace", type=float, default=3600.0, show_default=True,
              help="Keep objects younger than this many seconds (imports in flight elsewhere).")
@click.option("--builder/--no-builder", default=True, show_default=True,
              help="Also prune the Dockerfile builder's storage (DSEC_BUILD_ROOT) to the cache of stored images.")
def image_gc(grace: float, builder: bool) -> None:
    """Delete chunks and manifests of the store that no image references, and the builder's layers and
    images of images the store no longer has."""
    store = _store()
    result = store.gc(grace=grace)
    click.echo(f"removed {result.chunks} chunks and {result.manifests} manifests, "
               f"{result.bytes / 1024**2:.1f} MiB freed")
    if builder:
        from dsec.config import Settings
        from dsec.errors import BackendUnavailable
        from dsec.images.builder import Builder

        try:
            pruned = Builder(Settings()).prune(set(store.names()), grace=grace)
        except BackendUnavailable:
            return  # no buildah: no builder storage to prune
        if pruned.skipped:
            click.echo(f"builder: not pruned: {pruned.skipped}")
        else:
            click.echo(f"builder: removed {pruned.images} images and layers, {pruned.work_dirs} work directories, "
                       f"{pruned.bytes / 1024**2:.1f} MiB freed")


# ----- snapshots ----------------------------------------------------------------------------------


def _snapshots() -> SnapshotStore:
    from dsec.config import Settings
    from dsec.images.image_store import ImageStore
    from dsec.trajectory.snapshots import SnapshotStore

    settings = Settings()
    return SnapshotStore(ImageStore(settings.images, settings.snapshot_store), settings.home / "snapshot-work")


@click.group()
def snapshot() -> None:
    """Manage sandbox snapshots in the store (works without a daemon)."""


@snapshot.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="Print the snapshot records as JSON.")
def snapshot_ls(as_json: bool) -> None:
    """List snapshots: id, image, backend, layers, size, age."""
    records = _snapshots().list()
    if as_json:
        click.echo(json.dumps(records, indent=2))
        return
    now = time.time()
    table = Table("ID", "IMAGE", "BACKEND", "LAYERS", "SIZE", "AGE", "FORK", box=None)
    for r in records:
        table.add_row(r["id"], str(r.get("image")), str(r.get("backend")), str(len(r.get("layers", []))),
                      f"{int(r.get('size_bytes', 0)) / 1024**2:.1f} MiB", _age(now - float(r.get("created_at", now))),
                      "yes" if r.get("ephemeral") else "")
    Console().print(table)


@snapshot.command(name="rm")
@click.argument("ids", nargs=-1, required=True)
def snapshot_rm(ids: tuple[str, ...]) -> None:
    """Remove snapshots (sandboxes restored from them keep running; chunks go with `dsec image gc`)."""
    store = _snapshots()
    for snap_id in ids:
        store.meta(snap_id)  # NotFound names it
        store.remove(snap_id)
        click.echo(snap_id)


def register(group: click.Group) -> None:
    """Add the ``image`` and ``snapshot`` groups to the ``dsec`` group."""
    for command in (image, snapshot):
        group.add_command(command)
