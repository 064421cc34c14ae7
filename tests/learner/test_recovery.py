"""A tenant's learner state that is damaged or half-recovered: the learner trains nothing on it until it is
sound again, and consumes no trajectory while it refuses (tiny model, real files)."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from learner.loop import Learner, run
from learner_support import make_config, rows, write
from storage.cursors import Cursors
from storage.registry import Registry

pytestmark = pytest.mark.unit  # the tiny model in this process: no broker, no engine


def learn(cfg, model, **kw):
    return run(cfg, model_path=model, progress=False, until_idle=True, **kw)


def published(data_dir, tenant="acme") -> list[int]:
    return [v.number for v in Registry(data_dir).versions(tenant) if v.status == "published"]


def trained(data_dir, tiny_model, n_rows: int):
    """The config of tenant acme (batches of 8, a gate that passes any KL) after training `n_rows` rows."""
    write(data_dir, "acme", rows("a", n_rows), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}], gate_max_kl=1000.0)
    learn(cfg, tiny_model).close()
    return cfg


def spoil_one_weight(weights, value: float) -> None:
    """Writes `value` (NaN, inf) into one weight of a safetensors file: it still parses."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    next(iter(tensors.values())).view(-1)[0] = value
    save_file(tensors, weights)


def stepped(learner: Learner, tenant="acme"):
    learner.pending(hold_partial=False)
    return learner.step_safely(tenant)


def test_a_damaged_settled_version_record_counts_as_served_for_staleness(tiny_model, data_dir):
    """It raised out of reading the served versions, which then stayed empty: samples many versions behind
    trained. Counted as served, samples look staler than they may be, never fresher."""
    write(data_dir, "acme", rows("a", 24), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}], max_staleness=1, gate_max_kl=1000.0,
                      keep_versions=1)
    learn(cfg, tiny_model).close()
    assert [v.status for v in Registry(data_dir).versions("acme")] == ["retired", "retired", "published"]
    (data_dir / "registry" / "acme" / "1.json").write_text("{ damaged")  # settled: only staleness reads it
    write(data_dir, "acme", rows("from1", 8, seed=3, adapter_version="acme@1"), "b1", start=100)  # 2 behind
    learner = learn(cfg, tiny_model)
    rt = learner.tenants["acme"]
    assert rt.error is None and rt.served == [1, 2, 3]
    assert Registry(data_dir).numbers("acme") == [1, 2, 3]  # no acme@4: every sample stale
    assert Cursors(data_dir).backlog()["acme"] == 0  # dropped as stale, and committed
    learner.close()


def test_a_damaged_record_of_a_live_version_stops_the_tenant_until_mended(tiny_model, data_dir):
    """The first step failed on it; the second trained with no served versions known, samples 2 behind
    included."""
    write(data_dir, "acme", rows("a", 24), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}], max_staleness=1, gate_max_kl=1000.0)
    learn(cfg, tiny_model).close()
    record = data_dir / "registry" / "acme" / "2.json"
    sound = record.read_bytes()
    record.write_text("{ damaged")
    write(data_dir, "acme", rows("from1", 8, seed=3, adapter_version="acme@1"), "b1", start=100)  # 2 behind
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    for _ in range(2):
        learner.tenants["acme"].retry_at = 0
        assert stepped(learner) is None and str(record) in learner.tenants["acme"].error
    assert Cursors(data_dir).backlog()["acme"] == 8 and Registry(data_dir).numbers("acme") == [1, 2, 3]
    record.write_bytes(sound)
    learner.tenants["acme"].retry_at = 0
    stepped(learner)
    assert learner.tenants["acme"].error is None and learner.tenants["acme"].served[-2:] == [2, 3]
    assert Cursors(data_dir).backlog()["acme"] == 0 and Registry(data_dir).numbers("acme") == [1, 2, 3]
    learner.close()


