"""The real smg's cache-aware policy against three graphserve replicas: smg subscribes to each replica's
KV events, and a conversation that returns goes to the replica that holds its prefix."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import openai
import pytest

from service.proto import inference_pb2 as pb
from tests.integration.test_gateway import MODEL, client, graphserve_text, replicas_behind_smg, tokenizer
from tests.integration.test_vllm_metrics import scrape, vllm
from tests.support.gateway import Gateway, find_smg
from tests.support.process import ServerProcess

pytestmark = pytest.mark.skipif(find_smg() is None, reason="smg is not installed (the dev extra has it)")

REPLICAS = 3
SYSTEM = [f"Rule {i}: answer briefly, cite the manual, section {i * 7 % 13}, and never guess." for i in range(3)]


@pytest.fixture(scope="module")
def fleet(model_cache_dir, tmp_path_factory) -> Iterator[tuple[list[ServerProcess], Gateway]]:  # noqa: ANN001
    with replicas_behind_smg(REPLICAS, model_cache_dir, tmp_path_factory.mktemp("kv-fleet"), "kv", "cache_aware") as pair:
        yield pair


def hits(replica: ServerProcess) -> float:
    _, samples = scrape(replica.metrics_port)
    return vllm(samples, "vllm:prefix_cache_hits_total")


def finished(replica: ServerProcess) -> float:
    _, samples = scrape(replica.metrics_port)
    return sum(value for (name, _), value in samples.items() if name == "vllm:request_success_total")


def test_smg_subscribes_to_every_replica_and_routes_a_returning_prefix_to_its_holder(fleet) -> None:  # noqa: ANN001
    replicas, gateway = fleet
    deadline = time.monotonic() + 30
    while not all('"kv_events_subscribed"' in r.log_text() for r in replicas):
        assert time.monotonic() < deadline, "smg did not subscribe to every replica's KV events"
        time.sleep(0.2)
    assert smg_log(gateway).count("KV event relay snapshot applied") == REPLICAS  # the first batch: the state now
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


def test_each_returning_tenant_lands_on_the_one_replica_that_holds_its_system_prompt(fleet) -> None:  # noqa: ANN001
    """Tenant i's system prompt is computed on replica i alone (graphserve.v1, past smg); then each
    tenant sends FOLLOW_UPS chat completions through smg, one at a time, and every one must finish on
    its holder. Not by chance: round robin sends FOLLOW_UPS >= 2 consecutive requests to different
    replicas (at most ceil(4/3) = 2 of 4 on one), so it fails every tenant; a policy blind to the KV
    events (smg's own routing history knows nothing of the seeded prompts, and with no match it picks
    one replica for all) fails the tenants seeded on the other replicas; uniform random routing passes
    with probability 3^-12."""
    replicas, gateway = fleet
    tok = tokenizer(replicas[0])
    tenants = [f"Tenant {i} policy: refunds within {10 + i} days, reply in {('English', 'French', 'Dutch')[i]}, "
               f"cite clause {i * 5 + 3} of the contract. " * 5 for i in range(REPLICAS)]
    for holder, system in zip(replicas, tenants, strict=True):
        ids = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": "seed"}],
                                      add_generation_prompt=True, tokenize=True)
        ids = list(ids if isinstance(ids, list) else ids["input_ids"])
        graphserve_text(holder, 1, token_ids=pb.TokenIds(ids=ids))
    time.sleep(1.0)  # the stored blocks reach smg as events
    oai: openai.OpenAI = client(gateway)
    placed = []
    for system in tenants:
        before = [finished(r) for r in replicas]
        for turn in range(FOLLOW_UPS):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"follow-up {turn}"}]
            oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
        placed.append([int(finished(r) - b) for r, b in zip(replicas, before, strict=True)])
    expected = [[FOLLOW_UPS if j == i else 0 for j in range(REPLICAS)] for i in range(REPLICAS)]
    assert placed == expected, f"requests per replica, one row per tenant (tenant i seeded on replica i): {placed}"


FOLLOW_UPS = 4
