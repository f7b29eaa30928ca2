"""The documentation site builds with mkdocs in strict mode (warnings are errors) and holds every page."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_site_builds_strict_with_every_page(tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    page = {name: (site / name / "index.html").read_text() for name in
            ("quickstart", "concepts", "sdk", "cookbook", "operations", "security", "benchmarks", "cluster",
             "design")}
    # The SDK reference is generated from the docstrings (into Markdown that reads in the repository too).
    assert "AsyncSandbox.create_many" in page["sdk"] and "Client.audit" in page["sdk"]
    assert "SandboxTimeout" in page["sdk"] and "max_output" in page["sdk"]
    for call in ("call_with", "files.upload", "files.download", "set_network"):
        assert call in page["sdk"], call
    assert "golden snapshot" in page["cookbook"] and "PYTHONPYCACHEPREFIX" in page["cookbook"]
    assert "Attack table" in page["security"]
    # The benchmark page includes SPECIFICATION.md and bench/README.md (targets and how to reproduce).
    assert "dsec bench container" in page["benchmarks"] and "How each suite measures" in page["benchmarks"]
    assert "Choosing a store" in page["operations"] and "KubeRay" in page["operations"]
    assert (site / "openapi.json").is_file() and (site / "images" / "dashboard.png").is_file()


def test_the_sdk_reference_is_current_markdown() -> None:
    """docs/sdk.md holds the reference itself (readable on GitHub), regenerated from the docstrings."""
    from dsec._sdk import docgen

    page = docgen.PAGE.read_text()
    assert page == docgen.updated(page), "docs/sdk.md is stale: run python -m dsec._sdk.docgen"
    assert "\n::: " not in page, "mkdocstrings placeholders read as nothing in the repository"
    for field in ("network", "pids", "disk"):
        assert f"| `{field}` |" in page, field
