"""learner/loop.py in-process on the tiny model: logs mode on real Parquet trajectories, the gate on
poisoned batches, staleness, recovery from interrupted steps, rollbacks, new tenants, per-tenant errors,
and rollouts mode with the learner's own sampler."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from learner.loop import ABANDONED, Learner, run
from learner.policy import ADAPTER_WEIGHTS
from learner.rollouts import SamplingError
from learner.types import TenantSpec
from learner_support import LEARNABLE_TARGETS, assert_each_id_once, chat_prompt, make_config, rows, step_ids, write
from storage.cursors import Cursors
from storage.parquet import read_dataset
from storage.registry import Registry

pytestmark = pytest.mark.unit

# The metadata clora's serving tier logs with an interaction the base model answered (adapter_version null).
BASE_SERVED = {"served_by": "tiny", "endpoint": "chat", "latency_ms": 5.0, "usage": {}, "sampling": {}}


def learn(cfg, model, **kw):
    kw.setdefault("until_idle", True)
    return run(cfg, model_path=model, progress=False, **kw)


# ---------------------------------------------------------------------------------------------------------


def test_logs_mode_trains_every_trajectory_once_and_publishes_a_lineage(tiny_model, data_dir):
    write(data_dir, "acme", rows("a", 40), "b0")
    write(data_dir, "beta", rows("b", 20, seed=1), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 16}, {"name": "beta", "batch_size": 8}])
    learner = learn(cfg, tiny_model)

    assert_each_id_once(data_dir, "acme", {f"a{i}" for i in range(40)})
    assert_each_id_once(data_dir, "beta", {f"b{i}" for i in range(20)})
    reg = Registry(data_dir)
    acme = reg.versions("acme")
    assert [(v.number, v.status, v.parent) for v in acme] == [(1, "published", None), (2, "published", "acme@1"), (3, "published", "acme@2")]
    assert acme[0].metrics["n_trajectories"] == 16 and acme[2].metrics["n_trajectories"] == 8
    assert acme[0].gate["kl"] >= 0 and acme[0].trajectory_range["n"] == 16
    assert reg.latest_published("beta").number == 3  # 20 rows in batches of 8: 8, 8, 4

    steps = read_dataset(data_dir, "train_steps").to_pylist()
    acme_rows = sorted((r for r in steps if r["tenant"] == "acme"), key=lambda r: r["step"])
    assert [r["step"] for r in acme_rows] == [1, 2, 3]
    assert [r["version"] for r in acme_rows] == [None, "acme@1", "acme@2"]  # the version each step started from
    assert [r["n_trajectories"] for r in acme_rows] == [16, 16, 8]
    for r in acme_rows:
        assert r["mode"] == "logs" and r["tokens"] > 0 and r["seconds"] > 0
        assert all(math.isfinite(r[k]) for k in ("reward_mean", "loss", "kl", "clip_frac"))
    assert learner.tenants["acme"].version == 3
    status = json.loads((Path(data_dir) / "state" / "learner" / "status.json").read_text())
    assert status["acme"]["version"] == "acme@3" and status["acme"]["error"] is None


@pytest.mark.parametrize("epochs", [1, 3])
def test_update_epochs_reach_the_update(tiny_model, tmp_path, epochs):
    """learner.update_epochs: the same batch trained once, or three times under a tight clip around where the
    step began (which then cuts tokens: clip_frac > 0 in the step's row, 0 on one epoch of fresh samples)."""
    data_dir = tmp_path / "data"
    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}], update_epochs=epochs, clip_eps=1e-3)
    learn(cfg, tiny_model)
    (step,) = read_dataset(data_dir, "train_steps").to_pylist()
    assert (step["clip_frac"] > 0) == (epochs > 1) and step["n_trajectories"] == 8


def test_published_adapter_equals_the_learners_and_loads_in_peft(tiny_model, data_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8, "learning_rate": 1e-3}])
    learner = learn(cfg, tiny_model)
    v = Registry(data_dir).latest_published("acme")
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), v.path)
    ids = learner.policy.tokenizer(chat_prompt("hi") + "hello there", return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
        learner.policy.use("acme")
        ours = learner.policy.model(input_ids=ids).logits
    assert torch.allclose(theirs, ours, atol=1e-4)


@pytest.mark.parametrize("poison", [math.nan])  # a finite reward out of range is left out before training (below)
def test_a_poisoned_batch_is_rejected_never_published_and_learning_continues_from_the_parent(tiny_model, data_dir, poison):
    write(data_dir, "acme", rows("good", 8), "b0", start=0)
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = learn(cfg, tiny_model)
    parent = Registry(data_dir).latest_published("acme")
    assert parent.number == 1
    probe = learner.policy.tokenizer(chat_prompt("x") + "12 cats", return_tensors="pt").input_ids
    learner.policy.use("acme")
    with torch.no_grad():
        parent_logits = learner.policy.model(input_ids=probe).logits.clone()

    poisoned = rows("bad", 8, seed=3)
    poisoned[3]["reward"] = poison
    write(data_dir, "acme", poisoned, "b1", start=100)
    learner = learn(cfg, tiny_model, learner=learner)
    reg = Registry(data_dir)
    rejected = reg.get("acme", 2)
    assert rejected.status == "rejected" and "poisoned batch" in rejected.reason
    assert reg.latest_published("acme").number == 1
    learner.policy.use("acme")
    with torch.no_grad():
        assert torch.equal(learner.policy.model(input_ids=probe).logits, parent_logits)  # back to the parent
    assert_each_id_once(data_dir, "acme", {f"good{i}" for i in range(8)} | {f"bad{i}" for i in range(8)})  # not retried

    write(data_dir, "acme", rows("more", 8, seed=4), "b2", start=200)
    learn(cfg, tiny_model, learner=learner)
    latest = Registry(data_dir).latest_published("acme")
    assert latest.number == 3 and latest.parent == "acme@1"  # the rejected candidate is no one's parent
    poisoned_row = next(r for r in read_dataset(data_dir, "train_steps").to_pylist() if r["step"] == 2)
    if math.isnan(poison):
        assert poisoned_row["loss"] is None  # NaN is stored as null


def test_a_reward_out_of_range_is_left_out_before_training_and_the_rest_of_the_batch_trains(tiny_model, data_dir,
                                                                                              caplog):
    """Ingest takes any finite inline reward; the gate rejects a batch holding one beyond gate_max_abs_reward.
    Left in, one such row cost the batch a training pass and then the batch itself (committed as trained)."""
    batch = rows("a", 8)
    batch[2]["reward"], batch[5]["reward"] = 1e12, -150.0
    batch[6]["reward"] = 100.0  # the limit itself is in range
    write(data_dir, "acme", batch, "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}], gate_max_abs_reward=100.0)
    with caplog.at_level("WARNING", logger="learner.loop"):
        learn(cfg, tiny_model)
    (v,) = Registry(data_dir).versions("acme")
    assert v.status == "published" and v.gate["reward_max"] == 100.0
    assert v.metrics["n_trajectories"] == 6 and v.metrics["n_dropped"] == 2
    (step,) = read_dataset(data_dir, "train_steps").to_pylist()
    assert step["n_trajectories"] == 6 and step["n_dropped"] == 2
    assert_each_id_once(data_dir, "acme", {f"a{i}" for i in range(8)})  # the two are committed, never retried
    (warning,) = [r.getMessage() for r in caplog.records if "out of range" in r.getMessage()]
    assert "2 of 8" in warning and "1e+12" in warning


def test_a_tenants_own_gate_max_kl_overrides_the_learners(tiny_model, data_dir):
    """tenants[].gate_max_kl: the same update passes the learner's limit for one tenant and fails a tenant's
    own tighter limit for the other; each version records the limit it was judged by."""
    for tenant in ("loose", "tight"):
        write(data_dir, tenant, rows(tenant, 8), f"{tenant}0")
    cfg = make_config(data_dir, tiny_model, [{"name": "loose", "batch_size": 8},
                                             {"name": "tight", "batch_size": 8, "gate_max_kl": 1e-9}])
    learn(cfg, tiny_model)
    reg = Registry(data_dir)
    loose, tight = reg.get("loose", 1), reg.get("tight", 1)
    assert loose.status == "published" and loose.gate["limit_max_kl"] == cfg.learner.gate_max_kl
    assert tight.status == "rejected" and "exceeds gate_max_kl 1e-09" in tight.reason
    assert tight.gate["limit_max_kl"] == 1e-9


def test_stale_and_foreign_trajectories_are_dropped_but_committed(tiny_model, data_dir):
    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}], max_staleness=0)
    learner = learn(cfg, tiny_model)  # -> acme@1
    batch = (rows("fresh", 3, adapter_version="acme@1") + rows("old", 3, adapter_version=None, metadata=BASE_SERVED)
             + rows("other", 2, adapter_version="beta@1"))
    write(data_dir, "acme", batch, "b1", start=100)
    learn(cfg, tiny_model, learner=learner)
    v2 = Registry(data_dir).get("acme", 2)
    assert v2.metrics["n_trajectories"] == 3 and v2.metrics["n_dropped"] == 5
    assert Cursors(data_dir).backlog()["acme"] == 0


def test_rejected_candidates_do_not_age_the_samples_of_the_version_they_came_from(tiny_model, data_dir):
    """Staleness counts served versions: after two rejected steps and a published one, samples of the
    published parent are one version behind, not three (max_staleness 1 keeps them)."""
    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}], max_staleness=1)
    learner = learn(cfg, tiny_model)  # -> acme@1
    for k in range(2):  # acme@2, acme@3: poisoned batches, rejected
        poisoned = rows(f"bad{k}", 8, seed=k + 1)
        poisoned[0]["reward"] = math.nan
        write(data_dir, "acme", poisoned, f"p{k}", start=100 * (k + 1))
        learn(cfg, tiny_model, learner=learner)
    write(data_dir, "acme", rows("good", 8, seed=5), "g", start=400)
    learn(cfg, tiny_model, learner=learner)  # -> acme@4, parent acme@1
    reg = Registry(data_dir)
    assert [v.status for v in reg.versions("acme")] == ["published", "rejected", "rejected", "published"]
    write(data_dir, "acme", rows("from1", 8, seed=6, adapter_version="acme@1"), "f", start=500)
    learn(cfg, tiny_model, learner=learner)
    v5 = reg.get("acme", 5)
    assert v5.metrics["n_trajectories"] == 8 and v5.metrics["n_dropped"] == 0


def test_every_trajectory_stale_is_a_skipped_step_not_an_error(tiny_model, data_dir):
    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}], max_staleness=0)
    learner = learn(cfg, tiny_model)  # -> acme@1
    write(data_dir, "acme", rows("old", 6, adapter_version=None, metadata=BASE_SERVED), "b1", start=100)
    learn(cfg, tiny_model, learner=learner)
    assert [v.number for v in Registry(data_dir).versions("acme")] == [1]
    assert learner.tenants["acme"].error is None
    assert_each_id_once(data_dir, "acme", {f"a{i}" for i in range(8)} | {f"old{i}" for i in range(6)})
    # no version holds its counts in its metrics: the step's row does
    rows_ = sorted(read_dataset(data_dir, "train_steps").to_pylist(), key=lambda r: r["step"])
    assert [(r["n_trajectories"], r["n_dropped"], r["n_score_failed"]) for r in rows_] == [(8, 0, 0), (0, 6, 0)]


def test_a_flat_batch_trains_nothing_but_moves_the_baseline(tiny_model, data_dir):
    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = learn(cfg, tiny_model)  # -> acme@1
    before = learner.tenants["acme"].baseline
    write(data_dir, "acme", rows("zero", 8, reward=0.0), "b1", start=100)
    learn(cfg, tiny_model, learner=learner)
    assert [v.number for v in Registry(data_dir).versions("acme")] == [1]  # no version from a flat batch
    assert learner.tenants["acme"].baseline == pytest.approx(0.9 * before)  # EMA with a batch mean of 0
    assert_each_id_once(data_dir, "acme", {f"a{i}" for i in range(8)} | {f"zero{i}" for i in range(8)})
    flat_row = max(read_dataset(data_dir, "train_steps").to_pylist(), key=lambda r: r["step"])
    assert (flat_row["reward_mean"], flat_row["n_trajectories"], flat_row["loss"]) == (0.0, 0, None)

    # switched off, a flat batch is trained all the same (its advantages are all 0) and makes a version
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}], skip_flat_batches=False)
    write(data_dir, "acme", rows("zero2-", 8, reward=0.0), "b2", start=200)
    learn(cfg, tiny_model)  # a fresh learner with that config, resuming from storage
    assert Registry(data_dir).latest_published("acme").number == 2