def test_a_recovery_that_failed_twice_is_completed_before_the_next_step_trains(tiny_model, data_dir, monkeypatch):
    """Its finish failed at the take-over and again at the load: the next step finished it but never read the
    served versions, and trained samples many versions behind."""
    write(data_dir, "acme", rows("a", 24), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8}], max_staleness=1, gate_max_kl=1000.0)
    learn(cfg, tiny_model).close()
    finish, failures = Learner._finish, []

    def fails_twice(self, rt, meta):
        if len(failures) < 2:
            failures.append(meta["step"])
            raise OSError(28, "No space left on device")
        return finish(self, rt, meta)

    monkeypatch.setattr(Learner, "_finish", fails_twice)
    write(data_dir, "acme", rows("from1", 8, seed=3, adapter_version="acme@1"), "b1", start=100)  # 2 behind
    learner = Learner(cfg, model_path=tiny_model, progress=False)  # the take-over's finish fails
    assert stepped(learner) is None and "No space left" in learner.tenants["acme"].error  # the load's does too
    stepped(learner)
    assert failures == [3, 3] and learner.tenants["acme"].error is None
    assert learner.tenants["acme"].served[-2:] == [2, 3]
    assert published(data_dir) == [1, 2, 3]  # the stale batch trained nothing
    learner.close()


def test_a_served_version_above_a_lowered_gate_max_kl_stops_training_without_spending_batches(tiny_model, data_dir):
    cfg = trained(data_dir, tiny_model, 8)
    kl = Registry(data_dir).get("acme", 1).gate["kl"]
    assert kl > 0
    write(data_dir, "acme", rows("b", 8, seed=1), "b1", start=100)
    lowered = make_config(data_dir, tiny_model, [{"name": "acme", "batch_size": 8, "gate_max_kl": kl / 2}])
    learner = Learner(lowered, model_path=tiny_model, progress=False)
    assert stepped(learner) is None
    error = learner.tenants["acme"].error
    assert f"the served acme@1 is {kl:.4g} nats from the base model, above gate_max_kl {kl / 2:g}" in error
    assert Cursors(data_dir).backlog()["acme"] == 8 and Registry(data_dir).numbers("acme") == [1]  # nothing spent
    learner.close()


def test_a_damaged_checkpoint_is_set_aside_and_the_tenant_goes_on_from_the_one_before(tiny_model, data_dir, caplog):
    """Non-finite weights loaded silently (every step then rejected by the gate and its batch spent); a
    checkpoint that would not load blocked its tenant until someone moved it; and with the newest checkpoint
    gone, the learner numbered its steps from the one before, so every commit failed."""
    cfg = trained(data_dir, tiny_model, 16)
    step, checkpoint = Cursors(data_dir).latest_checkpoint("acme")
    assert step == 2 and published(data_dir) == [1, 2]
    weights = checkpoint / "adapter" / "adapter_model.safetensors"
    spoil_one_weight(weights, math.nan)
    write(data_dir, "acme", rows("b", 8, seed=1), "b1", start=100)

    learner = learn(cfg, tiny_model)
    rt = learner.tenants["acme"]
    assert rt.error is None and rt.step == 3 and Cursors(data_dir).latest_step("acme") == 3
    assert published(data_dir) == [1, 2, 3] and Registry(data_dir).get("acme", 3).parent == "acme@2"
    assert Cursors(data_dir).backlog()["acme"] == 0
    (aside,) = (data_dir / "state" / "damaged-checkpoints" / "acme").iterdir()
    assert aside.name.startswith("step-00000000000000000002-") and (aside / "adapter" / "adapter_model.safetensors").exists()
    assert "the checkpoint of step 2 is damaged" in caplog.text and "holds non-finite weights" in caplog.text
    status = json.loads((data_dir / "state" / "learner" / "status.json").read_text())
    assert status["acme"]["damaged_checkpoints_set_aside"] == [str(aside)]
    assert Cursors(data_dir).latest_checkpoint("acme")[0] == 3  # the new step's
    learner.close()


