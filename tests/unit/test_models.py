"""Wire-model validation: what the daemon refuses before any backend sees it."""

from __future__ import annotations

import pydantic
import pytest

from dsec.models import ExecRequest, ExecResult, SandboxSpec, parse_size


@pytest.mark.parametrize(("text", "size"), [("1Gi", 1 << 30), ("512Mi", 512 << 20), ("4G", 4 * 10**9), (1024, 1024)])
def test_sizes(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["", "1 parsec", "-1Gi", 0, True, "Gi"])
def test_bad_sizes_name_the_value(bad: object) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


@pytest.mark.parametrize("env", [{"A=B": "x"}, {"": "x"}, {"A": "x\0y"}, {"A\0": "x"}])
def test_exec_env_that_execve_cannot_carry_is_refused(env: dict[str, str]) -> None:
    # Such entries once reached the exec helper, whose posix_spawn raised and took it down.
    with pytest.raises(pydantic.ValidationError, match="invalid entry"):
        ExecRequest(command="true", env=env)
    with pytest.raises(pydantic.ValidationError, match="invalid entry"):
        SandboxSpec(image="x", env=env)


def test_exec_request_shapes() -> None:
    assert ExecRequest(command="echo hi").argv() == ["/bin/sh", "-c", "echo hi"]
    assert ExecRequest(command=["ls", "-l"]).argv() == ["ls", "-l"]
    for bad in ({"command": ""}, {"command": []}, {"command": "a\0b"}, {"command": "x", "cwd": ""},
                {"command": "x", "timeout": 0}, {"command": "x", "unknown": 1}):
        with pytest.raises(pydantic.ValidationError):
            ExecRequest(**bad)  # type: ignore[arg-type]


def test_binary_fields_round_trip_as_base64() -> None:
    result = ExecResult(exit_code=0, stdout=b"\xff\x00\x01", stderr=b"")
    wire = result.model_dump_json()
    assert '"stdout":"_wAB"' in wire  # URL-safe base64 (RFC 4648 §5), as pydantic encodes it
    assert ExecResult.model_validate_json(wire).stdout == b"\xff\x00\x01"
