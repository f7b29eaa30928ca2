"""Trajectories, checkpoints and forks on real container sandboxes behind real daemon processes.

A rollout script (counter file, git commits, a pip install of a wheel built here) is SIGKILLed at a random
step and re-run: every logged command runs exactly once (counted inside the sandbox) and the script's
output equals an uninterrupted run's. Also: the lease of an abandoned trajectory sandbox expires (``dsec ps``
shows it orphaned first); a snapshot restores on a second daemon with another state directory; fork(8)
gives 8 independent sandboxes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec
from conftest import missing
from container_support import images_dir, short_home, sweep, wait_until
from dsec.config import Settings
from dsec.daemon.server import daemon_answers
from dsec.images.image_store import ImageStore
from image_support import make_tree, seaweedfs

pytestmark = [pytest.mark.root, pytest.mark.slow]


class Daemon:
    """``python -m dsec.daemon serve`` on its own home, sharing one snapshot store with other daemons."""

    def __init__(self, home: Path, images: Path | None = None, **env: str) -> None:
        self.home = home
        self.images = images or images_dir()
        self.settings = Settings(home=home, images_dir=self.images)
        self.env = dict(os.environ, DSEC_HOME=str(home), DSEC_IMAGES=str(self.images),
                        DSEC_URL=f"unix://{self.settings.socket_path}", **env)
        self.log = home / "daemon.log"
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dsec.daemon", "serve", "--home", str(home)], stdin=subprocess.DEVNULL,
                stdout=log, stderr=log, env=self.env, start_new_session=True, cwd="/")
        ok = wait_until(lambda: self.proc.poll() is not None or daemon_answers(self.settings), timeout=60)
        assert ok and self.proc.poll() is None, f"daemon did not start:\n{self.log.read_text()[-3000:]}"
        self.client = dsec.Client(self.env["DSEC_URL"])

    def stop(self) -> None:
        """Destroy every sandbox, stop the daemon, and check nothing of this home is left on the host."""
        try:
            for sb in dsec.Sandbox.list(client=self.client):
                sb.close()
        finally:
            # Whatever failed above, the daemon goes and the sweep destroys what it left.
            self.client.close()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            removed = asyncio.run(sweep(self.home, self.images))
        assert removed == [], f"sandboxes were left behind: {removed}"


@pytest.fixture(scope="module")
def snapshots() -> Iterator[ImageStore]:
    """The image store (snapshots go there by default); the snapshot records this module made are removed
    afterwards (their few chunks stay for `dsec image gc`, like any unreferenced chunk)."""
    store = ImageStore(images_dir())
    before = set(store.snapshot_ids())
    yield store
    for snap_id in set(store.snapshot_ids()) - before:
        store.remove_snapshot(snap_id)


@pytest.fixture(scope="module")
def daemon(snapshots: ImageStore, debian_python_image: object) -> Iterator[Daemon]:
    home = short_home("dsec-traj-")
    d = Daemon(home)
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


# -- the rollout ---------------------------------------------------------------------------------------

ROLLOUT = textwrap.dedent('''
    import json, sys
    import dsec

    trajectory, wheel, pip_wheel = sys.argv[1:4]
    sb = dsec.Sandbox.create(image="debian-python", trajectory=trajectory, lease=600)
    print(json.dumps(["sandbox", sb.id]), flush=True)
    GIT = {"GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
           "GIT_AUTHOR_NAME": "agent", "GIT_AUTHOR_EMAIL": "agent@example.invalid",
           "GIT_COMMITTER_NAME": "agent", "GIT_COMMITTER_EMAIL": "agent@example.invalid"}

    def step(n, command):
        # Every command first records that it ran: the log must never let one run twice.
        r = sb.exec(f"echo {n} >> /workspace/.ran; " + command, timeout=300, env=GIT)
        print(json.dumps([n, r.exit_code, r.stdout.decode(), r.stderr.decode()]), flush=True)

    step(0, "echo tick >> counter; wc -l < counter")
    step(1, "git init -q repo && echo ok")
    sb.files.write("/workspace/repo/a.txt", "hello\\n")
    step(2, "cd repo && git add a.txt && git commit -q -m first && git rev-parse HEAD")
    step(3, "echo tick >> counter; sleep 0.4; wc -l < counter")
    sb.files.write("/tmp/" + wheel.rsplit("/", 1)[1], open(wheel, "rb").read())
    sb.files.write("/tmp/pip.whl", open(pip_wheel, "rb").read())
    step(4, "python3 /tmp/pip.whl/pip install -q --no-index --no-cache-dir --root-user-action=ignore "
            "--break-system-packages --disable-pip-version-check /tmp/tinypkg-1.0-py3-none-any.whl && "
            "python3 -c 'import tinypkg; print(tinypkg.VALUE)'")
    step(5, "echo tick >> counter; wc -l < counter")
    step(6, "cd repo && echo more >> a.txt && git commit -q -am second && git log --format=%H | wc -l")
    print(json.dumps(["counter", sb.files.read("/workspace/counter").decode()]), flush=True)
    print(json.dumps(["listing", sorted(e.name for e in sb.files.list("/workspace"))]), flush=True)
    print("DONE", flush=True)
''')


def build_wheel(target: Path) -> Path:
    """A minimal pure-Python wheel (PEP 427), written by hand so the test needs no build backend."""
    files = {"tinypkg/__init__.py": b"VALUE = 'tinypkg works'\n",
             "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
             "tinypkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: dsec-test\nRoot-Is-Purelib: true\n"
                                            b"Tag: py3-none-any\n"}
    record = io.StringIO()
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.write(f"{name},sha256={digest},{len(data)}\n")
    record.write("tinypkg-1.0.dist-info/RECORD,,\n")
    path = target / "tinypkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("tinypkg-1.0.dist-info/RECORD", record.getvalue())
    return path


def pip_wheel() -> Path:
    """pip's own wheel (runnable as ``python3 pip.whl/pip``): the image has Python but no pip."""
    import ensurepip

    candidates = [*Path("/usr/share/python-wheels").glob("pip-*.whl"),
                  *(Path(ensurepip.__file__).parent / "_bundled").glob("pip-*.whl")]
    if not candidates:
        missing("no pip wheel on the host: apt-get install python3-pip-whl")
    return sorted(candidates)[-1]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_wheel(tmp_path_factory.mktemp("wheel")), pip_wheel()