def test_a_batch_flat_within_each_prompt_trains_nothing_though_its_rewards_differ(tiny_model, data_dir):
    """Each prompt twice, its answers scored alike, prompts scored apart: every advantage is 0 (leave-one-out
    within the prompt), yet not every reward is equal. It made a version moved only by Adam's momentum."""
    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = learn(cfg, tiny_model)  # -> acme@1, and Adam has momentum
    weights = [p.detach().clone() for p in learner.policy.trainable("acme")]
    # Two prompts, three answers each, scored 0.7 and 0.3: leave-one-out advantages of ~1e-16, not 0.
    grouped = [{**r, "prompt": chat_prompt(f"ask {i % 2}"), "reward": (0.7, 0.3)[i % 2]}
               for i, r in enumerate(rows("g", 6, seed=3))]
    write(data_dir, "acme", grouped, "b1", start=100)
    learn(cfg, tiny_model, learner=learner)
    assert [v.number for v in Registry(data_dir).versions("acme")] == [1]
    assert all(torch.equal(w, p) for w, p in zip(weights, learner.policy.trainable("acme")))
    row = max(read_dataset(data_dir, "train_steps").to_pylist(), key=lambda r: r["step"])
    assert (row["reward_mean"], row["n_trajectories"], row["loss"]) == (pytest.approx(0.5), 0, None)
    assert_each_id_once(data_dir, "acme", {f"a{i}" for i in range(8)} | {f"g{i}" for i in range(6)})


def test_a_backlog_of_several_batches_trains_in_catch_up_steps(tiny_model, data_dir):
    write(data_dir, "acme", rows("a", 44), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}], catch_up=4)
    learn(cfg, tiny_model)
    # 44 waiting in batches of 8, at most 4 batches a step: 32, then the 12 left (one and a half batches)
    assert [len(ids) for ids in step_ids(data_dir, "acme")] == [32, 12]
    assert step_ids(data_dir, "acme")[0] == [f"a{i}" for i in range(32)]  # oldest first
    versions = Registry(data_dir).versions("acme")
    assert [(v.status, v.metrics["n_trajectories"]) for v in versions] == [("published", 32), ("published", 12)]
    assert_each_id_once(data_dir, "acme", {f"a{i}" for i in range(44)})


def test_a_catch_up_step_in_micro_batches_equals_one_step_on_the_whole_batch(tiny_model):
    from learner import logs_mode
    from learner.policy import Policy
    from learner_support import trajectories

    after = []
    for micro in (None, 4):  # 12 examples at once, then in micro-batches of 4, from the same fresh adapter
        policy = Policy(tiny_model, device="cpu", seed=0)
        policy.add_tenant(TenantSpec.default("acme"))
        examples, unusable = logs_mode.to_examples(trajectories("acme", rows("a", 12)), policy.tokenizer)
        assert len(examples) == 12 and not unusable
        for _ in range(2):  # the second step moves lora_A too (lora_B starts at 0, so A's first gradient is 0)
            logs_mode.train_step(policy, "acme", examples, baseline=None, clip_eps=0.2, kl_coef=0.0,
                                 max_grad_norm=1.0, max_len=256, micro_batch_size=micro, current_version=0)
        after.append(policy.snapshot("acme").weights)
    whole, micro = after
    assert whole.keys() == micro.keys()
    assert any(float(w.abs().max()) > 0 for k, w in whole.items() if "lora_B" in k)  # it did train
    for key in whole:
        # An Adam step here is lr = 1e-3 a weight, and leaving one example out moves weights by ~4e-3. Float
        # rounding differs between batch shapes, and Adam's normalisation magnifies it where a gradient is
        # near 0: up to ~5e-5 on this data and others like it (atol 1e-5 held for some draws of rows only).
        torch.testing.assert_close(micro[key], whole[key], rtol=1e-3, atol=2e-4)


def test_a_partial_logs_batch_waits_for_batch_size_or_batch_wait_seconds(tiny_model, data_dir):
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}], batch_wait_seconds=0.5)
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    try:
        write(data_dir, "acme", rows("a", 3), "b0")
        assert learner.pending()["acme"] == 0  # 3 of 8: held
        assert learner.pending(hold_partial=False)["acme"] == 3  # --once / --until-idle take what is there
        write(data_dir, "acme", rows("b", 5, seed=1), "b1", start=3)
        assert learner.pending()["acme"] == 8  # a full batch goes at once
        write(data_dir, "acme", rows("c", 2, seed=2), "b2", start=8)
        assert learner.step_safely("acme").decision == "published"  # trains the oldest 8
        assert learner.pending()["acme"] == 0  # the 2 left over start a wait of their own
        time.sleep(0.6)
        assert learner.pending()["acme"] == 2  # waited batch_wait_seconds: trained as they are
        assert learner.step_safely("acme").row["n_trajectories"] == 2
    finally:
        learner.close()
    assert step_ids(data_dir, "acme") == [[f"a{i}" for i in range(3)] + [f"b{i}" for i in range(5)], ["c0", "c1"]]


def test_a_candidate_created_before_a_crash_is_abandoned_and_its_batch_retrained(tiny_model, data_dir, monkeypatch):
    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # what a SIGKILL between create and commit leaves behind

    monkeypatch.setattr(Cursors, "commit", crash)
    with pytest.raises(KeyboardInterrupt):
        learn(cfg, tiny_model)
    monkeypatch.undo()
    assert Registry(data_dir).get("acme", 1).status == "candidate"

    learn(cfg, tiny_model)  # a fresh process
    reg = Registry(data_dir)
    assert reg.get("acme", 1).status == "rejected" and reg.get("acme", 1).reason == ABANDONED
    assert reg.get("acme", 2).status == "published" and reg.get("acme", 2).parent is None
    assert_each_id_once(data_dir, "acme", {f"a{i}" for i in range(8)})


def test_a_step_committed_before_a_crash_is_published_on_restart(tiny_model, data_dir, monkeypatch):
    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # a SIGKILL right after the commit

    monkeypatch.setattr(Registry, "publish", crash)
    with pytest.raises(KeyboardInterrupt):
        learn(cfg, tiny_model)
    monkeypatch.undo()
    assert Registry(data_dir).get("acme", 1).status == "candidate"
    assert read_dataset(data_dir, "train_steps").num_rows == 0

    learner = learn(cfg, tiny_model)  # nothing new to train, but the interrupted step is completed
    assert Registry(data_dir).get("acme", 1).status == "published"
    assert read_dataset(data_dir, "train_steps").column("step").to_pylist() == [1]
    assert learner.tenants["acme"].step == 1 and learner.tenants["acme"].version == 1
    assert_each_id_once(data_dir, "acme", {f"a{i}" for i in range(8)})


def test_a_commit_that_fails_after_its_commit_point_counts_as_committed(tiny_model, data_dir, monkeypatch):
    """The step directory's rename is the commit point; an error after it (the directory fsync, pruning)
    must not reject the committed step's candidate nor leave the learner a step behind its cursor."""
    import storage.cursors as cursors_module

    write(data_dir, "acme", rows("a", 16), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    real = cursors_module.publish_dir

    def rename_then_fail(staging, final):
        real(staging, final)
        raise OSError(5, "Input/output error")  # e.g. the fsync of the directory after the rename

    monkeypatch.setattr(cursors_module, "publish_dir", rename_then_fail)
    learner = learn(cfg, tiny_model)
    reg = Registry(data_dir)
    assert [(v.number, v.status) for v in reg.versions("acme")] == [(1, "published"), (2, "published")]
    assert learner.tenants["acme"].step == 2 and learner.tenants["acme"].error is None
    assert read_dataset(data_dir, "train_steps").column("step").to_pylist() == [1, 2]
    assert_each_id_once(data_dir, "acme", {f"a{i}" for i in range(16)})


def test_a_step_whose_commit_may_not_be_durable_is_published_only_once_its_directory_is_synced(
        tiny_model, data_dir, monkeypatch):
    """The commit's rename done and its directory's fsync failed, the step was taken as committed and its
    version published at once: after a power loss the version would be served and the step gone, and the
    batch trained again on top of it. Now the version waits until the cursor directory syncs."""
    import storage.cursors as cursors_module

    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    learner.pending(hold_partial=False)

    def failing_fsync(directory):
        raise OSError(5, "Input/output error")

    def rename_then_fail(staging, final):
        os.rename(staging, final)
        failing_fsync(final.parent)

    monkeypatch.setattr(cursors_module, "publish_dir", rename_then_fail)
    monkeypatch.setattr(cursors_module, "fsync_dir", failing_fsync)
    assert learner.step_safely("acme") is None
    reg = Registry(data_dir)
    assert reg.get("acme", 1).status == "candidate" and "Input/output error" in learner.tenants["acme"].error
    monkeypatch.undo()  # the disk is well again
    learner.tenants["acme"].retry_at = 0
    learner.step_safely("acme")
    assert [(v.number, v.status) for v in reg.versions("acme")] == [(1, "published")]
    assert read_dataset(data_dir, "train_steps").column("step").to_pylist() == [1]
    learner.close()


def test_a_version_whose_create_raised_after_its_record_is_rejected_not_left_a_candidate(tiny_model, data_dir,
                                                                                          monkeypatch):
    """Registry.create wrote the version's record, then its HEAD.json rewrite failed (a full disk): the
    candidate stayed one, referenced by no commit, until the learner was restarted."""
    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    learner.pending(hold_partial=False)
    real_create = Registry.create

    def create_then_fail(self, *a, **kw):
        real_create(self, *a, **kw)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Registry, "create", create_then_fail)
    assert learner.step_safely("acme") is None
    monkeypatch.undo()
    acme = learner.tenants["acme"]
    assert acme.status == "error" and "No space left on device" in acme.error
    reg = Registry(data_dir)
    first = reg.get("acme", 1)
    assert first.status == "rejected" and first.reason == "its creation failed: OSError: [Errno 28] No space left on device"
    assert step_ids(data_dir, "acme") == []  # nothing committed: the batch is trained again
    acme.retry_at = 0
    record = learner.step_safely("acme")
    assert (record.step, record.version) == (1, "acme@2") and reg.get("acme", 2).parent is None
    learner.close()


def test_a_compaction_that_fails_does_not_fail_the_step_it_follows(tiny_model, data_dir, monkeypatch, caplog):
    """The step was committed and published, then the cursor's compaction raised: the tenant was marked
    failed and backed off, its log said "step N failed" and on_step never saw the step."""
    import learner.loop as loop

    write(data_dir, "acme", rows("a", 16), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    monkeypatch.setattr(loop, "COMPACT_EVERY_STEPS", 1)

    def full(self, tenant):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Cursors, "compact", full)
    records = []
    learner = learn(cfg, tiny_model, on_step=records.append)
    assert [(r.step, r.decision, r.version) for r in records] == [(1, "published", "acme@1"), (2, "published", "acme@2")]
    acme = learner.tenants["acme"]
    assert (acme.status, acme.error, acme.failures) == ("published", None, 0)
    warned = [r for r in caplog.records if "compacting its cursor" in r.getMessage()]
    assert len(warned) == 2 and all(r.levelname == "WARNING" for r in warned)
    assert not [r for r in caplog.records if "failed" in r.getMessage() and r.levelname == "ERROR"]


