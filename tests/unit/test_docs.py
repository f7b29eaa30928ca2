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
            ("quickstart", "concepts", "sdk", "operations", "security", "benchmarks", "cluster", "design")}
    # The SDK reference is generated from the docstrings.
    assert "AsyncSandbox.create_many" in page["sdk"] and "Client.audit" in page["sdk"]
    assert "SandboxTimeout" in page["sdk"] and "max_output" in page["sdk"]
    assert "Attack table" in page["security"]
    # The benchmark page includes SPECIFICATION.md and bench/README.md (targets and how to reproduce).
    assert "dsec bench container" in page["benchmarks"] and "How each suite measures" in page["benchmarks"]
    assert "Choosing a store" in page["operations"] and "KubeRay" in page["operations"]
    assert (site / "openapi.json").is_file() and (site / "images" / "dashboard.png").is_file()
