"""The ``dsec`` command: daemon control, sandboxes, images, doctor, bench and the demo.

The CLI owns argument parsing and terminal output only. Sandbox commands go through the public SDK
(``dsec.Sandbox``), image commands through the node's ImageStore directly (no daemon needed), daemon
commands through ``dsec.daemon.server``. Heavy or optional modules are imported inside their command so
``dsec --help`` stays fast and works even when one of them is broken. It must never hold logic that the
SDK or the daemon should own. Every DSecError ends as ``error: <message>`` on stderr and exit code 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dsec._term import Column, console
from dsec._term import table as fit_table
from dsec.cli_ops import age as _age
from dsec.cli_ops import register as _register_ops
from dsec.cli_surface import register as _register_surface
from dsec.cli_trajectory import register as _register_trajectory
from dsec.errors import DSecError, InvalidRequest
from dsec.models import parse_pairs

if TYPE_CHECKING:
    from dsec.images.image_store import ImageStore
    from dsec.images.layers import FlattenStats
    from dsec.models import ImageInfo
    from dsec.trajectory.snapshots import SnapshotStore

__all__ = ["main"]


def _error(message: str) -> None:
    # soft_wrap: an error line must stay one line (grep-able), not wrapped at the terminal width.
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[red]error: {escape(message)}[/red]")


def _fail(message: str) -> NoReturn:
    _error(message)
    sys.exit(1)


class _Group(click.Group):
    """A click group that turns DSecError into a one-line error instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DSecError as exc:
            _fail(exc.message or type(exc).__name__)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dsec", prog_name="dsec", message="%(prog)s %(version)s")
def main() -> None:
    """DSec: isolated sandboxes for training AI agents."""


# ----- daemon -------------------------------------------------------------------------------------


def _daemon_errors() -> tuple[type[Exception], ...]:
    from dsec.daemon.server import ServeError

    return (ServeError,)


@main.command()
@click.option("--tcp", metavar="HOST:PORT", help="Also listen on TCP (needs --token, DSEC_TOKEN or a token file).")
@click.option("--token", envvar="DSEC_TOKEN", help="Bearer token required on TCP.")
@click.option("--pool", "pools", multiple=True, metavar="IMAGE:BACKEND[:min=N,max=N,...]",
              help="A warm pool (repeatable; also DSEC_POOLS, ';'-separated). Keys: min, max, cpu, memory, disk, "
                   "pids, workdir, network (none or allow: members made with a network device).")
@click.option("--control-cpus", metavar="LIST", envvar="DSEC_CONTROL_CPUS",
              help="Housekeeping CPUs (e.g. 0 or 0-1): the daemon, its exec helper and zygotes run there; each "
                   "sandbox's processes get the daemon's original CPUs back as they start. Also DSEC_CONTROL_CPUS.")
@click.option("--e2b", "e2b_listen", metavar="HOST:PORT",
              help="Also serve E2B's API here: the e2b SDK drives DSec sandboxes (E2B_API_KEY is a DSec token).")
@click.option("--e2b-domain", metavar="DOMAIN[:PORT]",
              help="The E2B_DOMAIN clients use: api.DOMAIN and PORT-ID.DOMAIN (default: only the E2B_API_URL / "
                   "E2B_SANDBOX_URL form).")
@click.option("--e2b-tls-cert", type=click.Path(exists=True, path_type=Path), help="PEM certificate for HTTPS.")
@click.option("--e2b-tls-key", type=click.Path(exists=True, path_type=Path), help="PEM key (default: in the cert).")
@click.option("--e2b-default-image", default="debian-python", show_default=True,
              help="The image of E2B's default template 'base'.")
@click.option("--e2b-backend", default="container", show_default=True,
              type=click.Choice(["container", "microvm", "vm", "function"]),
              help="The backend of a template that names none (BACKEND/IMAGE names one).")
@click.option("--e2b-network", default="none", show_default=True,
              help="Network policy of a sandbox created without allow_internet_access (none or allow).")
@click.option("--sandbox-fusion", "fusion_listen", metavar="HOST:PORT",
              help="Also serve SandboxFusion's POST /run_code here (verl's sandbox_fusion_url: "
                   "http://dsec:TOKEN@HOST:PORT/run_code); each request runs on the function backend.")
@click.option("--sandbox-fusion-image", default="debian-python", show_default=True,
              help="The image /run_code requests run on (its toolchains decide the languages).")