def test_a_learner_behind_its_cursor_publishes_nothing_and_catches_up_from_disk(tiny_model, data_dir):
    """An earlier failure can leave the in-memory step behind the cursor (a commit that failed after its
    commit point, then the check of it failed too). The next commit is refused before its commit point: its
    candidate must not be taken for that step's and published; the learner reloads the tenant from disk."""
    write(data_dir, "acme", rows("a", 16), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    assert learner.pending(hold_partial=False) == {"acme": 16}
    assert learner.step_safely("acme").step == 1  # acme@1
    learner.tenants["acme"].step = 0  # behind: the cursor has step 1
    assert learner.step_safely("acme") is None
    reg = Registry(data_dir)
    assert [(v.number, v.status) for v in reg.versions("acme")] == [(1, "published"), (2, "rejected")]
    assert "commit failed" in reg.get("acme", 2).reason and learner.tenants["acme"].status == "error"
    record = learner.step_safely("acme")  # from the cursor's last checkpoint
    assert (record.step, record.decision, record.version) == (2, "published", "acme@3")
    assert read_dataset(data_dir, "train_steps").column("step").to_pylist() == [1, 2]
    assert reg.get("acme", 3).parent == "acme@1"
    assert_each_id_once(data_dir, "acme", {f"a{i}" for i in range(16)})
    learner.close()


def latest_step_fails_after(monkeypatch):
    """Makes the next Cursors.latest_step call after the returned function is called raise once (the check of
    a commit's outcome failing too); returns that function."""
    real_latest, armed = Cursors.latest_step, []

    def latest_step(self, tenant):
        if armed:
            armed.pop()
            raise OSError(24, "Too many open files")
        return real_latest(self, tenant)

    monkeypatch.setattr(Cursors, "latest_step", latest_step)
    return lambda: armed.append(1)


def test_a_commit_that_raised_after_its_commit_point_and_could_not_be_checked_is_finished_not_abandoned(
        tiny_model, data_dir, monkeypatch):
    """The commit passed its commit point and raised (an fsync after the rename); reading the cursor to tell
    failed too. The step on disk is committed: its version must be published from disk, not rejected as
    abandoned by the next step's behind-the-cursor path (its batch would never reach a served version)."""
    write(data_dir, "acme", rows("a", 24), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    learner.pending(hold_partial=False)
    assert learner.step_safely("acme").version == "acme@1"
    real_commit = Cursors.commit
    fail_check = latest_step_fails_after(monkeypatch)

    def commit_then_raise(self, tenant, **kw):
        real_commit(self, tenant, **kw)
        fail_check()
        raise OSError(5, "Input/output error (after the rename)")

    monkeypatch.setattr(Cursors, "commit", commit_then_raise)
    assert learner.step_safely("acme") is None  # step 2: committed on disk, the process cannot tell
    monkeypatch.undo()
    learner.tenants["acme"].retry_at = 0
    record = learner.step_safely("acme")
    assert (record.step, record.version) == (3, "acme@3")
    reg = Registry(data_dir)
    assert [(v.number, v.status) for v in reg.versions("acme")] == [(1, "published"), (2, "published"), (3, "published")]
    assert reg.get("acme", 3).parent == "acme@2", "step 2's update reached a served version"
    assert_each_id_once(data_dir, "acme", {f"a{i}" for i in range(24)})
    learner.close()


@pytest.mark.parametrize("first", [False, True], ids=["after a step", "the first step"])
def test_a_commit_that_failed_before_its_commit_point_and_could_not_be_checked_leaves_no_candidate(
        tiny_model, data_dir, monkeypatch, first):
    """The other outcome of the same doubt: the commit had failed before its commit point. The reload that
    follows rejects that attempt's candidate, which nothing references, and the versions served are re-read;
    also at the tenant's first step, where the reload has no checkpoint to resume from."""
    write(data_dir, "acme", rows("a", 24), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    learner.pending(hold_partial=False)
    if not first:
        assert learner.step_safely("acme").version == "acme@1"
    fail_check = latest_step_fails_after(monkeypatch)

    def full(self, name, directory, meta):
        fail_check()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Learner, "_write_checkpoint", full)
    assert learner.step_safely("acme") is None
    monkeypatch.undo()
    learner.tenants["acme"].retry_at = 0
    record = learner.step_safely("acme")
    versions = [(v.number, v.status) for v in Registry(data_dir).versions("acme")]
    if first:
        assert (record.step, record.version) == (1, "acme@2")
        assert versions == [(1, "rejected"), (2, "published")], "the failed attempt's candidate was left"
        assert learner.tenants["acme"].served[-1:] == [2]
    else:
        assert (record.step, record.version) == (2, "acme@3")
        assert versions == [(1, "published"), (2, "rejected"), (3, "published")]
        assert learner.tenants["acme"].served[-2:] == [1, 3]
    learner.close()


def test_a_publish_that_failed_before_head_json_is_completed_when_the_step_is_retried(tiny_model, data_dir,
                                                                                      monkeypatch):
    """The version's record said published, HEAD.json (what serving reads) was not rewritten (a full disk):
    the retry completes it, instead of leaving an idle tenant served the old version."""
    write(data_dir, "acme", rows("a", 16), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    learner.pending(hold_partial=False)
    assert learner.step_safely("acme").version == "acme@1"
    real_publish, real_head = Registry.publish, Registry._write_head

    def publish_without_head(self, *a, **kw):
        def full(_self, tenant):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(Registry, "_write_head", full)
        try:
            return real_publish(self, *a, **kw)
        finally:
            monkeypatch.setattr(Registry, "_write_head", real_head)

    monkeypatch.setattr(Registry, "publish", publish_without_head)
    assert learner.step_safely("acme") is None
    monkeypatch.setattr(Registry, "publish", real_publish)
    reg = Registry(data_dir)
    assert reg.latest_published("acme").name == "acme@2" and reg.published()["acme"].name == "acme@1"
    learner.tenants["acme"].retry_at = 0
    learner.pending(hold_partial=False)
    learner.step_safely("acme")  # no new rows: only the unfinished step's completion
    assert reg.published()["acme"].name == "acme@2"
    learner.close()


def test_a_checkpoints_version_record_pruned_by_retention_does_not_stop_the_tenant(tiny_model, data_dir):
    """A rollback retires the checkpoint's version (keep 1), the tenant stays idle past the retention, and
    prune_registry deletes that settled record: every restart re-finishing the checkpoint raised
    VersionNotFound, and the tenant never trained again."""
    from storage.retention import prune_registry

    write(data_dir, "acme", rows("a", 16), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}], keep_versions=2)
    learn(cfg, tiny_model).close()  # acme@1, acme@2 (the checkpoint's)
    reg = Registry(data_dir, keep_last=1)
    reg.rollback("acme", 1)  # acme@3, with acme@1's weights; acme@1 and acme@2 retired
    reg.repair("acme")
    assert prune_registry(data_dir, older_than_s=86_400, now_s=time.time() + 2 * 86_400)
    assert reg.numbers("acme") == [3], "the checkpoint's acme@2 record is gone"
    write(data_dir, "acme", rows("b", 8, seed=1), "b1", start=100)
    learner = learn(cfg, tiny_model)
    assert learner.tenants["acme"].error is None and learner.tenants["acme"].step == 3
    newest = Registry(data_dir).latest_published("acme")
    assert newest.name == "acme@4" and newest.parent == "acme@3"
    learner.close()


def test_a_status_file_that_cannot_be_written_does_not_end_the_learner(tiny_model, data_dir, monkeypatch, caplog):
    import learner.loop as loop

    write(data_dir, "acme", rows("a", 16), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    learner.pending(hold_partial=False)

    def full(path, data):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(loop, "atomic_write_bytes", full)
    assert learner.step_safely("acme").version == "acme@1"
    assert learner.step_safely("acme").version == "acme@2"
    warned = [r for r in caplog.records if "status file" in r.getMessage()]
    assert len(warned) == 1, "logged once while it lasts"
    learner.close()


def test_a_rollback_during_a_step_is_not_undone_by_that_steps_version(tiny_model, data_dir, monkeypatch):
    write(data_dir, "acme", rows("a", 24), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = learn(cfg, tiny_model, max_steps=2)  # acme@1, acme@2
    real_commit = Cursors.commit

    def rollback_meanwhile(self, tenant, **kw):  # the operator, while step 3 trains from acme@2
        Registry(data_dir).rollback("acme", 1)  # acme@4 after the step's candidate acme@3
        return real_commit(self, tenant, **kw)

    monkeypatch.setattr(Cursors, "commit", rollback_meanwhile)
    learn(cfg, tiny_model, learner=learner, max_steps=1)
    monkeypatch.undo()
    reg = Registry(data_dir)
    assert reg.get("acme", 3).status == "rejected" and "superseded" in reg.get("acme", 3).reason
    assert reg.published()["acme"].name == "acme@4"  # the rollback stands
    assert learner.tenants["acme"].status == "rejected"  # what became of the step, not what the gate said
    assert learner.tenants["acme"].version == 4  # what is served, not the refused candidate acme@3
    status = json.loads((Path(data_dir) / "state" / "learner" / "status.json").read_text())
    assert status["acme"]["version"] == "acme@4"
    write(data_dir, "acme", rows("c", 8, seed=3), "b1", start=200)
    learn(cfg, tiny_model, learner=learner)
    assert Registry(data_dir).get("acme", 5).parent == "acme@4"  # and the learner went on from it


def test_samples_of_a_version_an_operator_retired_are_never_trained_even_after_the_next_publish(tiny_model, data_dir):
    """Trajectories of the withdrawn version that came late (feedback joining, ingest lag) counted as one
    version behind once the learner had published past it, and pulled the adapter back towards it."""
    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = learn(cfg, tiny_model)  # acme@1
    write(data_dir, "acme", rows("b", 8, seed=1), "b1", start=100)
    learn(cfg, tiny_model, learner=learner)  # acme@2
    Registry(data_dir).retire("acme", 2)  # the operator withdraws it
    write(data_dir, "acme", rows("c", 8, seed=2), "b2", start=200)
    learn(cfg, tiny_model, learner=learner)  # follows back to acme@1, then publishes acme@3
    assert Registry(data_dir).latest_published("acme").number == 3
    write(data_dir, "acme", rows("late", 8, seed=3, adapter_version="acme@2"), "b3", start=300)
    learn(cfg, tiny_model, learner=learner)
    last = max(read_dataset(data_dir, "train_steps").to_pylist(), key=lambda r: r["step"])
    assert last["n_dropped"] == 8 and last["n_trajectories"] == 0, last
    fresh = Learner(cfg, model_path=tiny_model, progress=False)  # a restart reads it from the records
    try:
        fresh._ensure_loaded(fresh.tenants["acme"])
        assert fresh.tenants["acme"].withdrawn == {2}
    finally:
        fresh.close()


def test_when_every_version_is_retired_the_learner_starts_again_from_a_fresh_adapter(tiny_model, data_dir):
    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = learn(cfg, tiny_model)  # acme@1
    Registry(data_dir).retire("acme", 1)  # the base model is served again
    write(data_dir, "acme", rows("b", 8, seed=1), "b1", start=100)
    learn(cfg, tiny_model, learner=learner)
    v2 = Registry(data_dir).get("acme", 2)
    assert v2.status == "published" and v2.parent is None  # not a descendant of the retired acme@1


def test_a_tenant_whose_cursor_was_deleted_numbers_its_steps_on_and_records_every_one(tiny_model, data_dir):
    """Deleting a tenant's cursor by hand trains its trajectories again from the served adapter; the new
    steps' train_steps rows are written under new step numbers, not lost to the old rows' file names."""
    write(data_dir, "acme", rows("a", 16), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learn(cfg, tiny_model)  # steps 1, 2
    shutil.rmtree(Path(data_dir) / "cursors" / "acme")
    learn(cfg, tiny_model)  # a new process: the same 16 trajectories again, as steps 3, 4
    steps = sorted(r["step"] for r in read_dataset(data_dir, "train_steps", "acme").to_pylist())
    assert steps == [1, 2, 3, 4]
    assert Cursors(data_dir).latest_step("acme") == 4
    assert Registry(data_dir).latest_published("acme").number == 4


def test_a_damaged_train_steps_file_does_not_stop_a_tenant_whose_cursor_was_deleted(tiny_model, data_dir, caplog):
    write(data_dir, "acme", rows("a", 16), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learn(cfg, tiny_model)  # steps 1, 2
    shutil.rmtree(Path(data_dir) / "cursors" / "acme")
    steps = sorted((Path(data_dir) / "train_steps" / "tenant=acme").glob("*.parquet"))
    steps[-1].write_bytes(steps[-1].read_bytes()[:40])  # step 2's row: only metrics, now unreadable
    learner = learn(cfg, tiny_model)
    assert learner.tenants["acme"].status != "error", learner.tenants["acme"].error
    assert Registry(data_dir).latest_published("acme").number == 4
    assert "left out of the largest step" in caplog.text


def test_a_head_file_left_behind_by_a_crash_does_not_mislead_the_learner(tiny_model, data_dir):
    """A crash between a publish's version record and its HEAD.json rewrite leaves HEAD behind."""
    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = learn(cfg, tiny_model)  # acme@1
    head = Path(data_dir) / "registry" / "HEAD.json"
    stale = json.loads(head.read_text())
    stale["published"] = {}  # as if acme@1's record was written and the crash came before HEAD
    head.write_text(json.dumps(stale))
    write(data_dir, "acme", rows("b", 8, seed=1), "b1", start=100)
    learn(cfg, tiny_model, learner=learner)
    v2 = Registry(data_dir).get("acme", 2)
    assert (v2.status, v2.parent) == ("published", "acme@1")


def test_a_learner_taking_a_tenant_over_repairs_the_head_a_crash_left_behind(tiny_model, data_dir):
    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learn(cfg, tiny_model)  # acme@1
    head = Path(data_dir) / "registry" / "HEAD.json"
    stale = json.loads(head.read_text())
    stale["published"] = {}  # as if acme@1's record was written and the crash came before HEAD
    head.write_text(json.dumps(stale))
    learn(cfg, tiny_model)  # a new process: nothing to train, but it takes acme over
    assert Registry(data_dir).published()["acme"].name == "acme@1", "serving reads HEAD: it must name acme@1"
    assert Registry(data_dir).generation() > stale["generation"], "so that serving's poll sees the change"


def test_after_a_rollback_the_learner_continues_from_the_served_version(tiny_model, data_dir):
    write(data_dir, "acme", rows("a", 16), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = learn(cfg, tiny_model)  # acme@1, acme@2
    rolled = Registry(data_dir).rollback("acme", 1)  # acme@3 = acme@1's files
    write(data_dir, "acme", rows("b", 8, seed=5), "b1", start=100)
    learn(cfg, tiny_model, learner=learner)
    v4 = Registry(data_dir).get("acme", 4)
    assert rolled.number == 3 and v4.parent == "acme@3" and v4.status == "published"


def test_new_tenants_from_storage_and_from_the_config_are_picked_up_without_restart(tiny_model, data_dir):
    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    cfg2 = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}, {"name": "zeta", "batch_size": 4, "lora": {"rank": 2}}])
    stop = threading.Event()
    configs = iter([cfg, cfg2])
    reloads = []

    def reload():
        reloads.append(1)
        return next(configs, cfg2)

    learner = Learner(cfg, model_path=tiny_model, progress=False)
    write(data_dir, "newco", rows("n", 5), "b0")  # ingest created this tenant: not in any config
    write(data_dir, "zeta", rows("z", 4), "b0")
    thread = threading.Thread(target=run, args=(cfg,), kwargs=dict(model_path=tiny_model, learner=learner, reload=reload, reload_seconds=0.0, stop=stop))
    thread.start()
    try:
        deadline = __import__("time").monotonic() + 120
        while __import__("time").monotonic() < deadline:
            if all(Registry(data_dir).latest_published(t) for t in ("acme", "newco", "zeta")):
                break
            stop.wait(0.2)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert reloads
    assert learner.tenants["newco"].spec.configured is False  # defaults
    assert learner.policy.spec("zeta").rank == 2  # the config's shape
    assert all(Registry(data_dir).latest_published(t) for t in ("acme", "newco", "zeta"))


def test_a_config_read_half_written_changes_no_tenant(tiny_model, data_dir):
    """A read of the file between an editor's truncation and its write parses as a config without tenants;
    acted on at once, it made every configured tenant leave the config for one read (its spec back to the
    logs-mode defaults, its sampled-ahead batches dropped). A change is acted on once two reads agree."""
    full = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8, "learning_rate": 0.01}])
    empty = make_config(data_dir, tiny_model, [])  # what the half-written file said
    renamed = make_config(data_dir, tiny_model, [{"name": "zeta", "batch_size": 4}])
    reads = iter([empty, full, full, renamed, renamed, renamed])
    stop, specs = threading.Event(), []
    learner = Learner(full, model_path=tiny_model, progress=False)

    def reload():
        specs.append(learner.tenants["acme"].spec if "acme" in learner.tenants else None)
        config = next(reads, None)
        if config is None:
            stop.set()
            return renamed
        return config

    run(full, model_path=tiny_model, learner=learner, reload=reload, reload_seconds=0.0, stop=stop)
    acme = TenantSpec.from_config(full.tenants[0])
    assert specs[:5] == [acme] * 5, "the half-written read, or a change read once, was acted on"
    assert specs[5] is None, "a change two reads agree on is acted on (acme, with nothing stored, is let go)"
    assert learner.tenants["zeta"].spec.configured is True


