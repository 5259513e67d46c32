"""The dashboard and the alerts of k8s/monitoring query only series a real server exports: every
metric name they use is in a scrape of one that served a request."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.support.monitoring import metric_names
from tests.support.server import generate, greedy

SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def test_every_metric_the_kit_queries_is_exported(server) -> None:  # noqa: ANN001
    generate(server.stub(), **greedy("fill the histograms", 4))
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.app.metrics_port}/metrics", timeout=10).read().decode()
    families, samples = set(), set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        samples |= {s.name for s in family.samples}

    def exported(name: str) -> bool:
        base = next((name.removesuffix(s) for s in SUFFIXES if name.endswith(s)), name)
        return name in samples or name in families or base in families

    used = metric_names()
    assert len(used) > 20
    assert sorted(n for n in used if not exported(n)) == []
