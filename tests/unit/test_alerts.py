"""The Prometheus alerting rules shipped in deploy/prometheus: valid for Prometheus's own checker, firing (and
staying quiet) as documented when Prometheus's rule engine runs them over synthetic series (`promtool test
rules`), and naming only metrics the node daemon and the gateway really export.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

import dsec.errors
from conftest import missing
from dsec.cluster.gateway import GatewayEngine, NodeFacts
from dsec.daemon.metrics import Metrics

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "dsec-alerts.yml"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        missing("promtool not found: apt-get install prometheus (scripts/setup does)")
    assert found is not None
    return found


def rules() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}


def test_the_rules_pass_promtools_check() -> None:
    done = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def _sample_names(registry: Any) -> set[str]:
    """Every sample name a registry can expose (families with no child yet included)."""
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count",
                                                                               "_created")}
    return {family.name + s for family in registry.collect() for s in suffixes[family.type]}


def test_every_metric_in_the_rules_is_exported() -> None:
    class _State:
        writer = None

        async def aclose(self) -> None:
            pass

    async def membership() -> list[NodeFacts]:
        return []

    exported = _sample_names(Metrics().registry) | _sample_names(GatewayEngine(_State(), membership).metrics.registry)
    exported.add("up")  # Prometheus's own, per scrape target
    named: set[str] = set()
    for rule in rules().values():
        named.update(re.findall(r"\b((?:dsec_|up\b)[a-z_]*)", rule["expr"]))
    assert named, "no metric found in the rules: the pattern is wrong"
    assert named <= exported, f"the rules name metrics nobody exports: {sorted(named - exported)}"
    # The failure reasons the create alert leaves to the caller are real error names (or "cancelled").
    reasons = re.search(r'reason!~"([^"]+)"', rules()["DSecCreatesFailing"]["expr"])
    assert reasons is not None
    for name in reasons.group(1).split("|"):
        assert name == "cancelled" or isinstance(getattr(dsec.errors, name, None), type), name


# Each case: series (1-minute samples), then (minute, alert, [(labels, summary)]) checks; an empty list means
# the alert must not fire then. Descriptions are taken from the rules file (they have no templates).
_CASES: list[tuple[str, dict[str, str], list[tuple[int, str, list[tuple[dict[str, str], str]]]]]] = [
    ("a node daemon stops answering", {
        'up{job="dsec", instance="n1:8700"}': "1 1 0x10",
        'up{job="dsec", instance="n2:8700"}': "1x12",
    }, [
        (3, "DSecDaemonDown", []),
        (5, "DSecDaemonDown", [({"job": "dsec", "instance": "n1:8700"},
                                "DSec daemon n1:8700 does not answer /metrics")]),
    ]),
    ("creates fail on the node's side, or every create fails, but not the caller's mistakes", {
        # n1: every create fails (no created series at all); n2: 1% fail; n3: only the callers' mistakes.
        'dsec_sandboxes_failed_total{instance="n1", backend="container", reason="CacheFull"}': "0+60x30",
        'dsec_sandboxes_created_total{instance="n2", backend="container"}': "0+600x30",
        'dsec_sandboxes_failed_total{instance="n2", backend="container", reason="SandboxError"}': "0+6x30",
        'dsec_sandboxes_created_total{instance="n3", backend="container"}': "0+60x30",
        'dsec_sandboxes_failed_total{instance="n3", backend="container", reason="ImageNotFound"}': "0+60x30",
        'dsec_sandboxes_failed_total{instance="n3", backend="container", reason="InvalidRequest"}': "0+60x30",
    }, [
        (10, "DSecCreatesFailing", []),
        (20, "DSecCreatesFailing", [({"instance": "n1", "reason": "CacheFull"},
                                     "100% of creates on n1 fail with CacheFull")]),
    ]),
    ("a background teardown fails, on a counter exported at 0 or born at 1", {
        'dsec_teardown_failures_total{instance="n1", backend="microvm"}': "0x10 1x20",
        'dsec_teardown_failures_total{instance="n2", backend="container"}': "_x10 1x40",
    }, [
        (9, "DSecTeardownsFailing", []),
        (12, "DSecTeardownsFailing", [({"instance": "n1", "backend": "microvm"},
                                       "Sandbox teardowns fail on n1 (microvm)"),
                                      ({"instance": "n2", "backend": "container"},
                                       "Sandbox teardowns fail on n2 (container)")]),
        (45, "DSecTeardownsFailing", []),
    ]),
    ("creates queue for room", {
        # 60 creates a minute, each waiting 10-30 s.
        'dsec_admission_queue_seconds_bucket{instance="n1", backend="container", le="5.0"}': "0x40",
        'dsec_admission_queue_seconds_bucket{instance="n1", backend="container", le="10.0"}': "0x40",
        'dsec_admission_queue_seconds_bucket{instance="n1", backend="container", le="30.0"}': "0+60x40",
        'dsec_admission_queue_seconds_bucket{instance="n1", backend="container", le="+Inf"}': "0+60x40",
    }, [
        (14, "DSecAdmissionQueueing", []),
        (30, "DSecAdmissionQueueing", [({"instance": "n1"}, "Creates on n1 wait 28s (p90) for room")]),
    ]),
    ("a warm pool misses most claims", {
        'dsec_pool_claims_total{instance="n1", pool="p1", outcome="miss"}': "0+30x40",
        'dsec_pool_claims_total{instance="n1", pool="p1", outcome="hit"}': "0+10x40",
        'dsec_pool_claims_total{instance="n1", pool="p2", outcome="hit"}': "0+30x40",
    }, [
        (30, "DSecWarmPoolMissing", [({"instance": "n1", "pool": "p1"},
                                      "Warm pool p1 on n1 misses 75% of claims")]),
    ]),
    ("the gateway stops answering", {
        'up{job="dsec-gateway", instance="gw:8800"}': "1 0x10",
    }, [
        (4, "DSecGatewayDown", [({"job": "dsec-gateway", "instance": "gw:8800"},
                                 "The DSec cluster gateway gw:8800 does not answer /metrics")]),
    ]),
    ("a node is held for long, not for a restart's seconds", {
        'dsec_cluster_nodes_unready{instance="gw"}': "0 1 0 0 1x20",
    }, [
        (8, "DSecClusterNodeHeld", []),
        (20, "DSecClusterNodeHeld", [({"instance": "gw"},
                                      "1 node(s) alive for Ray but without a serving DSec daemon for 10 min")]),
    ]),
    ("nodes are lost, then the count holds for 30 min", {
        'dsec_cluster_nodes_alive{instance="gw"}': "3x10 2x50",
    }, [
        (9, "DSecClusterNodesLost", []),
        (20, "DSecClusterNodesLost", [({"instance": "gw"}, "The DSec cluster has 2 node(s), fewer than 30 min ago")]),
        (55, "DSecClusterNodesLost", []),
    ]),
    ("creates wait for room in the cluster", {
        'dsec_cluster_admission_waiting{instance="gw"}': "0 5x20",
    }, [
        (15, "DSecClusterFull", [({"instance": "gw"},
                                  "Creates have waited for room on the DSec cluster for 10 min (5 waiting now)")]),
    ]),
]


@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_the_rules_fire_as_documented(tmp_path: Path,
                                      case: tuple[str, dict[str, str], list[tuple[int, str, Any]]]) -> None:
    _name, series, checks = case
    by_name = rules()
    tests = [{
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "alert_rule_test": [{
            "eval_time": f"{minute}m",
            "alertname": alert,
            "exp_alerts": [{
                "exp_labels": {**labels, "severity": by_name[alert]["labels"]["severity"]},
                "exp_annotations": {"summary": summary, "description": by_name[alert]["annotations"]["description"]},
            } for labels, summary in expected],
        } for minute, alert, expected in checks],
    }]
    spec = tmp_path / "alerts-test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": tests}))
    done = subprocess.run([promtool(), "test", "rules", str(spec)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