def test_a_tenant_removed_from_the_config_is_what_a_restart_would_make_it(tiny_model, data_dir, tmp_path):
    """A prompts-file rollouts tenant removed from the config kept its spec: ready on every pass, sampling
    with an api key serving no longer accepted; after a restart it came back as a default logs-mode tenant.
    A removed tenant with nothing in storage was kept too (a restart does not know it)."""
    from storage.files import HeldLock

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("say a number\nsay hi\n")
    lab = {"name": "lab", "mode": "rollouts", "scorer": "length:12", "prompts_file": str(prompts), "batch_size": 4,
           "group_size": 2}
    write(data_dir, "acme", rows("a", 8), "b0")
    settings = dict(rollout_sampler="local", max_new_tokens=4, gate_max_kl=1000.0)
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}, lab, {"name": "idle"}], **settings)
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    assert learner.pending(hold_partial=False) == {"acme": 8, "lab": 4, "idle": 0}
    assert learner.step_safely("lab").step == 1  # lab has a cursor and versions now; idle has nothing

    cfg2 = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}], **settings)
    learner.apply_config(cfg2)
    assert learner.pending(hold_partial=False) == {"acme": 8, "lab": 0}
    assert learner.tenants["lab"].spec.mode == "logs" and learner.tenants["lab"].spec.configured is False
    assert learner.tenants["lab"].spec.prompts_file is None and learner.tenants["lab"].spec.api_key == ""
    idle_lock = HeldLock.try_acquire(Path(data_dir) / "locks" / "learner" / "idle.lock")
    assert idle_lock is not None, "idle's lock was let go"
    idle_lock.release()
    learner.close()

    restarted = Learner(cfg2, model_path=tiny_model, progress=False)
    assert set(restarted.tenants) == set(learner.tenants) == {"acme", "lab"}
    assert restarted.tenants["lab"].spec == TenantSpec.default("lab")
    restarted.close()


def test_a_tenant_ingest_created_keeps_learning_from_its_apps_rows_past_max_staleness(tiny_model, data_dir):
    """Nothing in clora serves a tenant that is not in the config, so its rows carry no adapter version; taken
    as the base model's, every row was stale after max_staleness published versions and it stopped learning."""
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 4}], max_staleness=1, gate_max_kl=1000.0)
    learner = None
    for k in range(4):
        write(data_dir, "newco", rows(f"n{k}-", 4, seed=k), f"b{k}", start=100 * k)
        learner = learn(cfg, tiny_model, learner=learner)
    published = [v for v in Registry(data_dir).versions("newco") if v.status == "published"]
    assert len(published) == 4, [(v.number, v.status, v.reason) for v in Registry(data_dir).versions("newco")]
    assert learner.tenants["newco"].spec.configured is False
    learner.close()


def test_a_tenant_ingest_created_keeps_learning_from_its_apps_rows_once_added_to_the_config(tiny_model, data_dir):
    """Freshness followed the config: once the operator added the app's tenant, every row without a version
    counted as the base model's and was dropped as stale (it had published more than max_staleness
    versions). What decides is whether clora's serving tier logged the row."""
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 4}], max_staleness=1, gate_max_kl=1000.0)
    learner = None
    for k in range(2):
        write(data_dir, "newco", rows(f"n{k}-", 4, seed=k), f"b{k}", start=100 * k)
        learner = learn(cfg, tiny_model, learner=learner)
    assert Registry(data_dir).latest_published("newco").number == 2
    learner.apply_config(make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 4},
                                                            {"name": "newco", "batch_size": 4}],
                                     max_staleness=1, gate_max_kl=1000.0))
    assert learner.tenants["newco"].spec.configured
    write(data_dir, "newco", rows("app", 4, seed=7), "b2", start=200)  # the app's own model, as before
    write(data_dir, "newco", rows("base", 4, seed=8, metadata=BASE_SERVED), "b3", start=300)  # clora served the base
    learn(cfg, tiny_model, learner=learner)
    reg = Registry(data_dir)
    assert [v.number for v in reg.versions("newco")] == [1, 2, 3]  # the base model's rows: stale, no version
    assert reg.get("newco", 3).metrics["n_trajectories"] == 4 and reg.get("newco", 3).metrics["n_dropped"] == 0
    assert_each_id_once(data_dir, "newco", {f"n{k}-{i}" for k in range(2) for i in range(4)}
                        | {f"app{i}" for i in range(4)} | {f"base{i}" for i in range(4)})


def test_one_tenants_failure_does_not_stop_the_others(tiny_model, data_dir):
    write(data_dir, "ok", rows("a", 8), "b0")
    write(data_dir, "broken", rows("b", 8), "b0")
    # a scorer whose module cannot be imported: the step raises, the tenant is marked and backed off
    cfg = make_config(data_dir, tiny_model, [{"name": "ok", "batch_size": 8},
                                             {"name": "broken", "mode": "rollouts", "scorer": "python:no_such_module_here:f"}],
                      rollout_sampler="local")
    learner = learn(cfg, tiny_model)
    assert Registry(data_dir).latest_published("ok").number == 1
    broken = learner.tenants["broken"]
    assert broken.status == "error" and "cannot import module 'no_such_module_here'" in broken.error and broken.retry_at > 0
    status = json.loads((Path(data_dir) / "state" / "learner" / "status.json").read_text())
    assert status["broken"]["status"] == "error" and status["ok"]["status"] == "published"
    assert Cursors(data_dir).backlog()["broken"] == 8  # nothing of it was committed


def test_the_learner_metrics_say_each_tenants_steps_failures_backlog_and_version(tiny_model, data_dir):
    """Whether a tenant has stopped learning, or keeps failing, was only in status.json and train_steps."""
    import urllib.request

    from ingest.broker import free_port
    from learner.metrics import LearnerMetrics

    write(data_dir, "ok", rows("a", 16), "b0")
    write(data_dir, "broken", rows("b", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "ok", "batch_size": 8},
                                             {"name": "broken", "mode": "rollouts", "scorer": "python:no_such_module_here:f"}],
                      rollout_sampler="local")
    port = free_port()
    metrics = LearnerMetrics(port=port)
    learner = Learner(cfg, model_path=tiny_model, progress=False, metrics=metrics)
    try:
        learner.pending(hold_partial=False)
        before = time.time()
        assert [r is not None for r in learner.step_round(["ok"])] == [True]
        assert learner.step_round(["broken"]) == [None]
        learner.tenants["broken"].retry_at = 0.0  # its back-off over: it fails again
        assert learner.step_round(["broken"]) == [None]
        learner.pending(hold_partial=False)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        learner.close()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("clora_learner_")}
    assert values['clora_learner_steps_total{outcome="published",tenant="ok"}'] == 1
    assert values['clora_learner_trajectories_total{outcome="trained",tenant="ok"}'] == 8
    assert values['clora_learner_trajectories_total{outcome="dropped",tenant="ok"}'] == 0
    assert values['clora_learner_steps_total{outcome="error",tenant="broken"}'] == 2
    assert values['clora_learner_consecutive_failures{tenant="broken"}'] == 2
    assert values['clora_learner_consecutive_failures{tenant="ok"}'] == 0
    assert values['clora_learner_last_step_timestamp_seconds{tenant="ok"}'] >= before
    assert values['clora_learner_adapter_version{tenant="ok"}'] == 1
    assert values['clora_learner_backlog{tenant="ok"}'] == 8 and values['clora_learner_backlog{tenant="broken"}'] == 8
    assert values['clora_learner_phase_seconds_total{phase="train"}'] > 0
    assert values["clora_learner_resident_tenants"] >= 1
    assert metrics.server is None, "closed with the learner"


class FakeFlakyScorer:
    """A programmatic scorer whose service can be taken down (`down`): while it is, every call fails."""

    def __init__(self):
        self.down = False

    def __call__(self, completion: str, prompt: str) -> float:
        if self.down:
            raise ConnectionError("scoring service unavailable")
        return 1.0


@pytest.mark.parametrize("outage", ["parent probe", "candidate probe"])
def test_a_scorer_outage_during_a_gate_probe_fails_the_step_and_costs_no_batch(tiny_model, data_dir, monkeypatch,
                                                                                outage):
    """Counted as reward 0, an outage during the candidate's probe read as a fall (the candidate rejected and
    its batch committed as trained), and one during the parent's was cached as the parent's rewards. The
    step fails instead: nothing committed, created or cached; once the scorer is back the batch trains."""
    from learner import loop

    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8, "scorer": "length:20"}],
                      gate_prompts=2)
    scorer = FakeFlakyScorer()
    monkeypatch.setattr(loop, "tenant_scorer", lambda spec: scorer)
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    update = Learner._update

    def training_then_outage(self, rt, work, tenant_scorer):
        trained = update(self, rt, work, tenant_scorer)
        scorer.down = outage == "candidate probe"  # the parent's probe is taken before training, the candidate's after
        return trained

    monkeypatch.setattr(Learner, "_update", training_then_outage)
    scorer.down = outage == "parent probe"
    assert learner.step_safely("acme") is None
    rt = learner.tenants["acme"]
    assert rt.status == "error" and "scoring service unavailable" in rt.error and "gate probe" in rt.error
    assert Registry(data_dir).versions("acme") == [] and step_ids(data_dir, "acme") == []
    assert Cursors(data_dir).backlog()["acme"] == 8
    assert all(rewards == (1.0, 1.0) for rewards in rt.probe_cache.values())  # no outage's zeros cached

    scorer.down = False
    monkeypatch.setattr(Learner, "_update", update)
    rt.retry_at = 0.0  # past its back-off
    record = learner.step_safely("acme")
    assert record is not None and record.decision == "published"
    (v,) = Registry(data_dir).versions("acme")
    assert v.gate["parent_probe_rewards"] == [1.0, 1.0] and v.gate["probe_rewards"] == [1.0, 1.0]
    assert_each_id_once(data_dir, "acme", {f"a{i}" for i in range(8)})
    learner.close()


@pytest.mark.parametrize("change", ["scorer", "max_new_tokens"])
def test_a_config_change_of_what_the_probe_depends_on_probes_the_parent_again(tiny_model, data_dir, change):
    """The parent's probe rewards are cached per adapter state. A config re-read that changes the tenant's
    scorer (or the probe's decode length) must not compare the candidate, probed under the new one, with
    the parent's rewards under the old: that rejected every step of the tenant, for good."""
    tenant = {"name": "acme", "batch_size": 8, "scorer": "python:learner_support:full_marks"}
    write(data_dir, "acme", rows("a", 8), "b0")
    learner = Learner(make_config(data_dir, tiny_model, [tenant], gate_prompts=2), model_path=tiny_model,
                      progress=False)
    assert learner.step_safely("acme").decision == "published"
    if change == "scorer":
        learner.apply_config(make_config(data_dir, tiny_model, [{**tenant, "scorer": "python:learner_support:no_marks"}],
                                         gate_prompts=2))
    else:  # under a length scorer, shorter probes score lower
        tenant["scorer"] = "length:400"
        learner.apply_config(make_config(data_dir, tiny_model, [tenant], gate_prompts=2))
        write(data_dir, "acme", rows("b", 8, seed=1), "b1", start=100)
        second = learner.step_safely("acme")  # probes of up to 32 tokens, cached for the next step's parent
        gate2 = Registry(data_dir).get("acme", int(second.version.split("@")[1])).gate
        long_probes = gate2["probe_rewards" if second.decision == "published" else "parent_probe_rewards"]
        learner.apply_config(make_config(data_dir, tiny_model, [tenant], gate_prompts=2, max_new_tokens=2))
    write(data_dir, "acme", rows("c", 8, seed=2), "b2", start=200)
    record = learner.step_safely("acme")
    gate = Registry(data_dir).get("acme", int(record.version.split("@")[1])).gate
    if change == "scorer":
        assert gate["parent_probe_rewards"] == [0.0, 0.0] and gate["probe_rewards"] == [0.0, 0.0]
        assert record.decision == "published"
    else:  # the parent's probes decoded 2 tokens, as the candidate's did: shorter than the cached 32-token ones
        assert all(short < long for short, long in zip(gate["parent_probe_rewards"], long_probes, strict=True))
    learner.close()


