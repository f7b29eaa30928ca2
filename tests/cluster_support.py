"""The local Ray cluster of the cluster-mode tests (:mod:`dsec.cluster.local`), checked for leftovers.

Every node home is registered with the session-wide leak check, and after teardown the container
backend's sweep must find nothing under any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import Iterator
from typing import Any

from conftest import missing
from container_support import SESSION_TAGS, home_tag, images_dir, sweep
from dsec.cluster.local import LocalCluster, local_cluster, own_netns
from postgres_support import PgServer, postgres_server

__all__ = ["LocalCluster", "checked_cluster", "cluster_services", "own_netns"]


@contextlib.contextmanager
def cluster_services() -> Iterator[PgServer]:
    """What every cluster test starts from: Ray and iproute2 installed (else reported missing), the test's own
    network namespace, and a PostgreSQL server in it."""
    try:
        import ray  # noqa: F401
    except ImportError:
        missing("ray is not installed: pip install 'dsec[cluster]' (./scripts/setup)")
    if shutil.which("ip") is None:
        missing("iproute2 is not installed (./scripts/setup)")
    with own_netns(), contextlib.ExitStack() as stack:
        try:
            pg = stack.enter_context(postgres_server())
        except RuntimeError as exc:
            if "not installed" in str(exc):
                missing(str(exc))
            raise
        yield pg


@contextlib.contextmanager
def checked_cluster(pg: PgServer, workers: int, jobs: dict[str, dict[str, Any]],
                    slots: dict[str, int], **kw: Any) -> Iterator[LocalCluster]:
    """A local cluster whose node homes are swept and checked after teardown (``kw``: more arguments of
    :func:`~dsec.cluster.local.local_cluster`; ``images`` defaults to the tests' image directory)."""
    homes = []
    images = kw.pop("images", images_dir())
    try:
        with local_cluster(pg.dsn, workers, jobs, slots, images, **kw) as handle:
            homes = handle.node_homes()
            for home in homes:
                SESSION_TAGS.add(home_tag(home))
            yield handle
    finally:
        left = {str(home): asyncio.run(sweep(home, images)) for home in homes}
        assert not any(left.values()), f"cluster teardown left sandboxes: {left}"
