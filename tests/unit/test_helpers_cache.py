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


def test_a_helper_in_parts_is_built_from_all_and_rebuilt_when_any_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_HELPERS", str(tmp_path / "helpers"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "part.h").write_text('#define WORD "one"\nconst char *word(void);\n')
    (src / "part.c").write_text('#include "part.h"\nconst char *word(void) { return WORD; }\n')
    (src / "main.c").write_text('#include <stdio.h>\n#include "part.h"\nint main(void) { puts(word()); return 0; }\n')
    parts = (src / "part.h", src / "part.c")
    first = binaries.ensure_binary(src / "main.c", "dsec-test", tmp_path / "bin", parts=parts)
    assert subprocess.run([first], capture_output=True, text=True, check=True).stdout == "one\n"
    (src / "part.h").write_text('#define WORD "two"\nconst char *word(void);\n')  # only the header changes
    second = binaries.ensure_binary(src / "main.c", "dsec-test", tmp_path / "bin", parts=parts)
    assert second.name != first.name
    assert subprocess.run([second], capture_output=True, text=True, check=True).stdout == "two\n"


@pytest.mark.parametrize(("directory", "prefix", "source", "parts"), [
    ("guest", "agent", "AGENT_SOURCE", "AGENT_PARTS"),
    ("isolation", "zygote", "ZYGOTE_SOURCE", "ZYGOTE_PARTS"),
])
def test_every_file_of_a_helper_is_in_its_build(directory: str, prefix: str, source: str, parts: str) -> None:
    """A new part that the build does not name would neither be compiled nor invalidate the cached binary."""
    from dsec.guest import initramfs
    module = initramfs if directory == "guest" else binaries
    here = Path(binaries.__file__).parent.parent / directory
    files = {p for p in here.iterdir() if p.name.startswith(prefix) and p.suffix in (".c", ".h")}
    assert files == {getattr(module, source), *getattr(module, parts)}


def test_a_binary_musl_cannot_build_is_built_with_glibc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_HELPERS", str(tmp_path / "helpers"))
    broken = tmp_path / "cc" / "musl-gcc"  # installed, but every build fails (headers it cannot take)
    broken.parent.mkdir()
    broken.write_text(f"#!/bin/sh\necho run >> {tmp_path}/tries\necho 'fatal error: asm/types.h: No such file' >&2\n"
                      "exit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("PATH", f"{broken.parent}:{os.environ['PATH']}")
    (tmp_path / "main.c").write_text('#include <stdio.h>\nint main(void) { puts("built"); return 0; }\n')
    built = binaries.ensure_binary(tmp_path / "main.c", "dsec-test", tmp_path / "bin", musl=True)
    assert built == binaries.binary_path(tmp_path / "main.c", "dsec-test", tmp_path / "bin")  # the glibc build's
    assert subprocess.run([built], capture_output=True, text=True, check=True).stdout == "built\n"
    again = binaries.ensure_binary(tmp_path / "main.c", "dsec-test", tmp_path / "bin", musl=True)
    assert again == built and not list((tmp_path / "bin").glob(".*"))  # no leftovers
    assert (tmp_path / "tries").read_text() == "run\n"  # musl was tried once in this process