def test_a_scorer_that_keeps_failing_on_a_probe_leaves_it_out_after_a_while_never_scoring_it_0(
        tiny_model, data_dir, monkeypatch):
    """A scorer that fails on some greedy answer every time (not an outage) failed every step of its tenant,
    for good. After the back-offs' worth of tries in a row, a probe it cannot score is left out of the
    comparison on both sides: not counted 0, not cached, and the tenant stays in that mode while it fails."""
    from learner import loop

    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8, "scorer": "length:20"}],
                      gate_prompts=2)
    scorer = FakeFlakyScorer()
    scorer.down = True
    monkeypatch.setattr(loop, "tenant_scorer", lambda spec: scorer)
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    for _ in range(loop.UNSCORABLE_TRIES - 1):
        assert learner.step_safely("acme") is None
        rt = learner.tenants["acme"]
        assert rt.status == "error" and "gate probe" in rt.error
        rt.retry_at = 0.0  # past its back-off
    assert rt.probe_failures == loop.UNSCORABLE_TRIES - 1 and Registry(data_dir).versions("acme") == []
    record = learner.step_safely("acme")
    assert record is not None and record.decision == "published" and rt.error is None
    (v,) = Registry(data_dir).versions("acme")
    assert v.gate["probe_rewards"] == [None, None] and v.gate["parent_probe_rewards"] == [None, None]
    assert v.gate["probe_prompts_compared"] == 0 and v.gate["probe_reward"] is None
    assert rt.probe_cache == {}, "no unscored probe is cached"
    assert rt.probe_failures == loop.UNSCORABLE_TRIES - 1, "still failing: still left out"

    scorer.down = False  # scored again: the next step compares, caches, and leaves the mode
    write(data_dir, "acme", rows("b", 8, seed=1), "b1", start=100)
    record = learner.step_safely("acme")
    assert record is not None and rt.probe_failures == 0
    assert Registry(data_dir).get("acme", 2).gate["probe_prompts_compared"] == 2
    learner.close()


def test_in_a_round_a_scorer_outage_fails_only_its_own_tenants_step(tiny_model, data_dir, monkeypatch, caplog):
    """The round's probes decode as one batch; the tenant whose scorer failed gets the error, the others
    their rewards (no decode again one tenant at a time)."""
    from learner import loop

    for tenant in ("up", "down"):
        write(data_dir, tenant, rows(tenant, 8), f"{tenant}0")
    cfg = make_config(data_dir, tiny_model, [{"name": t, "batch_size": 8, "scorer": "length:20"} for t in ("up", "down")],
                      gate_prompts=2, round_tenants=2)
    scorers = {"up": FakeFlakyScorer(), "down": FakeFlakyScorer()}
    monkeypatch.setattr(loop, "tenant_scorer", lambda spec: scorers[spec.name])
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    update = Learner._update

    def training_then_outage(self, rt, work, tenant_scorer):
        trained = update(self, rt, work, tenant_scorer)
        scorers["down"].down = rt.spec.name == "down" or scorers["down"].down
        return trained

    monkeypatch.setattr(Learner, "_update", training_then_outage)
    up, down = learner.step_round(["up", "down"])
    assert up is not None and up.decision == "published" and down is None
    assert "scoring service unavailable" in learner.tenants["down"].error
    assert Registry(data_dir).versions("down") == [] and step_ids(data_dir, "down") == []
    assert "probing them one at a time" not in caplog.text
    learner.close()


def test_one_tenants_unreadable_files_and_stray_folders_do_not_stop_the_others(tiny_model, data_dir, caplog):
    """A tenant whose backlog cannot be read (its horizon.json damaged) is in error, the others train. A damaged
    trajectories file (truncated: it will never read) left its tenant in error for good, since compaction and
    retention leave such a file alone: its rows are left out, the tenant's other files are trained."""
    from prometheus_client import generate_latest

    write(data_dir, "ok", rows("a", 8), "b0")
    write(data_dir, "broken", rows("b", 8), "b0")
    write(data_dir, "torn", rows("t", 8), "b0")
    (bad,) = (Path(data_dir) / "trajectories" / "tenant=torn").glob("*.parquet")
    bad.write_bytes(bad.read_bytes()[:100])  # truncated: pyarrow cannot read it
    write(data_dir, "torn", rows("u", 8), "b1")
    horizon = Path(data_dir) / "cursors" / "broken" / "horizon.json"
    horizon.parent.mkdir(parents=True)
    horizon.write_text("{")
    (Path(data_dir) / "cursors" / "_old").mkdir(parents=True)  # left by hand: no tenant
    cfg = make_config(data_dir, tiny_model, [{"name": n, "batch_size": 8} for n in ("ok", "broken", "torn")])
    learner = learn(cfg, tiny_model)
    assert Registry(data_dir).latest_published("ok").number == 1 and "_old" not in learner.tenants
    assert Registry(data_dir).latest_published("torn").number == 1
    assert [set(ids) for ids in step_ids(data_dir, "torn")] == [{f"u{i}" for i in range(8)}], "the damaged file's rows are left out"
    assert f"{bad} cannot be read" in caplog.text
    broken = learner.tenants["broken"]
    assert broken.status == "error" and broken.error.startswith("backlog unreadable: ") and "horizon.json" in broken.error
    status = json.loads((Path(data_dir) / "state" / "learner" / "status.json").read_text())
    assert status["broken"]["status"] == "error" and status["ok"]["status"] == "published"
    # What an alert sees: the tenant in error, and no backlog of 0 that would look idle.
    learner.pending(hold_partial=False)
    metrics = generate_latest(learner.metrics.registry).decode()
    assert 'clora_learner_tenant_error{tenant="broken"} 1.0' in metrics
    assert 'clora_learner_tenant_error{tenant="ok"} 0.0' in metrics
    assert 'clora_learner_backlog{tenant="broken"}' not in metrics and 'clora_learner_backlog{tenant="ok"} 0.0' in metrics
    # Mended, it is trained on the next pass, and its error clears.
    horizon.unlink()
    assert learner.pending(hold_partial=False)["broken"] == 8 and learner.tenants["broken"].error is None
    metrics = generate_latest(learner.metrics.registry).decode()
    assert 'clora_learner_backlog{tenant="broken"} 8.0' in metrics
    learner.close()


def test_a_tenant_whose_lock_cannot_be_made_waits_and_the_others_go_on(tiny_model, data_dir, monkeypatch):
    """Ingest creates a tenant while the disk is full: making its lock file raised out of `pending`, and the
    whole learner ended (and `clora up` restarted it into the same failure)."""
    import errno

    import storage.files as files

    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    write(data_dir, "newco", rows("n", 8), "b0")
    real = files._locked_fd

    def full(path, **how):
        if "newco" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, **how)

    monkeypatch.setattr(files, "_locked_fd", full)
    learn(cfg, tiny_model, learner=learner)
    assert Registry(data_dir).latest_published("acme").number == 1
    newco = learner.tenants["newco"]
    assert newco.status == "error" and "No space left on device" in newco.error and newco.retry_at > time.monotonic()
    status = json.loads((Path(data_dir) / "state" / "learner" / "status.json").read_text())
    assert status["newco"]["status"] == "error" and status["acme"]["status"] == "published"
    assert learner.pending(hold_partial=False)["newco"] == 0  # backing off: not even its lock is tried
    assert learner.metrics.failures.labels("newco")._value.get() == 1  # what "keeps failing" alerts on
    assert learner.metrics.in_error.labels("newco")._value.get() == 1
    # The disk has room again: after the back-off the lock is taken, the error clears, and it trains.
    monkeypatch.setattr(files, "_locked_fd", real)
    newco.retry_at = 0
    assert learner.pending(hold_partial=False)["newco"] == 8 and newco.error is None
    learn(cfg, tiny_model, learner=learner)
    assert Registry(data_dir).latest_published("newco").number == 1


def test_trajectories_that_cannot_be_listed_stop_no_one(tiny_model, data_dir, monkeypatch):
    import storage.cursors as cursors_module

    write(data_dir, "acme", rows("a", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}])
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    real = cursors_module.partition_tenants

    def unlistable(*args):
        raise PermissionError(13, "Permission denied", str(Path(data_dir) / "trajectories"))

    monkeypatch.setattr(cursors_module, "partition_tenants", unlistable)
    assert learner.pending(hold_partial=False) == {"acme": 0}
    acme = learner.tenants["acme"]
    assert acme.status == "error" and acme.error.startswith("backlog unreadable: PermissionError")
    status_file = Path(data_dir) / "state" / "learner" / "status.json"
    # said in status.json at once: no step ends while nothing can be listed, and it was written only then
    assert json.loads(status_file.read_text())["acme"]["error"].startswith("backlog unreadable: PermissionError")
    monkeypatch.setattr(cursors_module, "partition_tenants", real)
    assert learner.pending(hold_partial=False) == {"acme": 8} and acme.error is None
    assert json.loads(status_file.read_text())["acme"]["error"] is None
    learner.close()


def test_rollouts_mode_with_a_prompts_file_and_the_local_sampler(tiny_model, data_dir, tmp_path, caplog):
    prompts = tmp_path / "prompts.txt"
    # the last line is longer than the context: serving would refuse it, failing its step at every turn of the file
    prompts.write_text("Write a number.\nTell me about cats.\n\nhello\n" + "word " * 600 + "\n")
    # length:48: the tiny model's 12-token completions run ~30-60 characters, so rewards differ within a
    # group and every step trains (with length:20 most scored 0 and one run in five trained nothing)
    cfg = make_config(
        data_dir,
        tiny_model,
        [{"name": "lab", "mode": "rollouts", "scorer": "length:48", "prompts_file": str(prompts), "batch_size": 8, "group_size": 4,
          "learning_rate": 1e-2, "lora": {"target_modules": LEARNABLE_TARGETS}}],
        rollout_sampler="local",
        max_new_tokens=12,
        gate_prompts=2,
        gate_max_kl=50.0,
        gate_reward_tolerance=1.0,
        max_staleness=0,  # the local sampler samples with the adapter being trained: never stale
    )
    with caplog.at_level(logging.WARNING, logger="learner.loop"):
        learn(cfg, tiny_model, until_idle=False, max_steps=3)
    assert "1 of the 4 prompts in" in caplog.text and "they are skipped" in caplog.text
    steps = read_dataset(data_dir, "train_steps").to_pylist()
    assert [r["step"] for r in sorted(steps, key=lambda r: r["step"])] == [1, 2, 3]
    assert {r["mode"] for r in steps} == {"rollouts"} and all(r["n_trajectories"] == 8 for r in steps), steps
    versions = Registry(data_dir).versions("lab")
    assert versions, "no version was created"
    assert [v.status for v in versions].count("published") >= 2, "the steps after a publish trained nothing"
    for v in versions:  # the gate compared probe rewards of parent and candidate
        assert v.gate["probe_reward"] is not None and v.gate["parent_probe_reward"] is not None
        # per prompt, paired: the mean is their mean, and the allowance is at least the tolerance
        assert len(v.gate["probe_rewards"]) == len(v.gate["parent_probe_rewards"]) == 2
        assert v.gate["probe_reward"] == pytest.approx(sum(v.gate["probe_rewards"]) / 2)
        assert v.gate["probe_drop_allowed"] >= v.gate["limit_reward_tolerance"] == 1.0


@pytest.mark.parametrize("scale", [True, False])
def test_scale_advantages_reaches_the_rollouts_update(tiny_model, data_dir, tmp_path, monkeypatch, scale):
    from learner import maths

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Write a number.\nhello\n")
    asked = []
    real = maths.grpo_advantages
    monkeypatch.setattr(maths, "grpo_advantages", lambda *a, **kw: (asked.append(kw.get("scale")), real(*a, **kw))[1])
    cfg = make_config(data_dir, tiny_model, [{"name": "lab", "mode": "rollouts", "scorer": "length:48",
                                               "prompts_file": str(prompts), "batch_size": 4, "group_size": 2}],
                      rollout_sampler="local", max_new_tokens=8, max_staleness=0, scale_advantages=scale)
    learn(cfg, tiny_model, until_idle=False, max_steps=1)
    assert asked == [scale]