def serve(tcp: str | None, token: str | None, pools: tuple[str, ...], control_cpus: str | None,
          e2b_listen: str | None, e2b_domain: str | None, e2b_tls_cert: Path | None, e2b_tls_key: Path | None,
          e2b_default_image: str, e2b_backend: str, e2b_network: str, fusion_listen: str | None,
          sandbox_fusion_image: str) -> None:
    """Run the node daemon in the foreground (its log, start-up phases included, on stderr and in its log file)."""
    from click.core import ParameterSource

    from dsec.config import Settings
    from dsec.daemon import server
    from dsec.isolation import affinity
    from dsec.models import PoolConfig

    settings = Settings()
    if pools:
        settings = dataclasses.replace(settings, pools=settings.pools + pools)
    if control_cpus:
        settings = dataclasses.replace(settings, control_cpus=control_cpus)
        # Checked here too, so that the error names the option when the value came from it.
        source = click.get_current_context().get_parameter_source("control_cpus")
        try:
            affinity.control_cpus(control_cpus, "--control-cpus" if source is ParameterSource.COMMANDLINE
                                  else "DSEC_CONTROL_CPUS")
        except ValueError as exc:
            _fail(str(exc))
    try:
        for text in settings.pools:
            PoolConfig.parse(text)
    except InvalidRequest as exc:
        _fail(str(exc))
    from dsec.daemon import logs

    logs.setup(settings.log_file)  # info and above, structured, to the daemon's log file (`dsec logs --daemon`)
    e2b = None
    if e2b_listen is not None:
        from dsec.e2b import E2BOptions

        try:
            e2b = E2BOptions(listen=e2b_listen, domain=e2b_domain, tls_cert=e2b_tls_cert, tls_key=e2b_tls_key,
                             default_image=e2b_default_image, backend=e2b_backend,  # type: ignore[arg-type]
                             network=e2b_network)
        except InvalidRequest as exc:
            _fail(str(exc))
    fusion = None
    if fusion_listen is not None:
        from dsec.fusion import FusionOptions, RunnerSettings

        try:
            fusion = FusionOptions(fusion_listen, RunnerSettings(image=sandbox_fusion_image))
        except InvalidRequest as exc:
            _fail(str(exc))
    try:
        server.serve(settings, tcp=tcp, token=token or None, e2b=e2b, fusion=fusion)
    except _daemon_errors() as exc:
        _fail(str(exc))


@main.command()
@click.option("--tcp", metavar="HOST:PORT", help="Also listen on TCP (needs --token, DSEC_TOKEN or a token file).")
@click.option("--token", envvar="DSEC_TOKEN", help="Bearer token required on TCP.")
@click.option("--restart", is_flag=True,
              help="Stop the home's running daemon first (however it was started: dsec serve, a unit file, dsec up).")
@click.option("--timeout", type=float, default=15.0, show_default=True,
              help="Seconds one start-up phase may last before the start is given up (it waits while they progress).")
def up(tcp: str | None, token: str | None, restart: bool, timeout: float) -> None:
    """Start the node daemon in the background."""
    from dsec.config import Settings
    from dsec.daemon import server

    settings = Settings()
    try:
        start = server.restart if restart else server.up
        pid = start(settings, tcp=tcp, token=token or None, timeout=timeout)
    except _daemon_errors() as exc:
        _fail(str(exc))
    click.echo(f"dsec daemon running (pid {pid}) on unix://{settings.socket_path}; log: {settings.log_file}")


@main.command()
@click.option("--destroy", is_flag=True, help="Also destroy every sandbox (default: keep them).")
def down(destroy: bool) -> None:
    """Stop the node daemon, however it was started (dsec up, dsec serve, a unit file)."""
    from dsec.config import Settings
    from dsec.daemon import server

    try:
        stopped = server.down(Settings(), destroy=destroy)
    except _daemon_errors() as exc:
        _fail(str(exc))
    click.echo("dsec daemon stopped" if stopped else "no dsec daemon was running")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def doctor(as_json: bool) -> None:
    """Check what works on this host (kernel features, tools, backends); exit 1 if a required check fails."""
    from dsec import doctor as checks

    results = checks.run_checks()
    if as_json:
        click.echo(checks.as_json(results))
    else:
        checks.render(results)
    if not checks.healthy(results):
        sys.exit(1)


