"""Several learner processes on one data directory: `Shard` deals the tenants out, and a per-tenant lock
keeps any two learners from stepping one tenant (learner/loop.py `_claim`). Real learners on the tiny model
and real Parquet trajectories; two learners in one test process hold their locks as two processes would
(flock locks belong to open files)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from learner.loop import Learner, run
from learner.types import Shard
from learner_support import assert_each_id_once, chat_prompt, make_config, rows, write
from storage.registry import Registry


pytestmark = pytest.mark.unit

TENANTS = ["ant", "bee", "cat", "dog"]


def test_shard_parsing_and_every_tenant_has_exactly_one_owner():
    assert Shard.parse("1/3") == Shard(1, 3)
    for bad in ("3/3", "-1/2", "1", "a/b", "1/0", ""):
        with pytest.raises(ValueError, match="K/N"):
            Shard.parse(bad)
    configured = [f"tenant-{i}" for i in range(8)]
    shards = [Shard(k, 3) for k in range(3)]
    dealt = shards[0].deal(configured)
    assert all(s.deal(reversed(configured)) == dealt for s in shards)  # every process agrees, whatever the order
    owned = Counter(k for name in configured for k, s in enumerate(shards) if s.owns(name, dealt))
    assert sorted(owned.values()) == [2, 3, 3]  # configured tenants: balanced
    for name in [*configured, *(f"from-storage-{i}" for i in range(50))]:
        assert sum(s.owns(name, dealt) for s in shards) == 1
    walk_ins = Counter(shards[0].ranking(f"from-storage-{i}")[0] for i in range(300))
    assert set(walk_ins) == {0, 1, 2} and min(walk_ins.values()) > 60  # tenants only in storage: spread by hash


def test_a_config_change_moves_few_tenants_between_shards():
    """Adding or removing one tenant moves few of the others (each move is a checkpoint reload on another
    process); dealing by name order would move about half of them."""
    for count, total in ((2, 8), (4, 40)):
        shard = Shard(0, count)
        for trial in range(20):
            names = [f"t{trial}-{i}" for i in range(total)]
            before = shard.deal(names)
            for after in (shard.deal([*names, f"t{trial}-new"]), shard.deal(names[1:])):
                moved = sum(before[n] != after[n] for n in after if n in before)
                assert moved <= total // 4, (count, trial, moved)
                loads = Counter(after.values())
                assert max(loads.values()) - min(loads.values()) <= 1 and len(loads) == count  # still balanced


def test_two_learner_shards_split_the_tenants_and_train_every_trajectory_once(tiny_model, data_dir):
    for i, tenant in enumerate([*TENANTS, "walk-in"]):  # walk-in: only in storage (ingest created it)
        write(data_dir, tenant, rows(tenant, 8, seed=i), f"{tenant}0")
    cfg = make_config(data_dir, tiny_model, [{"name": t, "batch_size": 8} for t in TENANTS])
    marks = {}  # each shard's own readiness marker, looked at while it runs (a clean stop removes it)

    def look(k):
        return lambda record: marks.setdefault(k, (Path(data_dir) / "state" / "ready" / f"learner-{k}-of-2.json").exists())

    learners = [run(cfg, model_path=tiny_model, until_idle=True, progress=False, shard=Shard(k, 2), on_step=look(k))
                for k in range(2)]
    trained = [{name for name, rt in learner.tenants.items() if rt.step > 0} for learner in learners]
    assert trained[0].isdisjoint(trained[1])
    assert trained[0] | trained[1] == {*TENANTS, "walk-in"}
    assert len(trained[0] & set(TENANTS)) == len(trained[1] & set(TENANTS)) == 2
    reg = Registry(data_dir)
    for tenant in [*TENANTS, "walk-in"]:
        assert reg.latest_published(tenant).number == 1
        assert_each_id_once(data_dir, tenant, {f"{tenant}{i}" for i in range(8)})
    for k in range(2):  # each shard has its own status file and readiness marker
        status = json.loads((Path(data_dir) / "state" / "learner" / f"status-{k}-of-2.json").read_text())
        assert set(status) == trained[k]
        assert marks[k] and not (Path(data_dir) / "state" / "ready" / f"learner-{k}-of-2.json").exists()


def test_a_second_learner_waits_for_the_tenants_lock_and_then_takes_over(tiny_model, data_dir):
    """Two unsharded learners on one tenant. While the first holds it, the second trains nothing and leaves
    the first's step in flight alone (its candidate is not "abandoned"); once the first lets go, the second
    takes over (rejecting that candidate, which no commit references) and trains; when the first takes the
    tenant back it continues from the second's version, not from its own stale memory."""
    write(data_dir, "ant", rows("a", 8), "a0")
    cfg = make_config(data_dir, tiny_model, [{"name": "ant", "batch_size": 8}])
    first = Learner(cfg, model_path=tiny_model, progress=False)  # holds "ant" from here on
    first._ensure_loaded(first.tenants["ant"])
    in_flight = Registry(data_dir).create("ant", parent=None, write=lambda d: first.policy.save_adapter("ant", d))

    second = run(cfg, model_path=tiny_model, until_idle=True, progress=False)
    assert second.tenants["ant"].step == 0 and second.tenants["ant"].status == "elsewhere"
    assert Registry(data_dir).get("ant", in_flight.number).status == "candidate"  # not the second's to judge

    first.close()  # the first process stops mid-step
    run(cfg, model_path=tiny_model, until_idle=True, progress=False, learner=second)
    reg = Registry(data_dir)
    assert reg.get("ant", in_flight.number).status == "rejected"
    assert second.tenants["ant"].step == 1 and reg.latest_published("ant").number == in_flight.number + 1

    write(data_dir, "ant", rows("b", 8, seed=1), "a1", start=100)
    first.pending()  # takes it back: the adapter it had in memory is stale now
    first._ensure_loaded(first.tenants["ant"])
    ids = first.policy.tokenizer(chat_prompt("hi") + "12 cats", return_tensors="pt").input_ids
    with torch.no_grad():
        first.policy.use("ant")
        second.policy.use("ant")
        assert torch.equal(first.policy.model(input_ids=ids).logits, second.policy.model(input_ids=ids).logits)
    run(cfg, model_path=tiny_model, until_idle=True, progress=False, learner=first)
    latest = Registry(data_dir).latest_published("ant")
    assert first.tenants["ant"].step == 2
    assert latest.parent == f"ant@{in_flight.number + 1}"  # from the second learner's version
    assert_each_id_once(data_dir, "ant", {f"a{i}" for i in range(8)} | {f"b{i}" for i in range(8)})


