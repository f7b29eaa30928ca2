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
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click
from rich.console import Console
from rich.markup import escape

from dsec.cli_images import register as _register_images
from dsec.cli_ops import register as _register_ops
from dsec.cli_surface import register as _register_surface
from dsec.cli_trajectory import register as _register_trajectory
from dsec.errors import DSecError, InvalidRequest
from dsec.models import parse_pairs

if TYPE_CHECKING:
    pass

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
_register_images(main)


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
@click.option("--requests-per-s", type=float, help="Rate limit on all requests (a call batch: each item).")
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
@click.option("--daemon-every", type=click.FloatRange(5, 24 * 3600), metavar="SECONDS",
              help="soak suite: the daemon is SIGKILLed at its turn only once it lived this long (default 1200).")
def bench(suites: tuple[str, ...], json_path: Path | None, skip: tuple[str, ...], quick: bool,
          burst: int | None, phases: tuple[str, ...], idle_vms: int | None, fleet_sizes: str | None,
          live: int | None, minutes: float | None, fault_every: float | None, daemon_every: float | None) -> None:
    """Run benchmarks against the peers measured in the same run (no SUITE: every suite but soak)."""
    # Imported by name: the benchmarks pull in peers' tooling that most commands never need.
    benchmarks = importlib.import_module("dsec.bench")
    config = None
    if (minutes or fault_every or daemon_every) and suites != ("soak",):
        raise click.UsageError("--minutes, --fault-every and --daemon-every are options of `dsec bench soak`")
    if suites == ("soak",):
        soak = importlib.import_module("dsec.bench.soak")
        config = soak.SoakBench()
        config = dataclasses.replace(config, minutes=minutes or (config.minutes * (0.1 if quick else 1.0)),
                                     fault_every_s=fault_every or config.fault_every_s,
                                     daemon_every_s=daemon_every or config.daemon_every_s)
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