# ----- sandboxes ----------------------------------------------------------------------------------


_register_ops(main)
_register_surface(main)
_register_trajectory(main)


@main.command(name="exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds before it is killed.")
@click.option("--cwd", help="Working directory (default: the sandbox's workdir).")
@click.option("-e", "--env", "env", multiple=True, metavar="K=V", help="Extra environment variable.")
@click.option("-u", "--user", help="Run as this user: name, uid, name:group or uid:gid (default: the sandbox's).")
@click.option("-t", "--tty", "tty_", is_flag=True,
              help="On a terminal wired to this one (interactive: bash, vim, tmux); no time limit.")
@click.option("-n", "--no-stdin", is_flag=True,
              help="Do not forward standard input (it is forwarded when it is a pipe or a file, not a terminal).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(
    sandbox_id: str, timeout: float, cwd: str | None, env: tuple[str, ...], user: str | None, tty_: bool,
    no_stdin: bool, command: tuple[str, ...]
) -> None:
    """Run a command in a sandbox: dsec exec ID -- CMD [ARGS]...

    Output is streamed as it arrives; the exit code is the command's. Standard input, when it is a pipe or a
    file (echo hello | dsec exec ID -- cat), is read to its end and given to the command. With -t the command
    gets a terminal instead: what is typed goes to it, and its window follows this one's size.
    """
    from dsec import Sandbox
    from dsec.cli_surface import terminal_session

    # One argument is a shell line (``dsec exec ID -- 'make && make test'``); several are an argv.
    argv: str | list[str] = command[0] if len(command) == 1 else list(command)
    if tty_:
        sys.exit(terminal_session(sandbox_id, argv, user, cwd, parse_pairs(env, "-e") or None))
    stdin = None if no_stdin or sys.stdin is None or sys.stdin.isatty() else _read_stdin()
    sb = Sandbox.connect(sandbox_id)
    out, err = sys.stdout.buffer, sys.stderr.buffer
    code = 1
    for event in sb.exec_stream(argv, timeout=timeout, cwd=cwd, env=parse_pairs(env, "-e") or None, stdin=stdin,
                                user=user):
        if event.type in ("stdout", "stderr") and event.data:
            stream = out if event.type == "stdout" else err
            stream.write(event.data)
            stream.flush()
        elif event.type == "exit" and event.result is not None:
            code = event.result.exit_code
            if event.result.limit is not None:
                note = f"dsec: command stopped by the {event.result.limit} limit"
                Console(stderr=True).print(f"[yellow]{note}[/yellow]")
    sys.exit(code)


_STDIN_MAX = 64 * 1024**2
"""Largest standard input ``dsec exec`` forwards (the command gets it whole, in the request)."""


def _read_stdin() -> bytes:
    data = sys.stdin.buffer.read(_STDIN_MAX + 1)
    if len(data) > _STDIN_MAX:
        _fail(f"standard input is larger than {_STDIN_MAX // 1024**2} MiB: write it into the sandbox as a file "
              "(sb.files.write) and read it from there, or pass -n to run without it")
    return data


