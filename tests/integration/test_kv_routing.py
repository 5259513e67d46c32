"""The real smg's cache-aware policy against graphserve replicas: smg subscribes to each replica's KV
events, and a conversation that returns goes to the replica that holds its prefix."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import openai
import pytest

from tests.integration.test_gateway import MODEL, client, replicas_behind_smg
from tests.integration.test_vllm_metrics import scrape, vllm
from tests.support.gateway import Gateway, find_smg
from tests.support.process import ServerProcess

pytestmark = pytest.mark.skipif(find_smg() is None, reason="smg is not installed (the dev extra has it)")

SYSTEM = [f"Rule {i}: answer briefly, cite the manual, section {i * 7 % 13}, and never guess." for i in range(3)]


@pytest.fixture(scope="module")
def fleet(model_cache_dir, tmp_path_factory) -> Iterator[tuple[list[ServerProcess], Gateway]]:  # noqa: ANN001
    with replicas_behind_smg(2, model_cache_dir, tmp_path_factory.mktemp("kv-fleet"), "kv", "cache_aware") as pair:
        yield pair


def hits(replica: ServerProcess) -> float:
    _, samples = scrape(replica.metrics_port)
    return vllm(samples, "vllm:prefix_cache_hits_total")


def test_smg_subscribes_to_every_replica_and_routes_a_returning_prefix_to_its_holder(fleet) -> None:  # noqa: ANN001
    replicas, gateway = fleet
    deadline = time.monotonic() + 30
    while not all('"kv_events_subscribed"' in r.log_text() for r in replicas):
        assert time.monotonic() < deadline, "smg did not subscribe to every replica's KV events"
        time.sleep(0.2)
    assert smg_log(gateway).count("KV event relay snapshot applied") == 2  # the first batch: the state now
    oai: openai.OpenAI = client(gateway)
    for system in SYSTEM:
        before = [hits(r) for r in replicas]
        for turn in range(4):  # the same long system prompt, a new question each turn
            messages = [{"role": "system", "content": system * 12}, {"role": "user", "content": f"question {turn}"}]
            oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
            time.sleep(0.3)  # the stored blocks reach smg as events
        gained = [hits(r) - b for r, b in zip(replicas, before, strict=True)]
        # Every returning turn found the prefix: all on the replica that computed it.
        assert min(gained) == 0 and max(gained) > 0, gained
    assert re.search(r"Learned block_size from KV event .*block_size=16", smg_log(gateway))


def smg_log(gateway: Gateway) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", gateway.log_text())