def test_a_prompts_file_is_rendered_once_and_again_when_it_changes(tiny_model, data_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Write a number.\nhello\n")
    cfg = make_config(data_dir, tiny_model, [{"name": "lab", "mode": "rollouts", "scorer": "length:20",
                                              "prompts_file": str(prompts)}], rollout_sampler="local")
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    rt = learner.tenants["lab"]
    first = learner._file_prompts(rt)
    assert len(first) == 2 and "Write a number." in first[0] and first[0].startswith("<|im_start|>")
    assert learner._file_prompts(rt) is first  # not read and rendered again
    prompts.write_text("Write a number.\nhello\nCount to five.\n")
    assert [p for p in learner._file_prompts(rt) if "Count to five." in p]
    prompts.unlink()
    with pytest.raises(SamplingError, match="cannot read prompts_file"):  # an error, not the old prompts
        learner._file_prompts(rt)
    learner.close()


def test_rollouts_mode_takes_prompts_from_production_and_skips_logged_rollouts(tiny_model, data_dir):
    production = rows("p", 2)
    logged_rollouts = rows("r", 3, metadata={"source": "rollout"})
    write(data_dir, "lab", logged_rollouts + production, "b0")
    cfg = make_config(
        data_dir, tiny_model,
        [{"name": "lab", "mode": "rollouts", "scorer": "length:10", "batch_size": 8, "group_size": 4}],
        rollout_sampler="local", max_new_tokens=8, gate_max_kl=50.0,
    )
    learn(cfg, tiny_model)
    assert_each_id_once(data_dir, "lab", {"p0", "p1", "r0", "r1", "r2"})
    row = read_dataset(data_dir, "train_steps").to_pylist()[0]
    assert row["n_trajectories"] == 8  # 2 production prompts x 4 completions; logged rollouts are no prompts


def test_logs_mode_does_not_train_the_learners_own_rollout_samples_again(tiny_model, data_dir):
    """A tenant moved from rollouts to logs mode (or out of the config: logs mode by default) finds its logged
    rollouts in its backlog: trained when they were drawn, they are committed without training."""
    write(data_dir, "lab", rows("r", 6, metadata={"source": "rollout"}) + rows("p", 8, seed=1), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "lab", "batch_size": 8}])
    learn(cfg, tiny_model)
    assert_each_id_once(data_dir, "lab", {*(f"r{i}" for i in range(6)), *(f"p{i}" for i in range(8))})
    steps = read_dataset(data_dir, "train_steps").to_pylist()
    assert sum(s["n_trajectories"] for s in steps) == 8  # the production rows only
    assert sum(s["n_dropped"] for s in steps) == 6


class FakeServingSampler:
    """Stands in for the HTTP sampler (background, so the loop goes through its Prefetcher): canned
    completions of varied length, labelled like the serving tier labels them (the base model: None)."""

    background = True
    TEXTS = ("a", "four", "some longer text here", "twelve chars", "x" * 30, "mid length")

    def __init__(self):
        self.calls = 0

    def sample(self, requests):
        from learner.types import Sample

        self.calls += 1
        return [[Sample(text=self.TEXTS[(i + j) % len(self.TEXTS)], token_ids=None, finished=True, version=None,
                        interaction_id=f"call{self.calls}-{i}-{j}") for j in range(r.n)] for i, r in enumerate(requests)]


class CurrentVersionSampler(FakeServingSampler):
    """... labelling its samples with the version the learner holds, as the serving tier would once that
    version is current."""

    def sample(self, requests):
        from dataclasses import replace

        return [[replace(s, version=r.version) for s in group] for r, group in zip(requests, super().sample(requests))]


class LaggingSampler(FakeServingSampler):
    """... labelling its samples with the version the learner held when it asked (as the serving tier would,
    once that version is current), or with `label` (None: the base model) on the calls in `lagging` (serving
    still had an older version), or on every call with `lagging` None."""

    def __init__(self, lagging=None, label=None):
        super().__init__()
        self.lagging, self.label = lagging, label

    def sample(self, requests):
        from dataclasses import replace

        out = super().sample(requests)
        lag = self.lagging is None or self.calls in self.lagging
        return [[replace(s, version=self.label if lag else r.version) for s in group]
                for r, group in zip(requests, out)]


def rollouts_lab(prompts_file, scorer="length:12"):
    return {"name": "lab", "mode": "rollouts", "scorer": scorer, "prompts_file": str(prompts_file), "batch_size": 4,
            "group_size": 2, "learning_rate": 1e-2}


def test_a_rollouts_step_whose_every_sample_failed_scoring_commits_nothing_and_says_why(tiny_model, data_dir, tmp_path):
    """The step committed as "skipped" with no error: its trajectories were consumed untrained."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n")
    write(data_dir, "lab", rows("p", 3), "b0")  # production rows: a prompts-file tenant commits them with a step
    cfg = make_config(data_dir, tiny_model, [rollouts_lab(prompts, "python:learner_support:unavailable_scorer")],
                      rollout_sampler="local", max_new_tokens=4)
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    learner.pending(hold_partial=False)
    assert learner.step_safely("lab") is None
    lab = learner.tenants["lab"]
    assert lab.status == "error" and lab.retry_at > time.monotonic()
    assert lab.error == ("NoUsableSamples: all 4 samples failed scoring: scorer raised RuntimeError: scoring service "
                         "unavailable")
    assert step_ids(data_dir, "lab") == [] and Registry(data_dir).versions("lab") == []
    assert Cursors(data_dir).backlog()["lab"] == 3
    # The same prompts failing again and again (a prompt the scorer cannot handle) hold the tenant up only
    # UNSCORABLE_TRIES times: the last try commits the step as skipped, trained on nothing.
    from learner.loop import UNSCORABLE_TRIES

    for _ in range(UNSCORABLE_TRIES - 2):
        lab.retry_at = 0.0
        learner.pending(hold_partial=False)
        assert learner.step_safely("lab") is None and lab.status == "error"
    assert step_ids(data_dir, "lab") == []
    lab.retry_at = 0.0
    learner.pending(hold_partial=False)
    learner.step_safely("lab")
    assert lab.status != "error" and lab.error is None and lab.unscorable == ((), 0)
    assert len(step_ids(data_dir, "lab")) == 1 and Registry(data_dir).versions("lab") == []
    assert Cursors(data_dir).backlog().get("lab", 0) == 0
    learner.close()


def test_samples_the_scorer_failed_on_are_counted_apart_from_stale_ones(tiny_model, data_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n")
    cfg = make_config(data_dir, tiny_model, [rollouts_lab(prompts, "python:learner_support:picky_scorer")],
                      max_new_tokens=8, gate_max_kl=50.0)
    learner = Learner(cfg, model_path=tiny_model, sampler=FakeServingSampler(), progress=False)
    run(cfg, model_path=tiny_model, learner=learner, max_steps=1, progress=False)
    metrics = Registry(data_dir).get("lab", 1).metrics  # samples "a", "four" | "four", "some longer text here"
    assert (metrics["n_trajectories"], metrics["n_score_failed"], metrics["n_dropped"]) == (3, 1, 0)


def test_a_rollouts_batch_that_went_stale_is_sampled_again_and_one_still_stale_commits_nothing(tiny_model, data_dir,
                                                                                                tmp_path):
    """Serving keeps sampling with the base model after the learner published lab@1 (max_staleness 0): the
    prefetched batch is stale, so is the one sampled again at once, and the step fails saying so instead of
    committing as "skipped"."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\nfour\n")
    cfg = make_config(data_dir, tiny_model, [rollouts_lab(prompts)], max_new_tokens=8, gate_max_kl=50.0,
                      max_staleness=0)
    sampler = LaggingSampler(label=None)
    learner = Learner(cfg, model_path=tiny_model, sampler=sampler, progress=False)
    records = []
    run(cfg, model_path=tiny_model, learner=learner, max_steps=2, progress=False, on_step=records.append)
    assert [(r.step, r.decision) for r in records] == [(1, "published")]
    lab = learner.tenants["lab"]
    assert lab.status == "error" and lab.error == (
        "NoUsableSamples: all 4 samples stale (made by version 0, 1 behind 1 (max_staleness 0))")
    assert sampler.calls == 3  # step 1's batch; step 2's, and step 2's sampled again
    assert len(step_ids(data_dir, "lab")) == 1 and [v.number for v in Registry(data_dir).versions("lab")] == [1]


def test_a_batch_sampled_ahead_that_went_stale_is_sampled_again_without_an_error(tiny_model, data_dir, tmp_path):
    """Sample-ahead (max_staleness 1): step 3's batch, issued while step 2 trained from lab@1, came back from
    the base model (serving had not loaded lab@1 yet): two versions behind lab@2. It is sampled again."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\nfour\n")
    cfg = make_config(data_dir, tiny_model, [rollouts_lab(prompts)], max_new_tokens=8, gate_max_kl=50.0,
                      max_staleness=1, sample_ahead=True)
    sampler = LaggingSampler(lagging={3}, label=None)  # calls: step 1, ahead 2, ahead 3, 3 again
    learner = Learner(cfg, model_path=tiny_model, sampler=sampler, progress=False)
    records = []
    run(cfg, model_path=tiny_model, learner=learner, max_steps=3, progress=False, on_step=records.append)
    assert [r.step for r in records] == [1, 2, 3] and all(r.decision != "skipped" for r in records)
    assert records[2].staleness == 0 and len(records[2].rewards) == 4  # the batch sampled again, by lab@2
    assert learner.tenants["lab"].failures == 0 and sampler.calls >= 4


@pytest.mark.parametrize("ahead, max_staleness", [(True, 4), (False, 4), (True, 0)])
def test_sample_ahead_issues_the_next_batch_before_the_current_step_commits(tiny_model, data_dir, tmp_path, ahead,
                                                                            max_staleness):
    """... and not with max_staleness 0, where every sample of the version before the newest is dropped."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\nfour\n")
    write(data_dir, "lab", rows("r", 5, metadata={"source": "rollout"}), "b0")  # rollouts that came back via ingest
    cfg = make_config(
        data_dir, tiny_model,
        [{"name": "lab", "mode": "rollouts", "scorer": "length:12", "prompts_file": str(prompts), "batch_size": 4,
          "group_size": 2, "learning_rate": 1e-2}],
        max_new_tokens=8, gate_max_kl=50.0, sample_ahead=ahead, max_staleness=max_staleness,
    )
    sampler = FakeServingSampler() if max_staleness else CurrentVersionSampler()
    learner = Learner(cfg, model_path=tiny_model, sampler=sampler, progress=False)
    issued = []  # (step the batch is for, last committed step when it was issued)
    start = learner.prefetcher.start

    def recording_start(tenant, plan, requests, *, step=0):
        issued.append((step, learner.tenants[tenant].step))
        start(tenant, plan, requests, step=step)

    learner.prefetcher.start = recording_start
    records = []
    run(cfg, model_path=tiny_model, learner=learner, max_steps=3, progress=False, on_step=records.append)

    if ahead and max_staleness:  # step k+1's batch is issued while step k trains (before its commit)
        assert issued == [(1, 0), (2, 0), (3, 1), (4, 2)]
    else:
        assert issued == [(1, 0), (2, 1), (3, 2), (4, 3)]
    assert [r.step for r in records] == [1, 2, 3]
    assert_each_id_once(data_dir, "lab", {f"r{i}" for i in range(5)})  # read when a step collects, once
    for r in records:
        assert set(r.timings) == {"wait", "score", "train", "probe", "publish", "other", "total", "sampling"}
        assert sum(r.timings[k] for k in ("wait", "score", "train", "probe", "publish", "other")) == pytest.approx(
            r.timings["total"], abs=1e-6)
        assert len(r.rewards) == r.row["n_trajectories"] == 4
        parent = int(r.row["version"].rsplit("@", 1)[1]) if r.row["version"] else 0
        assert r.staleness == (parent if max_staleness else 0)  # from the base model (version 0), or current


def test_a_tenant_remembers_only_the_served_versions_staleness_can_count(tiny_model, data_dir, monkeypatch):
    write(data_dir, "acme", rows("a", 64), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}], max_staleness=8)
    learner = learn(cfg, tiny_model)
    published = [v.number for v in Registry(data_dir).versions("acme") if v.published_at is not None]
    assert len(published) >= 3, "the test needs more published steps than it keeps"
    assert learner.tenants["acme"].served == published
    monkeypatch.setattr("learner.loop.SERVED_KEPT", 1)
    learner = learn(make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}], max_staleness=0), tiny_model)
    assert learner.tenants["acme"].served == published[-2:], "max_staleness + 2 of them, the newest"
    # and only they are read (newest first), not every record of the history
    numbers = Registry(data_dir).numbers("acme")
    read, get = [], learner.registry.get
    monkeypatch.setattr(learner.registry, "get", lambda tenant, n: read.append(n) or get(tenant, n))
    learner._load_served(learner.tenants["acme"])
    assert learner.tenants["acme"].served == published[-2:]
    assert read == sorted((n for n in numbers if n >= published[-2]), reverse=True) and len(read) < len(numbers)


