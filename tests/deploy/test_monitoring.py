"""k8s/monitoring, checked without a cluster: the manifests render, the PodMonitor scrapes the pods'
metrics port, and promtool parses every alerting rule and every dashboard expression. That they name
only series a server exports is tests/integration/test_monitoring_kit.py."""

from __future__ import annotations

import kubernetes_validate
import yaml

from tests.deploy.k8s_render import render
from tests.deploy.test_k8s_manifests import KUBERNETES_VERSIONS, container, pod_labels
from tests.support.monitoring import check_rules, dashboard, dashboard_as_rule_groups, rule_groups

ALERTS = {"GraphserveEngineStalled", "GraphserveKVCacheExhausted", "GraphservePreemptionStorm",
          "GraphserveTTFTBudgetBurnFast", "GraphserveTTFTBudgetBurnSlow", "GraphserveGraphBudgetPressure",
          "GraphserveAdminAuthFailures"}


def test_the_kit_renders_and_the_pod_monitor_scrapes_the_metrics_port(kubectl, rendered) -> None:  # noqa: ANN001
    docs = [d for d in yaml.safe_load_all(render(kubectl, "monitoring")) if d]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"ConfigMap", "PodMonitor", "PrometheusRule"}
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(kinds["ConfigMap"], version, strict=True)
    assert kinds["ConfigMap"]["metadata"]["labels"]["grafana_dashboard"] == "1"
    monitor = kinds["PodMonitor"]["spec"]
    for overlay in ("overlays/gpu", "overlays/cpu-dev"):
        assert monitor["selector"]["matchLabels"].items() <= pod_labels(rendered[overlay]).items()
        ports = {p["name"]: p["containerPort"] for p in container(rendered[overlay])["ports"]}
        [endpoint] = monitor["podMetricsEndpoints"]
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics"


def test_promtool_accepts_every_alerting_rule(tmp_path) -> None:  # noqa: ANN001
    done = check_rules(rule_groups(), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    alerts = {r["alert"] for g in rule_groups() for r in g["rules"] if "alert" in r}
    assert alerts == ALERTS
    for group in rule_groups():
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["labels"]["severity"] in ("critical", "warning")
                assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_promtool_accepts_every_dashboard_expression(tmp_path) -> None:  # noqa: ANN001
    done = check_rules(dashboard_as_rule_groups(), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    titles = {p["title"] for p in dashboard()["panels"]}
    for needed in ("Time to first token", "Time per output token (inter-token latency)", "Tokens per second",
                   "Running and waiting requests", "KV cache usage", "Prefix cache hit rate and preemptions",
                   "Graph hit rate", "Graph memory", "Captures, evictions, failures", "Graph buckets by state",
                   "Stream gaps (time between token-delivering steps)"):
        assert needed in titles
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))