def test_two_unsharded_learners_share_one_status_file(tiny_model, data_dir):
    write(data_dir, "ant", rows("a", 8), "a0")
    write(data_dir, "bee", rows("b", 8, seed=1), "b0")
    cfg = make_config(data_dir, tiny_model, [{"name": "ant", "batch_size": 8}, {"name": "bee", "batch_size": 8}])
    from storage.files import HeldLock

    bee = HeldLock.try_acquire(Path(data_dir) / "locks" / "learner" / "bee.lock")  # held while the first starts
    first = Learner(cfg, model_path=tiny_model, progress=False)  # takes ant
    bee.release()
    second = Learner(cfg, model_path=tiny_model, progress=False)  # takes bee
    assert set(first._locks) == {"ant"} and set(second._locks) == {"bee"}

    def train_what_it_holds(learner):
        while (name := learner.choose(learner.pending(hold_partial=False))) is not None:
            learner.step_safely(name)

    train_what_it_holds(second)
    train_what_it_holds(first)  # writes last, and sees bee only as "elsewhere"
    assert first.tenants["bee"].status == second.tenants["ant"].status == "elsewhere"
    status = json.loads((Path(data_dir) / "state" / "learner" / "status.json").read_text())
    # each tenant's entry is its trainer's, whichever process wrote last
    assert {name: (e["status"], e["version"]) for name, e in status.items()} == {
        "ant": ("published", "ant@1"), "bee": ("published", "bee@1")}
    # A tenant the writer does not hold, with an entry that is not "elsewhere" (not tried yet, or backing off
    # from a lock it could not take): its trainer's entry stays. It was replaced by the writer's view.
    first.tenants["bee"].status = "idle"
    first._save_status()
    status = json.loads((Path(data_dir) / "state" / "learner" / "status.json").read_text())
    assert (status["bee"]["status"], status["bee"]["version"]) == ("published", "bee@1")
    first.close()
    second.close()


def test_a_config_reload_that_deals_a_tenant_elsewhere_lets_go_of_it(tiny_model, data_dir):
    from storage.files import HeldLock

    cfg = make_config(data_dir, tiny_model, [{"name": t} for t in TENANTS])
    learner = Learner(cfg, model_path=tiny_model, progress=False, shard=Shard(0, 2))
    learner.pending()  # takes its tenants' locks
    dealt = Shard(0, 2).deal(TENANTS)
    mine = {t for t in TENANTS if dealt[t] == 0}
    assert set(learner.tenants) == mine and len(mine) == 2
    for name in mine:
        assert HeldLock.try_acquire(Path(data_dir) / "locks" / "learner" / f"{name}.lock") is None  # held

    # a config of shard 0's two tenants alone: one of them must now go to shard 1 (one tenant per shard)
    learner.apply_config(make_config(data_dir, tiny_model, [{"name": t} for t in sorted(mine)]))
    learner.pending()
    (kept,) = {t for t, k in Shard(0, 2).deal(mine).items() if k == 0}
    (moved,) = mine - {kept}
    assert set(learner.tenants) == {kept}
    freed = HeldLock.try_acquire(Path(data_dir) / "locks" / "learner" / f"{moved}.lock")
    assert freed is not None  # shard 1 can take it now
    freed.release()
    learner.close()