def test_rollouts_reach_the_serving_url_when_one_is_set(tiny_model, data_dir):
    cfg = make_config(data_dir, tiny_model, [{"name": "lab"}], serving_url="http://serving:8000")
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    assert learner.sampler.base_url == "http://serving:8000"  # not serving.host:port, which is another container's
    learner.close()
    plain = make_config(data_dir, tiny_model, [{"name": "lab"}])
    default = Learner(plain, model_path=tiny_model, progress=False)
    assert default.sampler.base_url == f"http://127.0.0.1:{plain.serving.port}"
    default.close()


def test_an_adapter_shape_serving_would_refuse_is_an_error_before_anything_is_trained(tiny_model, data_dir):
    # PEFT matches target names by suffix ("self_attn.q_proj" works for it); serving's check takes layer
    # names or full paths only, and would refuse every version: none would ever be served
    write(data_dir, "odd", rows("a", 8), "b0")
    write(data_dir, "ok", rows("o", 8), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "odd", "batch_size": 8, "lora": {"target_modules": ["self_attn.q_proj"]}},
                                             {"name": "ok", "batch_size": 8}])
    learner = learn(cfg, tiny_model)
    odd = learner.tenants["odd"]
    assert odd.status == "error" and "serving would refuse every version" in odd.error and "self_attn.q_proj" in odd.error
    assert Registry(data_dir).versions("odd") == [] and Registry(data_dir).latest_published("ok").number == 1
    assert not learner.policy.has("odd")  # tried again (with the config mended) from scratch


class HeldForOneSampler(FakeServingSampler):
    """FakeServingSampler whose requests for `held` wait until `release` is set (a tenant serving answers slowly);
    after a minute they go on all the same, so a learner that waits for them fails the test instead of hanging it.
    `released_in_time`: whether every wait ended by the release."""

    def __init__(self, held: str):
        super().__init__()
        self.held, self.release, self.released_in_time = held, threading.Event(), True

    def sample(self, requests):
        if requests and requests[0].tenant == self.held:
            self.released_in_time &= self.release.wait(60)
        return super().sample(requests)


def test_a_tenant_still_being_sampled_does_not_hold_up_one_whose_batch_is_ready(tiny_model, data_dir, tmp_path):
    """The scheduler picked a tenant whose rollouts were still being sampled, and the learner waited for
    them while another tenant's batch lay ready (20 s in the review's trial). aaa's rollouts come back only
    once bbb has trained twice: two steps of bbb first, with no wait for aaa's."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\nfour\n")
    lab = lambda name: {"name": name, "mode": "rollouts", "scorer": "length:12", "prompts_file": str(prompts),  # noqa: E731
                        "batch_size": 4, "group_size": 2, "learning_rate": 1e-2}
    cfg = make_config(data_dir, tiny_model, [lab("aaa"), lab("bbb")], max_new_tokens=8, gate_max_kl=50.0,
                      scheduler="round_robin", sample_ahead=False)
    sampler = HeldForOneSampler("aaa")
    learner = Learner(cfg, model_path=tiny_model, sampler=sampler, progress=False)
    order = []

    def on_step(record):
        order.append(record.tenant)
        if order.count("bbb") == 2:
            sampler.release.set()

    try:
        run(cfg, model_path=tiny_model, learner=learner, max_steps=3, progress=False, on_step=on_step)
    finally:
        sampler.release.set()
        learner.close()
    assert order[:2] == ["bbb", "bbb"], order  # aaa (first in turn) was still being sampled
    assert sampler.released_in_time, "the learner waited for aaa's rollouts instead of training bbb"


class BlockedSampler(FakeServingSampler):
    """FakeServingSampler whose calls wait for `release` (serving slow to answer; a minute at most), saying
    when one has begun (`entered`)."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def sample(self, requests):
        self.entered.set()
        self.release.wait(60)
        return super().sample(requests)


def test_new_data_of_another_tenant_is_trained_while_the_only_ready_tenants_rollouts_are_sampled(
        tiny_model, data_dir, tmp_path):
    """With only aaa ready, and its rollouts still being sampled, the learner took aaa and waited in its step
    for them, deaf to bbb's trajectories arriving meanwhile until aaa's came back."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\nfour\n")
    aaa = {"name": "aaa", "mode": "rollouts", "scorer": "length:12", "prompts_file": str(prompts), "batch_size": 4,
           "group_size": 2, "learning_rate": 1e-2}
    cfg = make_config(data_dir, tiny_model, [aaa, {"name": "bbb", "batch_size": 8}], max_new_tokens=8,
                      gate_max_kl=50.0, sample_ahead=False)
    sampler = HeldForOneSampler("aaa")
    learner = Learner(cfg, model_path=tiny_model, sampler=sampler, progress=False)
    order = []

    def on_step(record):
        order.append(record.tenant)
        sampler.release.set()  # bbb trained: aaa's rollouts may come back

    stop = threading.Event()
    thread = threading.Thread(target=run, args=(cfg,), kwargs=dict(model_path=tiny_model, learner=learner, stop=stop,
                                                                   max_steps=2, progress=False, on_step=on_step))
    thread.start()
    try:
        for _ in range(600):  # aaa's prefetch is sampling
            if learner.prefetcher is not None and learner.prefetcher.busy("aaa"):
                break
            time.sleep(0.1)
        write(data_dir, "bbb", rows("b", 8), "b0")  # meanwhile, bbb's traffic
        thread.join(timeout=120)
        assert not thread.is_alive()
    finally:
        stop.set()
        sampler.release.set()
        thread.join(timeout=60)
        learner.close()
    assert order == ["bbb", "aaa"], order
    assert sampler.released_in_time, "the learner waited for aaa's rollouts instead of training bbb"


def test_a_stop_while_rollouts_are_sampled_ends_the_run_at_once_and_commits_nothing(tiny_model, data_dir, tmp_path):
    """SIGTERM while the serving tier was slow to answer: the step waited for its samples up to the HTTP
    timeout (300 s) before the learner stopped. (The loop now waits for them itself, not in a step.)"""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n")
    write(data_dir, "lab", rows("p", 3), "b0")
    cfg = make_config(data_dir, tiny_model, [rollouts_lab(prompts)], max_new_tokens=8, gate_max_kl=50.0)
    sampler = BlockedSampler()
    learner = Learner(cfg, model_path=tiny_model, sampler=sampler, progress=False)
    stop = threading.Event()
    thread = threading.Thread(target=run, args=(cfg,), kwargs=dict(model_path=tiny_model, learner=learner, stop=stop,
                                                                   progress=False))
    thread.start()
    try:
        assert sampler.entered.wait(60)  # the loop goes on from prefetching to the step, which waits for it
        time.sleep(0.5)
        stop.set()
        thread.join(timeout=60)  # the samples never come: only the stop ends the wait
        assert not thread.is_alive(), "the learner waited for the samples"
    finally:
        sampler.release.set()
        thread.join(timeout=60)
    lab = learner.tenants["lab"]
    assert (lab.error, lab.failures, lab.step) == (None, 0, 0)
    assert step_ids(data_dir, "lab") == [] and Registry(data_dir).versions("lab") == []


def test_a_sampling_job_planned_under_an_old_spec_is_dropped_when_the_config_changes(tiny_model, data_dir, tmp_path):
    """A job outlived a reload (logs mode meanwhile, then rollouts again) and was trained at a later step,
    committing its production ids a second time."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\nfour\n")
    tenant = {"name": "lab", "mode": "rollouts", "scorer": "length:12", "prompts_file": str(prompts), "batch_size": 4,
              "group_size": 2, "learning_rate": 1e-2}
    cfg = make_config(data_dir, tiny_model, [tenant], max_new_tokens=8, gate_max_kl=50.0, sample_ahead=False)
    learner = Learner(cfg, model_path=tiny_model, sampler=FakeServingSampler(), progress=False)
    run(cfg, model_path=tiny_model, learner=learner, max_steps=1, progress=False)
    assert learner.prefetcher.pending("lab")  # step 2's batch, started after step 1's commit
    learner.apply_config(make_config(data_dir, tiny_model, [{**tenant, "group_size": 4}], max_new_tokens=8,
                                     gate_max_kl=50.0, sample_ahead=False))
    assert not learner.prefetcher.pending("lab")
    learner.close()


def _lab_after_one_step(data_dir, tiny_model, tmp_path):
    """A rollouts tenant one step in, its next batch sampled (in the background): (learner, its tenant's
    config, the learner settings)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\nfour\n")
    tenant = rollouts_lab(prompts)
    settings = dict(max_new_tokens=8, gate_max_kl=50.0, sample_ahead=False)
    cfg = make_config(data_dir, tiny_model, [tenant], **settings)
    learner = Learner(cfg, model_path=tiny_model, sampler=FakeServingSampler(), progress=False)
    run(cfg, model_path=tiny_model, learner=learner, max_steps=1, progress=False)
    return learner, tenant, settings


def test_rereading_an_unchanged_config_keeps_the_batch_sampled_ahead_even_if_the_adapter_keeps_its_shape(
        tiny_model, data_dir, tmp_path, caplog):
    """A config asking for another adapter shape than the saved adapter's: the saved shape applies, so the
    applied spec never equalled the config's, and every re-read (every few seconds) dropped the batch sampled
    ahead and warned again."""
    learner, tenant, settings = _lab_after_one_step(data_dir, tiny_model, tmp_path)
    reshaped = make_config(data_dir, tiny_model, [{**tenant, "lora": {"rank": 4}}], **settings)
    with caplog.at_level("WARNING", logger="learner.policy"):
        learner.apply_config(reshaped)  # a change: applied (the shape kept, with a warning)
        assert learner.tenants["lab"].spec.rank == 8 and not learner.prefetcher.pending("lab")
        run(reshaped, model_path=tiny_model, learner=learner, max_steps=1, progress=False)
        assert learner.prefetcher.pending("lab")  # the next step's batch
        for _ in range(3):
            learner.apply_config(reshaped)  # re-read, unchanged
        assert learner.prefetcher.pending("lab")
    assert sum("changes the adapter shape" in r.getMessage() for r in caplog.records) == 1
    learner.close()


def test_a_config_re_read_applies_the_learner_settings_or_says_which_wait_for_a_restart(tiny_model, data_dir,
                                                                                        tmp_path, caplog):
    """keep_versions stayed the start's (the registry was made once), a new temperature trained the batch
    sampled under the old one as if sampled under it, and settings read once changed without a word."""
    learner, tenant, settings = _lab_after_one_step(data_dir, tiny_model, tmp_path)
    assert learner.prefetcher.pending("lab")
    learner.apply_config(make_config(data_dir, tiny_model, [tenant], keep_versions=1, **settings))
    assert learner.registry.keep_last == 1 and learner.prefetcher.pending("lab")  # nothing about sampling changed
    with caplog.at_level("WARNING", logger="learner.loop"):
        learner.apply_config(make_config(data_dir, tiny_model, [tenant], keep_versions=1, temperature=0.7,
                                         serving_url="http://127.0.0.1:1", **settings))
    assert not learner.prefetcher.pending("lab")
    assert "learner.serving_url changed in the config: takes effect when the learner starts again" in caplog.text
    # serving reads its context length only when it starts: applied here at once, rollout prompts serving
    # still refuses as too long made the learner's steps fail
    cfg = make_config(data_dir, tiny_model, [tenant], keep_versions=1, temperature=0.7, **settings)
    longer = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"max_model_len": 4 * learner.max_len})})
    before = learner.max_len
    learner.apply_config(longer)
    assert learner.max_len == before
    learner.close()


# ---------------------------------------------------------------------------------------------------------
# Rounds: several tenants step together, their gate probes decoded in one batch


def _round_config(data_dir, tiny_model, prompts, round_tenants, **learner):
    tenants = [
        {"name": name, "mode": "rollouts", "scorer": scorer, "prompts_file": str(prompts), "batch_size": 8,
         "group_size": 4, "learning_rate": 1e-2, "lora": {"target_modules": LEARNABLE_TARGETS}}
        for name, scorer in (("a", "length:48"), ("b", "length:40"), ("c", "length:56"))
    ]
    return make_config(data_dir, tiny_model, tenants, rollout_sampler="local", max_new_tokens=12, gate_prompts=2,
                       gate_max_kl=50.0, max_staleness=0, round_tenants=round_tenants, **learner)


def test_a_round_decodes_its_tenants_probes_in_one_batch_and_learns_what_steps_one_at_a_time_learn(
        tiny_model, tmp_path, monkeypatch):
    """Three rollouts tenants, six steps, once one tenant at a time (round_tenants = 1) and once in rounds
    of three: the same samples, probes, gate decisions, losses and adapters, with one batched probe decode
    per round instead of one decode per candidate."""
    from learner.policy import Policy

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Write a number.\nTell me about cats.\nhello\nCount to five.\n")
    calls = []
    real = Policy.generate_grouped

    def counted(self, groups, **kw):
        calls.append([tenant for tenant, _ in groups])
        return real(self, groups, **kw)

    monkeypatch.setattr(Policy, "generate_grouped", counted)
    outcome = {}
    for size in (1, 3):
        data_dir = tmp_path / f"round-{size}"
        torch.manual_seed(0)
        learn(_round_config(data_dir, tiny_model, prompts, size), tiny_model, until_idle=False, max_steps=6)
        registry = Registry(data_dir)
        outcome[size] = {
            "steps": sorted((r["tenant"], r["step"], r["loss"], r["n_trajectories"])
                            for r in read_dataset(data_dir, "train_steps").to_pylist()),
            "gate": {t: [(v.status, v.gate["probe_rewards"], v.gate["parent_probe_rewards"]) for v in registry.versions(t)]
                     for t in "abc"},
            "weights": {t: [(v.path / ADAPTER_WEIGHTS).read_bytes() for v in registry.versions(t)] for t in "abc"},
        }
        if size == 1:
            assert calls and all(len(c) == 1 for c in calls), "one tenant at a time decodes one tenant's probes"
            calls.clear()
    # each tenant's first parent probe alone, then one decode of the three candidates per round
    assert [c for c in calls if len(c) > 1] == [["a", "b", "c"], ["a", "b", "c"]], calls
    assert sorted(c[0] for c in calls if len(c) == 1) == ["a", "b", "c"], calls
    assert [s[:2] for s in outcome[3]["steps"]] == [(t, k) for t in "abc" for k in (1, 2)]
    assert outcome[3] == outcome[1]
    for t in "abc":  # both steps trained and were probed, and the second adapter is not the first
        assert [len(probe) == len(parent) == 2 for _, probe, parent in outcome[3]["gate"][t]] == [True, True]
        assert outcome[3]["weights"][t][0] != outcome[3]["weights"][t][1]


def test_a_round_asks_for_every_tenants_next_batch_before_it_trains_any(tiny_model, tmp_path):
    """With sample-ahead, a step asks for its next batch as it takes its samples. A round has all its tenants
    take theirs first, so those requests reach the serving engine together (one multi-LoRA decode) rather
    than one tenant after another as each step's training ends."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Write a number.\nTell me about cats.\nhello\nCount to five.\n")
    tenants = [{**rollouts_lab(prompts), "name": name} for name in "abc"]
    cfg = make_config(tmp_path / "data", tiny_model, tenants, max_new_tokens=8, gate_prompts=2, gate_max_kl=50.0,
                      sample_ahead=True, max_staleness=2, round_tenants=3)
    learner = Learner(cfg, model_path=tiny_model, sampler=FakeServingSampler(), progress=False)
    events = []
    start, update = learner.prefetcher.start, learner._update

    def recording_start(tenant, plan, requests, *, step=0):
        events.append(("ask", tenant, step))
        start(tenant, plan, requests, step=step)

    def recording_update(rt, work, scorer):
        events.append(("train", rt.spec.name, rt.step + 1))
        return update(rt, work, scorer)

    learner.prefetcher.start, learner._update = recording_start, recording_update
    records = []
    run(cfg, model_path=tiny_model, learner=learner, max_steps=6, progress=False, on_step=records.append)

    assert sorted((r.tenant, r.step) for r in records) == [(t, k) for t in "abc" for k in (1, 2)]
    second_round = events[events.index(("train", "c", 1)) + 1:]
    assert [e[0] for e in second_round[:6]] == ["ask"] * 3 + ["train"] * 3, events
    assert {e[1:] for e in second_round[:3]} == {(t, 3) for t in "abc"}  # step 3's batches, while steps 2 train
    for r in records:  # the wait for the others' collecting is the round's, not the step's
        assert sum(r.timings[k] for k in ("wait", "score", "train", "probe", "publish", "other")) == pytest.approx(
            r.timings["total"], abs=1e-6)


