"""Compose files as the harness integrations read them (dsec.integrations.compose), and inspect's ``dsec``
sandbox config loaded from a compose file with ``build:``."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.errors import InvalidRequest
from dsec.integrations.compose import interpolate, load_compose


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "compose.yaml"
    path.write_text(text)
    return path


def test_interpolation_follows_compose() -> None:
    vars_ = {"SET": "x", "EMPTY": ""}
    assert interpolate("$SET ${SET} ${MISSING} $$SET", vars_) == "x x  $SET"
    assert interpolate("${EMPTY:-d} ${EMPTY-d} ${MISSING-d} ${SET:-d}", vars_) == "d  d x"


def test_single_service_with_build(tmp_path: Path) -> None:
    (tmp_path / "ctx").mkdir()
    path = write(tmp_path, """
services:
  main:
    build:
      context: ${CTX}
      dockerfile: app.Dockerfile
      args: {VERSION: "${V:-3}", N: 1}
    environment: ["A=1", "B=x=y", "UNSET"]
    working_dir: /app
    user: "1000:1000"
    network_mode: none
    ports: ["8080:80"]
""")
    (service,) = load_compose(path, {"CTX": "ctx"})
    assert service.name == "main" and service.image is None
    assert service.build_context == (tmp_path / "ctx").resolve() and service.dockerfile == "app.Dockerfile"
    assert service.build_args == {"VERSION": "3", "N": "1"}
    assert service.environment == {"A": "1", "B": "x=y"}
    assert (service.working_dir, service.user, service.network_mode) == ("/app", "1000:1000", "none")


def test_services_keep_file_order_and_short_build(tmp_path: Path) -> None:
    path = write(tmp_path, "services:\n  web: {build: ., environment: {K: v}}\n  db: {image: 'postgres:16'}\n")
    web, db = load_compose(path)
    assert (web.name, web.build_context, web.environment) == ("web", tmp_path.resolve(), {"K": "v"})
    assert (db.name, db.image, db.build_context) == ("db", "postgres:16", None)


@pytest.mark.parametrize(("text", "says"), [
    ("version: '3'\n", "has no services"),
    ("services: {}\n", "has no services"),
    ("services:\n  a: [1]\n", "service 'a' must be a mapping"),
    ("services:\n  a: {build: [1]}\n", "services.a.build must be"),
    ("services:\n  a: {image: x, environment: 3}\n", "services.a.environment must be"),
    ("services: [\n", "compose file"),
])
def test_malformed_files_name_what_is_wrong(tmp_path: Path, text: str, says: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(InvalidRequest, match=says) as info:
        load_compose(path)
    assert str(path) in str(info.value)


def test_inspect_config_from_single_service_compose_with_build(tmp_path: Path) -> None:
    pytest.importorskip("inspect_ai", reason="inspect-ai is not installed: pip install 'dsec[inspect]'")
    from dsec.integrations.inspect import load_config

    (tmp_path / "Dockerfile").write_text("FROM debian-python\n")
    path = write(tmp_path, "services:\n  default:\n    build: .\n    working_dir: /w\n    network_mode: none\n")
    config = load_config(str(path))
    service = config.services["default"]
    assert (service.build, service.dockerfile, service.image) == (str(tmp_path.resolve()), None, None)
    assert (service.workdir, config.network) == ("/w", "none")