@main.command()
@click.argument("sandbox_ids", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Remove every sandbox on the daemon.")
def rm(sandbox_ids: tuple[str, ...], all_: bool) -> None:
    """Destroy sandboxes."""
    from dsec import Sandbox, SandboxNotFound

    if not sandbox_ids and not all_:
        raise InvalidRequest("give sandbox ids or --all")
    targets = list(Sandbox.list()) if all_ else []
    missing = 0
    for sandbox_id in sandbox_ids:
        try:
            targets.append(Sandbox.connect(sandbox_id))
        except SandboxNotFound as exc:
            _error(exc.message)
            missing += 1
    for sb in targets:
        sb.close()
        click.echo(sb.id)
    if missing:
        sys.exit(1)


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


@main.group()
def token() -> None:
    """Manage the TCP API's tokens (job-scoped or admin, with rate limits); works without a daemon.

    The running daemon re-reads the token file on its next request."""


def _tokens() -> Any:
    from dsec.config import Settings
    from dsec.daemon.auth import TokenFile

    return TokenFile(Settings().tokens_file)


@token.command(name="create")
@click.argument("name")
@click.option("--job", help="Scope the token to this job: it sees and controls only the sandboxes it created.")
@click.option("--admin", is_flag=True, help="An admin token: sees and controls every sandbox.")
@click.option("--requests-per-s", type=float, help="Rate limit on all requests (429 + Retry-After past it).")
@click.option("--creates-per-s", type=float, help="Rate limit on sandboxes created (batches count each one).")
@click.option("--e2b", "e2b_format", is_flag=True,
              help="Shape it as an E2B API key (e2b_ + 40 hex digits), which the e2b SDK accepts as E2B_API_KEY.")
def token_create(name: str, job: str | None, admin: bool, requests_per_s: float | None,
                 creates_per_s: float | None, e2b_format: bool) -> None:
    """Create token NAME and print it (only once: the file keeps its sha256)."""
    from dsec.errors import DSecError

    try:
        value = _tokens().create(name, job=job, admin=admin, requests_per_s=requests_per_s,
                                 creates_per_s=creates_per_s, e2b_format=e2b_format)
    except DSecError as exc:
        _fail(str(exc))
    click.echo(value)


@token.command(name="ls")
def token_ls() -> None:
    """List tokens (names, scopes, limits; never the tokens)."""
    for e in _tokens().entries():
        scope = "admin" if e.scope == "admin" else f"job={e.job}"
        limits = ", ".join(f"{k}={v:g}" for k, v in (("requests/s", e.requests_per_s), ("creates/s", e.creates_per_s))
                           if v is not None)
        click.echo(f"{e.name}\t{scope}\t{limits or 'no limits'}")


@token.command(name="rm")
@click.argument("name")
def token_rm(name: str) -> None:
    """Revoke token NAME."""
    from dsec.errors import DSecError

    try:
        _tokens().remove(name)
    except DSecError as exc:
        _fail(str(exc))


@main.group()
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


@main.group()
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


# ----- bench and demo -----------------------------------------------------------------------------


@main.command()
@click.argument("suites", nargs=-1, metavar="[SUITE]...")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the results here as JSON.")
@click.option("--skip", multiple=True, metavar="SUITE", help="Leave this suite out (repeatable).")
@click.option("--quick", is_flag=True, help="Every sample count and duration times 0.1 (a quick look).")
@click.option("--burst", type=click.IntRange(1, 100_000), metavar="N",
              help="pools suite: sandboxes of the burst / density phase (default 1000; 10000 for the density target); "
                   "`dsec bench cluster --burst N`: creates of the cluster burst (default 2000); "
                   "`dsec bench cluster-sim --burst N`: sandboxes of the one-job batch (default 32000).")
@click.option("--phase", "phases", multiple=True,
              type=click.Choice(["create", "sustained", "exec", "neighbours", "burst", "podman",
                                 "decide", "idle", "batch", "single", "fill", "death", "restart", "replicas",
                                 "run-code"]),
              help="pools suite: create, sustained, exec, neighbours, burst, podman; cluster-sim suite: decide, "
                   "idle, batch, single, fill, death, restart, replicas; function suite: run-code. Run only this phase "
                   "(repeatable; default: all).")
@click.option("--idle-vms", type=click.IntRange(1, 10_000), metavar="N",
              help="microvm suite: idle VMs alive at once, each answering an exec (default 8; 100 for the target).")
@click.option("--nodes", "fleet_sizes", metavar="N[,N...]",
              help="cluster-sim suite: simulated fleet sizes, one run each (default 160,1000,2000,4000).")
@click.option("--live", type=click.IntRange(1, 10_000_000), metavar="N",
              help="cluster-sim suite: live sandboxes the gateway holds in the fill phase (default 380000).")
@click.option("--minutes", type=click.FloatRange(0.1, 24 * 60), metavar="N",
              help="soak suite: how long the mixed load runs (default 60).")
@click.option("--fault-every", type=click.FloatRange(5, 3600), metavar="SECONDS",
              help="soak suite: seconds between two SIGKILLs of the chaos list (default 30).")
def bench(suites: tuple[str, ...], json_path: Path | None, skip: tuple[str, ...], quick: bool,
          burst: int | None, phases: tuple[str, ...], idle_vms: int | None, fleet_sizes: str | None,
          live: int | None, minutes: float | None, fault_every: float | None) -> None:
    """Run benchmarks against the peers measured in the same run (no SUITE: every suite but soak)."""
    # Imported by name: the benchmarks pull in peers' tooling that most commands never need.
    benchmarks = importlib.import_module("dsec.bench")
    config = None
    if (minutes or fault_every) and suites != ("soak",):
        raise click.UsageError("--minutes and --fault-every are options of `dsec bench soak`")
    if suites == ("soak",):
        soak = importlib.import_module("dsec.bench.soak")
        config = soak.SoakBench()
        config = dataclasses.replace(config, minutes=minutes or (config.minutes * (0.1 if quick else 1.0)),
                                     fault_every_s=fault_every or config.fault_every_s)
    elif suites == ("cluster-sim",):
        sim = importlib.import_module("dsec.bench.cluster_sim")
        config = sim.ClusterSimBench().scaled(0.1 if quick else 1.0)
        try:
            sizes = tuple(int(n) for n in fleet_sizes.split(",")) if fleet_sizes else config.nodes
        except ValueError:
            raise click.BadParameter(f"expected node counts separated by commas, got {fleet_sizes!r}",
                                     param_hint="--nodes") from None
        config = dataclasses.replace(config, nodes=sizes, phases=phases, batch=burst or config.batch,
                                     live=live or config.live)
    elif fleet_sizes or live:
        raise click.UsageError("--nodes and --live are options of `dsec bench cluster-sim`")
    elif burst is not None and suites == ("cluster",):
        cluster_bench = importlib.import_module("dsec.bench.cluster")
        config = dataclasses.replace(cluster_bench.ClusterBench().scaled(0.1 if quick else 1.0), burst=burst)
    elif suites == ("function",) and phases:
        if set(phases) != {"run-code"}:
            raise click.BadParameter("the function suite has one phase to run alone: run-code", param_hint="--phase")
        function_bench = importlib.import_module("dsec.bench.function")
        config = dataclasses.replace(function_bench.FunctionBench().scaled(0.1 if quick else 1.0), phases=("run-code",))
    elif burst is not None or phases:
        pools = importlib.import_module("dsec.bench.pools")
        config = pools.PoolBench().scaled(0.1 if quick else 1.0)
        config = dataclasses.replace(config, burst_n=burst or config.burst_n, phases=phases)
    code = benchmarks.main(list(suites) or None, json_path, config, skip=skip, quick=quick, idle_vms=idle_vms)
    sys.exit(code if isinstance(code, int) else 0)


@main.command()
def demo() -> None:
    """Run an agent-style rollout (buggy code -> failing test -> fix -> passing test)."""
    from dsec import demo as rollout

    sys.exit(rollout.run())


# ----- cluster ------------------------------------------------------------------------------------


@main.group()
def cluster() -> None:
    """Cluster mode on an existing Ray cluster: a gateway and one node daemon per Ray node."""


@cluster.command(name="up")
@click.option("--db", required=True, help="PostgreSQL URL for the gateway's state (postgresql://...).")
@click.option("--jobs", "jobs_file", required=True, type=click.Path(exists=True, path_type=Path),
              help="Jobs file: tokens and quotas (see docs/cluster.md).")
@click.option("--listen", default="0.0.0.0:7070", show_default=True, help="Gateway HOST:PORT.")
@click.option("--node-config", type=click.Path(exists=True, path_type=Path),
              help="JSON of node settings: shared image store, trajectory DB, snapshots, slots.")
@click.option("--ray-address", default="auto", show_default=True, help="The Ray cluster to join.")
@click.option("--log", "log_path", default="/var/lib/dsec/cluster/gateway.log", show_default=True,
              help="Gateway log file (on the node that runs it).")
@click.option("--wait", "wait", type=float, default=120.0, show_default=True,
              help="Seconds to wait for the gateway to answer (0: return at once).")
@click.option("--replicas", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Gateway replicas, spread over the Ray nodes (replica i listens on PORT+i); clients take "
                   "every address (DSEC_URL=URL1,URL2,...) and fail over.")
def cluster_up(db: str, jobs_file: Path, listen: str, node_config: Path | None, ray_address: str,
               log_path: str, wait: float, replicas: int) -> None:
    """Start the gateway as a detached Ray actor on this node (or ``--replicas N`` of them on any nodes,
    sharing the nodes in cells); it starts a node daemon on every Ray node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dsec.cluster.ray_nodes import GATEWAY_ACTOR, NAMESPACE, GatewayProcess
    from dsec.cluster.server import Jobs

    Jobs.load(jobs_file)  # refuse a bad jobs file here, not in a log on another machine
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or int(port) + replicas > 65536:
        raise InvalidRequest(f"--listen must be HOST:PORT with room for {replicas} port(s) from PORT, got {listen!r}")
    args = ["--db", db, "--ray-address", ray_address]
    files: dict[str, str] | None = None
    if replicas == 1:
        args += ["--listen", listen, "--jobs", str(jobs_file.resolve())]
        if node_config is not None:
            args += ["--node-config", str(node_config.resolve())]
    else:  # a replica may run on any node: its files go with it
        files = {"--jobs": jobs_file.read_text()}
        if node_config is not None:
            files["--node-config"] = node_config.read_text()
    logs = [Path(log_path)] + [Path(log_path).with_stem(f"{Path(log_path).stem}-{i}") for i in range(1, replicas)]
    ray.init(address=ray_address, namespace=NAMESPACE, log_to_driver=False)
    try:
        if _gateway_actors(ray):
            raise InvalidRequest("a DSec gateway already runs on this Ray cluster: `dsec cluster down` first")
        here = ray.get_runtime_context().get_node_id()
        strategy: Any = NodeAffinitySchedulingStrategy(node_id=here, soft=False) if replicas == 1 else "SPREAD"
        actors = [ray.remote(GatewayProcess).options(
            name=GATEWAY_ACTOR if i == 0 else f"{GATEWAY_ACTOR}-{i}", namespace=NAMESPACE, lifetime="detached",
            num_cpus=0, scheduling_strategy=strategy,
        ).remote(args, str(logs[i]), files, None if replicas == 1 else f"{host}:{int(port) + i}")
            for i in range(replicas)]
        urls = [f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"] if replicas == 1 else \
            ray.get([actor.address.remote() for actor in actors], timeout=max(wait, 60))  # type: ignore[attr-defined]
    finally:
        ray.shutdown()
    where = ",".join(urls)
    if wait > 0:
        for url, log in zip(urls, logs, strict=True):
            _wait_for_gateway(url, wait, log)
        click.echo(f"gateway up on {where} (log: {log_path}); point DSEC_URL at it")
    else:
        click.echo(f"gateway starting on {where} (log: {log_path}); point DSEC_URL at it")


def _gateway_actors(ray: Any) -> list[str]:
    """The names of the gateway replicas' actors on the Ray cluster."""
    from dsec.cluster.ray_nodes import GATEWAY_ACTOR

    return [name for name in ray.util.list_named_actors()
            if name == GATEWAY_ACTOR or name.startswith(f"{GATEWAY_ACTOR}-")]


def _wait_for_gateway(url: str, wait: float, log_path: Path) -> None:
    """Until the gateway (replica) started by ``cluster up`` at ``url`` answers; else fail with its log's tail
    (when it runs on this node)."""
    from dsec.api.client import serves

    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if serves(url):
            return
        time.sleep(0.3)
    try:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
    except OSError as exc:
        tail = f"(cannot read {log_path} here: {exc}; it is on the node the replica runs on)"
    _fail(f"the gateway did not answer at {url} within {wait:g} s; its log ({log_path}):\n{tail}")


@cluster.command(name="down")
@click.option("--destroy", is_flag=True, help="Also destroy every sandbox on every node.")
@click.option("--ray-address", default="auto", show_default=True, help="The Ray cluster.")
def cluster_down(destroy: bool, ray_address: str) -> None:
    """Stop the gateway and every node daemon (sandboxes stay unless --destroy)."""
    import ray

    from dsec.cluster.ray_nodes import NAMESPACE, NodeConfig, RayNodes

    ray.init(address=ray_address, namespace=NAMESPACE, log_to_driver=False)
    try:
        for name in _gateway_actors(ray):  # every replica
            with contextlib.suppress(ValueError):
                actor = ray.get_actor(name, namespace=NAMESPACE)
                with contextlib.suppress(Exception):
                    ray.get(actor.stop.remote(), timeout=60)
                ray.kill(actor)
        RayNodes(NodeConfig()).stop_all(destroy=destroy)
    finally:
        ray.shutdown()
    click.echo("cluster stopped")


@cluster.command(name="gateway", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def cluster_gateway(args: tuple[str, ...]) -> None:
    """Run the gateway in the foreground (options: python -m dsec.cluster gateway --help)."""
    from dsec.cluster.server import main as gateway_main

    sys.exit(gateway_main(["gateway", *args]))
