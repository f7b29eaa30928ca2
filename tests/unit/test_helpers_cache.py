"""Helper binaries are built once per node: a new home copies the node's build of the same source instead of
running the compiler, and only from a directory that only root can write."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dsec.isolation import binaries

pytestmark = [pytest.mark.root]


def test_a_new_home_copies_the_nodes_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "helpers"
    monkeypatch.setenv("DSEC_HELPERS", str(cache))
    first = binaries.ensure_init(tmp_path / "home-a" / "bin")  # compiled, then offered to the node
    assert (cache / first.name).read_bytes() == first.read_bytes()

    def no_compiler(*args: Any, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        raise AssertionError(f"compiled again: {args[0]}")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    second = binaries.ensure_init(tmp_path / "home-b" / "bin")
    assert second.name == first.name and second.read_bytes() == first.read_bytes()
    assert os.access(second, os.X_OK)


def test_a_cache_others_can_write_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "helpers"
    monkeypatch.setenv("DSEC_HELPERS", str(cache))
    built = binaries.ensure_init(tmp_path / "home-a" / "bin")
    planted = cache / built.name
    planted.write_bytes(b"#!/bin/sh\necho planted\n")
    cache.chmod(0o777)
    again = binaries.ensure_init(tmp_path / "home-b" / "bin")
    assert again.read_bytes() == built.read_bytes(), "a binary from a world-writable directory was run"