def start_rollout(daemon: Daemon, trajectory: str, wheels: tuple[Path, Path], script: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(script), trajectory, str(wheels[0]), str(wheels[1])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=daemon.env)


def run_rollout(daemon: Daemon, trajectory: str, wheels: tuple[Path, Path], script: Path) -> list[str]:
    proc = start_rollout(daemon, trajectory, wheels, script)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"rollout failed ({proc.returncode}):\n{out}\n{err}"
    return out.splitlines()


def without_id(lines: list[str]) -> list[str]:
    return [line for line in lines if not line.startswith('["sandbox"')]


def ran_counts(daemon: Daemon, sandbox_id: str) -> dict[int, int]:
    """How often each step's command really ran, from the file every command appends to in the sandbox."""
    sb = dsec.Sandbox.connect(sandbox_id, client=daemon.client)
    text = sb.exec("cat /workspace/.ran").stdout.decode()
    counts: dict[int, int] = {}
    for line in text.split():
        counts[int(line)] = counts.get(int(line), 0) + 1
    return counts


def test_rollout_killed_at_a_random_step_runs_every_command_once(
    daemon: Daemon, wheels: tuple[Path, Path], tmp_path: Path
) -> None:
    script = tmp_path / "rollout.py"
    script.write_text(ROLLOUT)
    reference = run_rollout(daemon, "job-1/reference", wheels, script)
    assert reference[-1] == "DONE" and '"tinypkg works\\n"' in "".join(reference)

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    kill_after = rng.randrange(2, 8)  # lines printed before the kill: the sandbox line, then steps
    extra = rng.uniform(0.0, 0.5)  # and a little more, so the kill may land inside a command
    proc = start_rollout(daemon, "job-1/preempted", wheels, script)
    assert proc.stdout is not None
    seen = [proc.stdout.readline() for _ in range(kill_after)]
    time.sleep(extra)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    proc.stdout.close()
    assert proc.stderr is not None
    proc.stderr.close()
    sandbox_id = json.loads(seen[0])[1]

    resumed = run_rollout(daemon, "job-1/preempted", wheels, script)
    assert json.loads(resumed[0])[1] == sandbox_id, "the re-run must re-attach the same live sandbox"
    assert without_id(resumed) == without_id(reference), f"seed {seed}: outputs differ"
    assert ran_counts(daemon, sandbox_id) == dict.fromkeys(range(7), 1), f"seed {seed}: a command ran twice"