@pytest.mark.parametrize("lost", ["optimizer.pt", "adapter/adapter_model.safetensors", "adapter/adapter_config.json"])
def test_a_checkpoint_missing_a_file_is_set_aside_as_damaged(tiny_model, data_dir, lost):
    """A committed checkpoint is written whole: a file gone from it (deleted by hand, lost by the disk) is
    damage, not a disk error to wait out; it blocked the tenant until someone moved the checkpoint."""
    cfg = trained(data_dir, tiny_model, 16)
    step, checkpoint = Cursors(data_dir).latest_checkpoint("acme")
    assert step == 2
    (checkpoint / lost).unlink()
    write(data_dir, "acme", rows("b", 8, seed=1), "b1", start=100)
    learner = learn(cfg, tiny_model)
    rt = learner.tenants["acme"]
    assert rt.error is None and rt.step == 3 and published(data_dir) == [1, 2, 3]
    assert Registry(data_dir).get("acme", 3).parent == "acme@2" and Cursors(data_dir).backlog()["acme"] == 0
    (aside,) = (data_dir / "state" / "damaged-checkpoints" / "acme").iterdir()
    assert not (aside / lost).exists() and aside.name.startswith("step-00000000000000000002-")
    learner.close()


def test_a_checkpoint_of_a_newer_format_is_not_called_damaged_and_nothing_stays_half_loaded(tiny_model, data_dir):
    """Only damaged content is damaged: a checkpoint another clora wrote is not to be moved away."""
    cfg = trained(data_dir, tiny_model, 8)
    _, checkpoint = Cursors(data_dir).latest_checkpoint("acme")
    record = checkpoint / "learner.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "format": 99}))
    write(data_dir, "acme", rows("b", 8, seed=1), "b1", start=100)
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    assert stepped(learner) is None
    error = learner.tenants["acme"].error
    assert "has format 99" in error and "damaged" not in error and "move" not in error
    assert not learner.policy.has("acme") and Cursors(data_dir).backlog()["acme"] == 8
    learner.close()


def test_a_served_version_with_non_finite_weights_is_not_loaded_from_the_registry(tiny_model, data_dir):
    """With no checkpoint (a cursor deleted to train the tenant again from its served adapter), the learner
    loaded the served version unchecked, and every step from it was rejected with its batch spent."""
    cfg = trained(data_dir, tiny_model, 8)
    shutil.rmtree(data_dir / "cursors" / "acme")
    weights = Registry(data_dir).get("acme", 1).path / "adapter_model.safetensors"
    spoil_one_weight(weights, math.inf)
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    assert stepped(learner) is None
    assert "the served acme@1 holds non-finite weights" in learner.tenants["acme"].error
    assert Cursors(data_dir).backlog()["acme"] == 8 and Registry(data_dir).numbers("acme") == [1]
    learner.close()


def test_the_only_checkpoint_damaged_goes_on_from_the_served_version(tiny_model, data_dir):
    """Its record unreadable too: the step's version was published already, and is followed."""
    cfg = trained(data_dir, tiny_model, 8)
    step, checkpoint = Cursors(data_dir).latest_checkpoint("acme")
    assert step == 1 and published(data_dir) == [1]
    (checkpoint / "learner.json").write_text("{ damaged")
    (checkpoint / "optimizer.pt").write_bytes(b"\x80\x02garbage")
    write(data_dir, "acme", rows("b", 8, seed=1), "b1", start=100)
    learner = learn(cfg, tiny_model)
    rt = learner.tenants["acme"]
    assert rt.error is None and rt.step == 2 and published(data_dir) == [1, 2]
    assert Registry(data_dir).get("acme", 2).parent == "acme@1" and Cursors(data_dir).backlog()["acme"] == 0
    assert len(list((data_dir / "state" / "damaged-checkpoints" / "acme").iterdir())) == 1
    learner.close()


def test_a_device_error_while_loading_sets_no_checkpoint_aside(tiny_model, data_dir, monkeypatch):
    """Out of memory (or a CUDA fault) says nothing of the file: the checkpoint stays, the step fails."""
    import torch

    from learner.policy import Policy

    cfg = trained(data_dir, tiny_model, 8)

    def out_of_memory(self, tenant, directory):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Policy, "load_checkpoint", out_of_memory)
    write(data_dir, "acme", rows("b", 8, seed=1), "b1", start=100)
    learner = Learner(cfg, model_path=tiny_model, progress=False)
    assert stepped(learner) is None and "out of memory" in learner.tenants["acme"].error
    assert Cursors(data_dir).latest_checkpoint("acme")[0] == 1
    assert not (data_dir / "state" / "damaged-checkpoints").exists() and Cursors(data_dir).backlog()["acme"] == 8
    learner.close()
