"""Rollouts mode through the real serving tier (vLLM engine, HTTP API, Kafka event log).

The learner samples G completions per prompt with `POST /v1/completions` (`model=<tenant>`, `n=G`, the
tenant's key), trains, publishes; the serving tier hot-swaps each published version, so later rollouts
come from the learner's own newer adapters, and it logs every rollout as an interaction event.
"""

from __future__ import annotations

from urllib.parse import urlparse

import pytest

from learner.loop import Learner, run
from learner.rollouts import ServingSampler, render_user_prompt
from learner_support import make_config
from storage.parquet import read_dataset
from storage.registry import Registry

from serving_process import read_events

pytestmark = pytest.mark.integration

TENANT = "lab"  # a tenant of the session server that no other test uses
STEPS = 4


class RecordingSampler:
    """The real ServingSampler, keeping what it returned (for the assertions)."""

    background = True

    def __init__(self, inner: ServingSampler):
        self.inner = inner
        self.results = []

    def sample(self, requests):
        out = self.inner.sample(requests)
        self.results.append((list(requests), out))
        return out

    def close(self):
        self.inner.close()


def test_rollouts_sample_through_serving_and_use_the_published_adapters(server, tiny_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Write a number.\nTell me about cats.\nhello\nWhat is 2 + 2?\n")
    url = urlparse(server.base_url)
    cfg = make_config(
        server.data_dir,
        tiny_model,
        [{"name": TENANT, "api_key": server.keys[TENANT], "mode": "rollouts", "scorer": "uppercase",
          "prompts_file": str(prompts), "batch_size": 8, "group_size": 4, "learning_rate": 1e-2}],
        rollout_sampler="serving",
        max_new_tokens=12,
        gate_prompts=2,
        gate_max_kl=50.0,
        gate_reward_tolerance=1.0,
    )
    cfg = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"host": url.hostname, "port": url.port})})
    sampler = RecordingSampler(ServingSampler(server.base_url))
    learner = Learner(cfg, model_path=tiny_model, sampler=sampler, progress=False)
    run(cfg, model_path=tiny_model, learner=learner, max_steps=STEPS)

    rows = sorted(read_dataset(server.data_dir, "train_steps", tenant=TENANT).to_pylist(), key=lambda r: r["step"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["mode"] == "rollouts" and r["n_trajectories"] == 8 for r in rows)
    latest = Registry(server.data_dir).latest_published(TENANT)
    assert latest is not None, [(v.name, v.status, v.reason, v.gate) for v in Registry(server.data_dir).versions(TENANT)]
    server.wait_for_version(TENANT, latest.name)  # the serving tier hot-swapped the learner's adapter

    rendered = {render_user_prompt(learner.policy.tokenizer, line) for line in prompts.read_text().split("\n") if line}
    samples = [s for requests, out in sampler.results for group in out for s in group]
    assert all(len(group) == 4 for _, out in sampler.results for group in out)  # n = group_size
    assert all(r.prompt in rendered and r.n == 4 and r.tenant == TENANT for requests, _ in sampler.results for r in requests)
    versions = {s.version for s in samples}
    assert None in versions  # the first rollouts came from the base model
    assert any(v and v.startswith(f"{TENANT}@") for v in versions), versions  # later ones from published adapters

    # the serving tier logged the rollouts as interactions of the tenant, under the ids the learner remembers
    ids = {s.interaction_id for s in samples[:8]}
    assert None not in ids
    events = read_events(server.bootstrap, cfg.kafka.interactions_topic, ids)
    assert set(events) == ids
    assert all(e["tenant"] == TENANT and e["prompt"] in rendered for e in events.values())
    # the learner trains on the tokens the engine sampled, with their sampled log-probs (not the text re-tokenised)
    by_id = {s.interaction_id: s for s in samples[:8]}
    for i, e in events.items():
        sample = by_id[i]
        assert sample.token_ids is not None and list(sample.token_ids) == e["completion_token_ids"]
        assert sample.logprobs is not None and len(sample.logprobs) == len(sample.token_ids)
        assert list(sample.logprobs) == pytest.approx(e["completion_logprobs"], abs=1e-6)
    # every trained rollout is remembered (no ingest runs here, so none has come back as a trajectory yet)
    remembered = set(learner.tenants[TENANT].rollout_ids)
    assert len(remembered) == STEPS * 8 and remembered <= {s.interaction_id for s in samples}