def test_abandoned_trajectory_sandbox_is_orphaned_then_its_lease_expires(daemon: Daemon) -> None:
    # The orphaned window (idle for half the lease, until the lease ends) must outlast one `dsec ps` under load.
    sb = dsec.Sandbox.create(image="debian-python", trajectory="job-2/abandoned", lease=12, client=daemon.client)
    assert sb.exec("true").exit_code == 0
    sandbox_id = sb.id
    del sb  # the client lets go of its handle: the SDK's heartbeat stops with it
    gc.collect()
    ps = lambda: json.loads(subprocess.run(  # noqa: E731
        [sys.executable, "-m", "dsec", "ps", "--json"], env=daemon.env, capture_output=True, text=True,
        check=True).stdout)
    assert wait_until(lambda: any(i["id"] == sandbox_id and i["trajectory"]["orphaned"] for i in ps()), timeout=30)
    assert wait_until(lambda: all(i["id"] != sandbox_id for i in ps()), timeout=40)
    with pytest.raises(dsec.SandboxTimeout, match="lease"):
        dsec.Sandbox.connect(sandbox_id, client=daemon.client)


def overlay_lowers(sandbox_id: str) -> list[str]:
    """The lower layers of a container sandbox's root overlay, top first (from the mount table of the mount
    holder that holds it: sandbox mounts are never in the host's table)."""
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(OSError):
            if comm.read_text().strip() != "dsec-mntns":
                continue
            for line in (comm.parent / "mountinfo").read_text().splitlines():
                if f"/{sandbox_id} " in line and " - overlay " in line:
                    opts = line.split(" - overlay ", 1)[1].split()[1].split(",")
                    return [o.removeprefix("lowerdir+=") for o in opts if o.startswith("lowerdir+=")]
    raise AssertionError(f"no overlay mount for {sandbox_id}")


def test_snapshot_restores_on_a_second_daemon_with_another_home(daemon: Daemon, snapshots: ImageStore) -> None:
    sb = dsec.Sandbox.create(image="debian-python", client=daemon.client)
    try:
        sb.files.write("/workspace/state/model.txt", "trained\n", mode=0o640)
        # a whiteout (deleted image file), an opaque directory (image dir replaced), a hard link, an owner
        prep = sb.exec("rm /etc/debian_version && rm -rf /etc/apt && mkdir /etc/apt && echo mine > /etc/apt/only && "
                       "mkdir -p /srv/data && echo 42 > /srv/data/x && ln /srv/data/x /srv/data/hard && "
                       "chown 1234:4321 /srv/data/x && ln -s /srv/data/x /workspace/link")
        assert prep.exit_code == 0, prep.stderr
        snap = sb.snapshot()
    finally:
        sb.close()
    record = snapshots.snapshot(snap)
    assert record is not None and len(record["layers"]) == 1  # one chunked EROFS layer in the image store
    assert snapshots.manifest_by_digest(record["layers"][0]).chunks
    other_home = short_home("dsec-traj2-")
    other = Daemon(other_home)
    try:
        restored = dsec.Sandbox.create(snapshot=snap, client=other.client)
        assert restored.info().image == "debian-python"
        assert restored.files.read("/workspace/state/model.txt") == b"trained\n"
        check = restored.exec("stat -c '%a %u' /workspace/state/model.txt; cat /workspace/link; "
                              "test -e /etc/debian_version && echo present || echo deleted; ls /etc/apt; "
                              "stat -c '%h %u:%g' /srv/data/x /srv/data/hard")
        assert check.stdout == b"640 0\n42\ndeleted\nonly\n2 1234:4321\n2 1234:4321\n", check.stderr
        # a snapshot of the restored sandbox is one more layer (its changes) over the first one
        restored.exec("echo again > /workspace/second && rm /workspace/state/model.txt")
        second = restored.snapshot()
        layers = snapshots.snapshot(second)["layers"]  # type: ignore[index]
        assert layers[1:] == record["layers"] and len(layers) == 2
        third = dsec.Sandbox.create(snapshot=second, client=daemon.client)
        try:
            got = third.exec("cat /workspace/second /workspace/link; ls /workspace/state; ls /etc/apt")
            assert got.stdout == b"again\n42\nonly\n", got.stderr
            assert len(overlay_lowers(third.id)) == 3  # two snapshot layers over the image
        finally:
            third.close()
        restored.close()
        # gone from the store: a clear error, nothing created
        snapshots.remove_snapshot(second)
        with pytest.raises(dsec.NotFound, match=second):
            dsec.Sandbox.create(snapshot=second, client=other.client)
    finally:
        other.stop()
        shutil.rmtree(other_home, ignore_errors=True)