def test_a_round_whose_batched_probe_fails_probes_one_tenant_at_a_time(tiny_model, tmp_path, monkeypatch, caplog):
    from learner.policy import Policy

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Write a number.\nhello\n")

    def broken(self, groups, **kw):
        raise RuntimeError("out of memory in the batched decode")

    monkeypatch.setattr(Policy, "generate_grouped", broken)
    data_dir = tmp_path / "data"
    learner = learn(_round_config(data_dir, tiny_model, prompts, 3), tiny_model, until_idle=False, max_steps=3)
    assert "probing them one at a time" in caplog.text
    assert {t: learner.tenants[t].step for t in "abc"} == {"a": 1, "b": 1, "c": 1}
    assert all(v.gate["probe_rewards"] is not None for t in "abc" for v in Registry(data_dir).versions(t))


def test_a_failing_step_in_a_round_leaves_the_other_tenants_steps_to_finish(tiny_model, tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Write a number.\nhello\n")
    cfg = _round_config(tmp_path / "data", tiny_model, prompts, 3)
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    real = Learner._update

    def failing_for_b(self, rt, work, scorer):
        if rt.spec.name == "b":
            with torch.no_grad():  # part-way through: the weights moved, then it failed
                for _, p in self.policy._params["b"]:
                    p.add_(1.0)
            raise RuntimeError("b's update failed")
        return real(self, rt, work, scorer)

    monkeypatch.setattr(Learner, "_update", failing_for_b)
    learner._ensure_loaded(learner.tenants["b"])  # its adapter exists before the round, to compare after
    before = learner.policy.snapshot("b")
    records = learner.step_round(["a", "b", "c"])
    assert [r is not None for r in records] == [True, False, True]
    assert learner.tenants["b"].status == "error" and "b's update failed" in learner.tenants["b"].error
    assert learner.tenants["b"].step == 0 and learner.tenants["a"].step == learner.tenants["c"].step == 1
    assert all(torch.equal(p, before.weights[n]) for n, p in learner.policy._params["b"]), "b's failed update stayed"
    learner.close()


@pytest.mark.parametrize("round_tenants, resident", [(1, 1), (2, 1), (3, 1), (1, 2)])
def test_tenants_unloaded_past_max_resident_tenants_learn_what_tenants_always_loaded_learn(
        tiny_model, tmp_path, monkeypatch, round_tenants, resident):
    """learner.max_resident_tenants bounds the adapters and optimizers in memory: a tenant unloaded for
    another's step comes back from its checkpoint, its optimizer's moments included, and learns exactly what
    it would have learned loaded throughout, with the gate's cached parent probe kept (no extra decode). A
    round keeps all of its tenants loaded, whatever the limit."""
    from learner.policy import Policy

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Write a number.\nTell me about cats.\nhello\nCount to five.\n")
    decodes, unloads = [], []
    real, real_remove = Policy.generate_grouped, Policy.remove_tenant

    def counted(self, groups, **kw):
        decodes.append(sorted(tenant for tenant, _ in groups))
        return real(self, groups, **kw)

    def remove_tenant(self, tenant):
        unloads.append(tenant)
        return real_remove(self, tenant)

    monkeypatch.setattr(Policy, "generate_grouped", counted)
    monkeypatch.setattr(Policy, "remove_tenant", remove_tenant)
    outcome, seen = {}, {}
    for limit in (0, resident):
        data_dir = tmp_path / f"resident-{limit}"
        cfg = _round_config(data_dir, tiny_model, prompts, round_tenants, max_resident_tenants=limit)
        learner = Learner(cfg, model_path=tiny_model, progress=False)
        loaded = []
        torch.manual_seed(0)
        decodes.clear()
        learn(cfg, tiny_model, learner=learner, until_idle=False, max_steps=9,
              on_step=lambda record: loaded.append(len(learner.policy.tenants)))
        registry = Registry(data_dir)
        outcome[limit] = {
            "steps": sorted((r["tenant"], r["step"], r["loss"], r["n_trajectories"])
                            for r in read_dataset(data_dir, "train_steps").to_pylist()),
            "gate": {t: [(v.status, v.gate["probe_rewards"], v.gate["parent_probe_rewards"]) for v in registry.versions(t)]
                     for t in "abc"},
            "weights": {t: [(v.path / ADAPTER_WEIGHTS).read_bytes() for v in registry.versions(t)] for t in "abc"},
            "decodes": sorted(map(tuple, decodes)),
        }
        seen[limit] = loaded
    assert [s[:2] for s in outcome[0]["steps"]] == [(t, k) for t in "abc" for k in (1, 2, 3)]
    assert outcome[resident] == outcome[0]
    assert max(seen[0]) == 3
    assert max(seen[resident]) == max(resident, round_tenants), seen[resident]
    assert bool(unloads) == (max(resident, round_tenants) < 3), "unloaded exactly when 3 tenants do not fit"


def test_a_tenant_unloaded_after_following_a_rollback_follows_it_again_when_it_comes_back(tiny_model, data_dir):
    """An operator's rollback, followed by a step that then found no work, changed the adapter without a
    checkpoint: unloaded, the tenant comes back with its checkpoint's weights, and follows the rollback again
    before it trains (not the checkpoint's weights taken for the served version's)."""
    write(data_dir, "acme", rows("a", 16), "b0")
    write(data_dir, "beta", rows("b", 8, seed=1), "b0")
    tenants = [{"name": "acme", "batch_size": 8}, {"name": "beta", "batch_size": 8}]
    learner = Learner(make_config(data_dir, tiny_model, tenants, max_resident_tenants=1), model_path=tiny_model,
                      progress=False)
    assert learner.step("acme").version == "acme@1"
    assert learner.step("beta").version == "beta@1" and learner.policy.tenants == ["beta"]
    assert learner.step("acme").version == "acme@2" and learner.policy.tenants == ["acme"]
    Registry(data_dir).rollback("acme", 1)  # acme@3 = acme@1's files
    assert learner.step("acme") is None  # no work: it followed acme@3 and stopped there
    assert learner.tenants["acme"].version == 3 and learner.policy.tenants == ["acme"]
    write(data_dir, "beta", rows("c", 8, seed=2), "b1", start=100)
    assert learner.step("beta").version == "beta@2"  # acme unloaded
    assert learner.policy.tenants == ["beta"]
    write(data_dir, "acme", rows("d", 8, seed=5), "b1", start=100)
    followed = []
    real = learner._load_published
    learner._load_published = lambda rt, published: (followed.append(published.name), real(rt, published))
    record = learner.step("acme")
    learner.close()
    assert followed == ["acme@3"]
    assert record.version == "acme@4" and Registry(data_dir).get("acme", 4).parent == "acme@3"


def test_a_stop_during_a_rounds_training_finishes_the_steps_trained_and_leaves_the_others(tiny_model, tmp_path,
                                                                                       monkeypatch):
    """The whole round trained before any step committed, however long: with eight tenants on a real model
    a stop could outlast its time limit, and the kill then lost every step of the round."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Write a number.\nhello\n")
    cfg = _round_config(tmp_path / "data", tiny_model, prompts, 3)
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    real = Learner._update
    trained = []

    def stopped_during_the_first(self, rt, work, scorer):
        trained.append(rt.spec.name)
        self.stop.set()  # SIGTERM while the round's first tenant trains
        return real(self, rt, work, scorer)

    monkeypatch.setattr(Learner, "_update", stopped_during_the_first)
    records = learner.step_round(["a", "b", "c"])
    assert trained == ["a"] and [r is not None for r in records] == [True, False, False]
    assert [learner.tenants[t].step for t in "abc"] == [1, 0, 0]
    assert Cursors(tmp_path / "data").latest_step("b") is None and Registry(tmp_path / "data").versions("b") == []
    learner.close()


def test_round_robin_rounds_still_give_a_tenant_that_cannot_be_a_partner_its_turn(tiny_model, data_dir):
    """Partners wrapped round the eligible tenants and left the turn just before the main pick, which was
    then the same tenant every round: a tenant scored by feedback (no gate probe, so no partner) never had
    another step once eight probe-able tenants were busy."""
    tenants = [{"name": f"app{i}", "scorer": "length:20"} for i in range(8)] + [{"name": "support-bot"}]
    cfg = make_config(data_dir, tiny_model, tenants, scheduler="round_robin", gate_prompts=2, round_tenants=8)
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    backlog = {t["name"]: 8 for t in tenants}
    rounds = []
    for _ in range(20):
        first = learner.choose(backlog)
        rounds.append([first, *learner.round_partners(first, backlog)])
    learner.close()
    led_by_support = [i for i, names in enumerate(rounds) if names[0] == "support-bot"]
    assert len(led_by_support) >= 2 and max(b - a for a, b in zip(led_by_support, led_by_support[1:])) <= 9, rounds
    for tenant in tenants:  # each takes a step in at least every other round
        assert sum(tenant["name"] in names for names in rounds) >= 10, (tenant["name"], rounds)


def test_round_partners_keep_fair_share_balancing_learner_time(tiny_model, data_dir):
    """Partners are picked among fewer tenants than the main pick; the fair-share floor stays the main pick's,
    so a tenant far below the others in learner time keeps its credit."""
    from learner.scheduler import Ledger, choose

    tenants = [{"name": t, "scorer": "length:20"} for t in "abcd"]
    cfg = make_config(data_dir, tiny_model, tenants, scheduler="fair_share", gate_prompts=2, round_tenants=2)
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    backlog = dict.fromkeys("abcd", 8)
    learner.ledger = Ledger(seconds={"a": 0.0, "b": 5.0, "c": 100.0, "d": 50.0}, floor=0.0)
    first = learner.choose(backlog)
    assert (first, learner.round_partners(first, backlog)) == ("a", ["b"])
    assert learner.ledger.floor == 0.0 and learner.ledger.seconds["a"] == 0.0
    # the next pick is still "a" (least time), not a tenant lifted past it
    assert choose("fair_share", backlog, learner.ledger)[0] == "a"
    learner.close()
