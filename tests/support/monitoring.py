"""The operator's kit under k8s/monitoring as the tests read it: the alerting rules, the dashboard's
expressions, the metric names they use, and promtool (Debian package `prometheus`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

MONITORING = Path(__file__).resolve().parents[2] / "k8s" / "monitoring"
# Grafana's variables, as a query would see them
DASHBOARD_VARIABLES = {"$__rate_interval": "1m", "$namespace": "graphserve", "$pod": ".*"}
# The series graphserve exports; the rules' own recorded series are graphserve:..., not matched.
METRIC = re.compile(r"\b(vllm:[a-z0-9_:]+|graphserve_[a-z0-9_]+)")


def rule_groups() -> list[dict]:
    return yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())["spec"]["groups"]


def dashboard() -> dict:
    return json.loads((MONITORING / "grafana-dashboard.json").read_text())


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, expression with Grafana's variables filled in) of every panel target."""
    found = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in DASHBOARD_VARIABLES.items():
                expr = expr.replace(name, value)
            found.append((panel["title"], expr))
    return found


def dashboard_as_rule_groups() -> list[dict]:
    """The dashboard's expressions as recording rules, so that promtool parses them."""
    rules = [{"record": f"dashboard:panel_{i}", "expr": expr} for i, (_, expr) in enumerate(dashboard_expressions())]
    return [{"name": "dashboard", "rules": rules}]


def metric_names() -> set[str]:
    """Every metric the alerts and the dashboard query (not the rules' own recorded series)."""
    exprs = [r["expr"] for g in rule_groups() for r in g["rules"]] + [e for _, e in dashboard_expressions()]
    return {m for expr in exprs for m in METRIC.findall(expr)}


def promtool() -> str:
    """promtool, or a skip where it is not installed (a failure under CI, which installs it)."""
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is not installed: .ci/run installs the Debian package prometheus")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return path


def check_rules(groups: list[dict], tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