def test_snapshots_dedup_identical_content(daemon: Daemon, snapshots: ImageStore) -> None:
    made = []
    try:
        for n in range(2):
            sb = dsec.Sandbox.create(image="debian-python", client=daemon.client)
            made.append(sb)
            # the same 8 MiB of data (seeded) in both, under different names, plus a file of its own
            write = f"open('/workspace/d{n}', 'wb').write(random.Random(7).randbytes(8 << 20))"
            sb.exec(f"python3 -c \"import random; {write}\" && echo {n} > /workspace/own")
        a, b = (snapshots.snapshot(sb.snapshot()) for sb in made)
        chunks = [{c.digest for c in snapshots.manifest_by_digest(r["layers"][0]).chunks}  # type: ignore[index]
                  for r in (a, b)]
        size = sum(c.size for c in snapshots.manifest_by_digest(a["layers"][0]).chunks)  # type: ignore[index]
        shared = chunks[0] & chunks[1]
        assert size >= 8 << 20 and len(shared) >= len(chunks[0]) - 2, (len(shared), len(chunks[0]))
    finally:
        for sb in made:
            sb.close()


def test_fork_8_gives_8_independent_sandboxes(daemon: Daemon, snapshots: ImageStore) -> None:
    parent = dsec.Sandbox.create(image="debian-python", client=daemon.client)
    kids: list[dsec.Sandbox] = []
    try:
        parent.exec("echo prepared > /workspace/env.txt && head -c 4M /dev/urandom > /workspace/big && (sleep 30 &)")
        kids = parent.fork(8)
        assert len({k.id for k in kids} | {parent.id}) == 9
        # copy-on-write: every copy stacks the same snapshot layer, and its own upper starts empty
        lowers = {tuple(overlay_lowers(k.id)) for k in kids}
        assert len(lowers) == 1 and len(next(iter(lowers))) == 2, lowers
        for kid in kids:
            assert not (daemon.home / "container" / kid.id / "upper" / "workspace").exists()
        for n, kid in enumerate(kids):
            assert kid.exec(f"cat env.txt && echo child{n} >> env.txt").stdout == b"prepared\n"
        for n, kid in enumerate(kids):
            assert kid.files.read("/workspace/env.txt") == f"prepared\nchild{n}\n".encode()
        assert parent.files.read("/workspace/env.txt") == b"prepared\n"
        assert parent.info().state == "running"  # thawed after the copy
        (snap,) = {k.info().spec.snapshot for k in kids}
        assert snap is not None and snapshots.snapshot(snap) is not None
    finally:
        for kid in kids:
            kid.close()
        parent.close()
    assert snapshots.snapshot(snap) is None  # fork's own snapshot went with its last copy


def test_lost_trajectory_sandbox_is_rebuilt_from_its_checkpoint(daemon: Daemon) -> None:
    sb = dsec.Sandbox.create(image="debian-python", trajectory="job-3/lost", client=daemon.client)
    sb.exec("echo before > /workspace/state && apt-get --version > /dev/null")
    checkpoint = sb.snapshot()
    sb.exec("echo after >> /workspace/state")
    first_view = sb.files.read("/workspace/state")
    sb.close()  # the sandbox is lost (as after a node loss with the log kept)

    again = dsec.Sandbox.create(image="debian-python", trajectory="job-3/lost", client=daemon.client)
    try:
        status = again.info().trajectory
        assert again.id != sb.id and status is not None
        assert status.restored_from == checkpoint and status.missing_effects == [2]
        # The agent's view fast-forwards unchanged; the sandbox holds the checkpoint's state.
        again.exec("echo before > /workspace/state && apt-get --version > /dev/null")
        assert again.snapshot() == checkpoint
        again.exec("echo after >> /workspace/state")
        assert again.files.read("/workspace/state") == first_view == b"before\nafter\n"
        assert again.exec("cat /workspace/state").stdout == b"before\n"  # live: call 2's effect is missing
    finally:
        again.close()


def test_checkpoint_taken_after_a_reveal_rebuilds_revealed(daemon: Daemon) -> None:
    name = "job-3/graded"
    sb = dsec.Sandbox.create(image="debian-python", trajectory=name, hidden=["/workspace/tests"],
                             protected=["/usr/bin"], client=daemon.client)
    sb.files.write("/workspace/tests/test_a.py", "assert True\n")
    assert sb.exec("ls /workspace/tests").stdout == b""  # hidden while the agent works
    sb.reveal()
    checkpoint = sb.snapshot()
    sb.close()  # lost after its checkpoint

    again = dsec.Sandbox.create(image="debian-python", trajectory=name, hidden=["/workspace/tests"],
                                protected=["/usr/bin"], client=daemon.client)
    try:
        status = again.info().trajectory
        assert again.id != sb.id and status is not None and status.restored_from == checkpoint
        again.files.write("/workspace/tests/test_a.py", "assert True\n")  # replayed from the log
        again.exec("ls /workspace/tests")
        again.reveal()
        assert again.snapshot() == checkpoint
        # Live: the rebuilt sandbox is in the grading phase, as the checkpoint was (not hidden again).
        r = again.exec("cat /workspace/tests/test_a.py; echo x > /workspace/tests/new; echo $?; touch /usr/bin/x")
        assert r.stdout.startswith(b"assert True\n") and r.stdout.splitlines()[1] != b"0", r
        assert b"Read-only file system" in r.stderr, r
    finally:
        again.close()


def test_client_killed_mid_command_reissue_waits_for_the_same_run(daemon: Daemon) -> None:
    script = textwrap.dedent('''
        import sys, dsec
        sb = dsec.Sandbox.create(image="debian-python", trajectory=sys.argv[1])
        print(sb.id, flush=True)
        r = sb.exec("echo started >> /workspace/runs; sleep 1.5; echo finished", timeout=60)
        print(r.stdout.decode().strip(), r.replayed, flush=True)
    ''')
    argv = [sys.executable, "-c", script, "job-4/in-flight"]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=daemon.env)
    assert first.stdout is not None
    sandbox_id = first.stdout.readline().strip()
    time.sleep(0.7)  # the command is running now
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    first.stdout.close()
    again = subprocess.run(argv, capture_output=True, text=True, env=daemon.env, timeout=120, check=True)
    assert again.stdout.split("\n")[:2] == [sandbox_id, "finished True"], again.stderr
    sb = dsec.Sandbox.connect(sandbox_id, client=daemon.client)
    assert sb.files.read("/workspace/runs") == b"started\n"  # ran once, its result went to the re-run
    sb.close()


def test_snapshot_in_an_s3_store_restores_on_another_daemon(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything in SeaweedFS (S3): the image, then a snapshot taken on one daemon, restored and forked on
    another that shares nothing with it but the bucket (its own home and its own local image root)."""
    with seaweedfs(monkeypatch) as weed:
        url = weed.url(prefix="traj")
        tree = tmp_path / "tree"
        make_tree(tree, big=1 << 20)
        first_images, second_images = short_home("dsec-s3img1-"), short_home("dsec-s3img2-")
        ImageStore(first_images, url).import_dir("bbox", tree, uid_shift=Settings().uid_shift)
        homes = [short_home("dsec-s3a-"), short_home("dsec-s3b-")]
        daemons: list[Daemon] = []
        try:
            daemons.append(Daemon(homes[0], first_images, DSEC_IMAGE_STORE=url))
            daemons.append(Daemon(homes[1], second_images, DSEC_IMAGE_STORE=url))
            sb = dsec.Sandbox.create(image="bbox", client=daemons[0].client)
            assert sb.exec("echo state > /etc/hello && mkdir -p /w && echo 1 > /w/n && rm /data/big.bin").exit_code == 0
            snap = sb.snapshot()
            sb.close()
            record = ImageStore(second_images, url).snapshot(snap)
            assert record is not None and record["image"] == "bbox"
            restored = dsec.Sandbox.create(snapshot=snap, client=daemons[1].client)
            got = restored.exec("cat /etc/hello /w/n; ls /data | wc -l")
            assert got.stdout == b"state\n1\n0\n", got.stderr
            kids = restored.fork(2)
            for n, kid in enumerate(kids):
                kid.exec(f"echo {n} > /w/n")
            assert [k.files.read("/w/n") for k in kids] == [b"0\n", b"1\n"]
            assert restored.files.read("/w/n") == b"1\n"
            for kid in kids:
                kid.close()
            restored.close()
        finally:
            for d in daemons:
                d.stop()
            for path in (*homes, first_images, second_images):
                shutil.rmtree(path, ignore_errors=True)
