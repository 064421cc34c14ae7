"""storage.registry: version lifecycle, keep-last-K, rollback, and no partial version under crashes or races."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from storage import registry
from storage.registry import MAX_SKIP, Registry, RegistryError, UnreadableRecord, VersionNotFound, parse_version

pytestmark = pytest.mark.unit


def _new(reg: Registry, peft_writer, tenant: str = "acme", parent: str | None = None, **kw):
    return reg.create(tenant, parent=parent, write=peft_writer, **kw)


def test_create_is_a_candidate_with_peft_files(data_dir, peft_writer):
    reg = Registry(data_dir)
    v = _new(reg, peft_writer, metrics={"reward": 0.4}, trajectory_range={"from": "2025-01-01", "n": 16})
    assert (v.name, v.number, v.status, v.parent) == ("acme@1", 1, "candidate", None)
    assert v.path == data_dir / "adapters" / "acme" / "1"
    assert sorted(p.name for p in v.path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert reg.get("acme", 1) == v
    assert reg.get("acme", 1).metrics == {"reward": 0.4}
    assert reg.latest_published("acme") is None and reg.published() == {}
    v2 = _new(reg, peft_writer, parent=v.name)
    assert (v2.number, v2.parent) == (2, "acme@1")
    assert [x.name for x in reg.versions()] == ["acme@1", "acme@2"]
    record = json.loads((data_dir / "registry" / "acme" / "2.json").read_text())
    assert record["format"] == 1


def test_numbers_are_per_tenant(data_dir, peft_writer):
    reg = Registry(data_dir)
    assert [_new(reg, peft_writer, t).name for t in ("a", "b", "a")] == ["a@1", "b@1", "a@2"]
    assert [v.name for v in reg.versions("a")] == ["a@1", "a@2"]


def test_publish_reject_and_status_rules(data_dir, peft_writer):
    reg = Registry(data_dir)
    _new(reg, peft_writer)
    _new(reg, peft_writer, parent="acme@1")
    published = reg.publish("acme", 1, gate={"kl": 0.1, "passed": True})
    assert published.status == "published" and published.published_at is not None
    assert published.gate == {"kl": 0.1, "passed": True}
    rejected = reg.reject("acme", 2, reason="reward fell 0.3 below parent", gate={"passed": False})
    assert (rejected.status, rejected.reason) == ("rejected", "reward fell 0.3 below parent")
    assert reg.latest_published("acme").name == "acme@1"
    assert reg.published()["acme"].name == "acme@1"
    with pytest.raises(RegistryError, match="acme@2: it is rejected"):
        reg.publish("acme", 2)
    with pytest.raises(RegistryError, match="acme@1: it is published"):
        reg.reject("acme", 1, reason="late")


def test_missing_version_error_names_it(data_dir):
    reg = Registry(data_dir)
    with pytest.raises(VersionNotFound, match="acme@7") as e:
        reg.get("acme", 7)
    assert isinstance(e.value, KeyError)
    assert str(e.value) == "adapter version acme@7 does not exist"
    with pytest.raises(VersionNotFound, match="acme@9"):
        reg.create("acme", parent="acme@9", write=lambda d: None)


def test_incomplete_or_failing_write_leaves_nothing(data_dir, peft_writer):
    reg = Registry(data_dir)
    with pytest.raises(RegistryError, match="adapter_model.safetensors"):
        reg.create("acme", parent=None, write=lambda d: (d / "adapter_config.json").write_text("{}"))

    def boom(d):
        peft_writer(d)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        reg.create("acme", parent=None, write=boom)
    assert reg.versions() == []
    assert list((data_dir / "adapters" / "acme").iterdir()) == []
    assert _new(reg, peft_writer).number == 1


def test_generation_increases_on_every_change(data_dir, peft_writer):
    reg = Registry(data_dir)
    seen = [reg.generation()]
    _new(reg, peft_writer)
    seen.append(reg.generation())
    reg.publish("acme", 1)
    seen.append(reg.generation())
    _new(reg, peft_writer, parent="acme@1")
    seen.append(reg.generation())
    reg.publish("acme", 2)
    seen.append(reg.generation())
    _new(reg, peft_writer, parent="acme@2")
    seen.append(reg.generation())
    reg.reject("acme", 3, reason="x")
    seen.append(reg.generation())
    reg.rollback("acme", 1)  # acme@2 is served: a rollback to acme@1 changes something
    seen.append(reg.generation())
    reg.retire("acme", 1)
    seen.append(reg.generation())
    assert seen == sorted(set(seen)), f"generation must strictly increase: {seen}"
    assert Registry(data_dir).generation() == seen[-1], "another process sees the same counter"


def test_keep_last_retires_older_published(data_dir, peft_writer):
    reg = Registry(data_dir, keep_last=2)
    for n in range(1, 5):
        _new(reg, peft_writer, parent=f"acme@{n - 1}" if n > 1 else None)
        reg.publish("acme", n)
    status = {v.number: v.status for v in reg.versions("acme")}
    assert status == {1: "retired", 2: "retired", 3: "published", 4: "published"}
    for n in (1, 2):
        v = reg.get("acme", n)
        assert not v.path.exists() and v.retired_at is not None
        assert v.metrics == {} and v.published_at is not None, "retiring keeps the record"
    assert reg.get("acme", 4).path.exists()
    # Retired by keep_last, then retired by hand: withdrawn (the learner trains none of its samples), which an
    # operator could not say of it before (a retire of a retired version changed nothing).
    assert reg.get("acme", 1).reason != registry.RETIRED_BY_HAND
    assert reg.retire("acme", 1).reason == reg.get("acme", 1).reason == registry.RETIRED_BY_HAND


def test_prune_deletes_old_settled_records_only_and_numbers_go_on(data_dir, peft_writer):
    import os
    import time

    reg = Registry(data_dir, keep_last=2)
    for n in range(1, 9):
        _new(reg, peft_writer)
        reg.publish("acme", n) if n != 7 else reg.reject("acme", n, reason="worse")
    _new(reg, peft_writer)  # 9: a candidate
    settled = [n for n in range(1, 9) if n not in {v.number for v in reg.unsettled("acme")}]
    # retired with their files gone; 5 was retired by 8's publish and stays open until a later change sees
    # its files gone; 6, 8 published, 7 rejected with its files
    assert settled == [1, 2, 3, 4]
    past = time.time() - 3600
    for n in range(1, 10):  # every record an hour old but 3's
        if n != 3:
            os.utime(data_dir / "registry" / "acme" / f"{n}.json", (past, past))

    assert reg.prune("acme", before_s=time.time() - 60, dry_run=True) == 3
    assert len(reg.versions("acme")) == 9
    assert reg.prune("acme", before_s=time.time() - 60) == 3
    assert [v.number for v in reg.versions("acme")] == [3, 5, 6, 7, 8, 9]
    assert reg.latest_published("acme").number == 8 and reg.newest_number("acme") == 9
    assert [v.number for v in reg.candidates("acme")] == [9]
    assert _new(reg, peft_writer).number == 10  # numbers go on after the newest
    (data_dir / "registry" / "acme" / "index.json").unlink()  # without the hint nothing is settled for sure
    assert reg.prune("acme", before_s=time.time() + 60) == 0
    # A hint the disk will not give (EACCES, EIO; here a directory in its place) is an error, not "nothing
    # settled": `clora prune` said 0 and exited 0 while the tenant was never pruned again.
    (data_dir / "registry" / "acme" / "index.json").mkdir()
    for dry_run in (True, False):
        with pytest.raises(IsADirectoryError):
            reg.prune("acme", before_s=time.time() + 60, dry_run=dry_run)
    assert reg.latest_published("acme").number == 8, "the registry's other readers fall back to a listing"


def test_only_the_newest_rejected_versions_keep_their_files(data_dir, peft_writer):
    reg = Registry(data_dir, keep_last=2)
    for n in range(1, 5):
        _new(reg, peft_writer)
        reg.reject("acme", n, reason=f"kl {n}")
    versions = {v.number: v for v in reg.versions("acme")}
    assert {n: v.status for n, v in versions.items()} == {n: "rejected" for n in range(1, 5)}
    for n in (1, 2):
        assert not versions[n].path.exists() and versions[n].retired_at is not None
        assert versions[n].reason == f"kl {n}", "the record of why stays"
    for n in (3, 4):
        assert versions[n].path.exists() and versions[n].retired_at is None


def test_rollback_republishes_old_files_as_newest(data_dir, peft_writer):
    reg = Registry(data_dir, keep_last=5)
    _new(reg, lambda d: peft_writer(d, payload=b"weights-1"), metrics={"reward": 0.7})
    reg.publish("acme", 1)
    _new(reg, lambda d: peft_writer(d, payload=b"weights-2"), parent="acme@1")
    reg.publish("acme", 2)
    back = reg.rollback("acme", 1)
    assert (back.name, back.parent, back.status) == ("acme@3", "acme@1", "published")
    assert back.metrics == {"reward": 0.7}
    assert back.gate == {"rollback_to": "acme@1"}  # no gate KL known for acme@1, none made up
    assert (back.path / "adapter_model.safetensors").read_bytes() == b"weights-1"
    assert reg.latest_published("acme").name == "acme@3"
    assert reg.published()["acme"].name == "acme@3"
    assert reg.get("acme", 1).status == "published", "history is not rewritten"


def test_a_rollback_keeps_the_gate_kl_of_the_version_it_copies(data_dir, peft_writer):
    """The learner refuses to train from a served version whose gate KL is above the tenant's gate_max_kl
    (every candidate would be rejected): a rollback serves the same weights, so it carries their KL."""
    reg = Registry(data_dir, keep_last=5)
    _new(reg, peft_writer)
    reg.publish("acme", 1, gate={"kl": 3.5, "limit_max_kl": 5.0, "reward_delta": 0.1})
    _new(reg, peft_writer, parent="acme@1")
    reg.publish("acme", 2, gate={"kl": 0.5})
    assert reg.rollback("acme", 1).gate == {"rollback_to": "acme@1", "kl": 3.5}


def test_a_rollback_to_old_files_survives_a_concurrent_creates_cleanup(data_dir, peft_writer, monkeypatch):
    """A create removes hidden staging directories over an hour old (a crashed writer's). A rollback's staging
    holds copies of files that may be days old: it must not look that old itself."""
    import storage.registry as registry_module
    from storage.files import remove_stale_hidden

    reg = Registry(data_dir, keep_last=5)
    _new(reg, lambda d: peft_writer(d, payload=b"weights-1"))
    reg.publish("acme", 1)
    _new(reg, lambda d: peft_writer(d, payload=b"weights-2"), parent="acme@1")
    reg.publish("acme", 2)
    two_hours_ago = time.time() - 7200
    for f in [reg.get("acme", 1).path, *reg.get("acme", 1).path.iterdir()]:
        os.utime(f, (two_hours_ago, two_hours_ago))
    real_check = registry_module._check_peft_files
    removed = []

    def learner_creates_meanwhile(directory, tenant):  # the learner's step, between the copy and the rename
        removed.append(remove_stale_hidden(directory.parent, older_than_s=registry_module.STALE_STAGING_S))
        return real_check(directory, tenant)

    monkeypatch.setattr(registry_module, "_check_peft_files", learner_creates_meanwhile)
    back = reg.rollback("acme", 1)
    assert removed == [0] and (back.path / "adapter_model.safetensors").read_bytes() == b"weights-1"


def test_temp_files_a_crashed_record_or_head_write_left_are_swept_by_a_later_create(data_dir, peft_writer, monkeypatch):
    """A SIGKILL inside a record's or HEAD.json's atomic write left its hidden temp file for good. A process
    looks at its first create, then every SWEEP_RECORDS_S (0 here)."""
    monkeypatch.setattr("storage.registry.SWEEP_RECORDS_S", 0.0)
    from storage.files import tmp_name

    reg = Registry(data_dir, keep_last=5)
    _new(reg, peft_writer)
    old = [tmp_name(data_dir / "registry" / "acme" / "2.json"), tmp_name(data_dir / "registry" / "HEAD.json")]
    fresh = tmp_name(data_dir / "registry" / "acme" / "3.json")  # a writer still at it
    two_hours_ago = time.time() - 7200
    for f in [*old, fresh]:
        f.write_bytes(b"{")
    for f in old:
        os.utime(f, (two_hours_ago, two_hours_ago))
    _new(reg, peft_writer)
    assert not any(f.exists() for f in old) and fresh.exists()
    assert [v.number for v in reg.versions("acme")] == [1, 2]


def test_a_folder_left_by_hand_under_registry_is_no_tenant(data_dir, peft_writer):
    reg = Registry(data_dir, keep_last=5)
    _new(reg, peft_writer)
    reg.publish("acme", 1)
    shutil.copytree(data_dir / "registry" / "acme", data_dir / "registry" / "_old")  # a backup, by hand
    assert reg.tenants() == ["acme"]
    _new(reg, peft_writer, parent="acme@1")  # HEAD is rewritten for every tenant: "_old" made this fail
    assert reg.publish("acme", 2).status == "published" and reg.published()["acme"].name == "acme@2"


def test_publish_if_parent_served_refuses_a_candidate_the_operator_overtook(data_dir, peft_writer):
    reg = Registry(data_dir, keep_last=5)
    _new(reg, peft_writer)
    assert reg.publish("acme", 1, if_parent_served=True).status == "published"  # no parent, nothing served
    _new(reg, peft_writer, parent="acme@1")
    assert reg.publish("acme", 2, if_parent_served=True).status == "published"
    _new(reg, peft_writer, parent="acme@2")  # acme@3 trains from acme@2 while ...
    reg.rollback("acme", 1)  # ... the operator rolls back (acme@4)
    v = reg.publish("acme", 3, if_parent_served=True)
    assert v.status == "rejected" and "superseded" in v.reason and "acme@4 is served now" in v.reason
    assert reg.published()["acme"].name == "acme@4"  # the rollback stands
    _new(reg, peft_writer, parent="acme@4")
    reg.retire("acme", 4)  # the same for a retire: acme@2 is served again, not acme@5's parent
    assert reg.publish("acme", 5, if_parent_served=True).status == "rejected"
    assert reg.published()["acme"].name == "acme@2"


def test_a_reader_sees_every_change_another_process_makes(data_dir, peft_writer):
    """Readers keep parsed metadata (checked by a stat per read); a change by another instance (another
    process) is seen at once."""
    reader, writer = Registry(data_dir), Registry(data_dir)
    _new(writer, peft_writer)
    assert reader.get("acme", 1).status == "candidate"
    writer.publish("acme", 1)
    assert reader.get("acme", 1).status == "published" and reader.latest_published("acme").number == 1
    _new(writer, peft_writer, parent="acme@1")
    writer.reject("acme", 2, reason="gate")
    writer.retire("acme", 1)
    assert [(v.number, v.status) for v in reader.versions("acme")] == [(1, "retired"), (2, "rejected")]
    assert reader.latest_published("acme") is None


def test_rollback_refuses_retired_and_never_published(data_dir, peft_writer):
    reg = Registry(data_dir)
    _new(reg, peft_writer)
    with pytest.raises(RegistryError, match="never published"):
        reg.rollback("acme", 1)
    reg.publish("acme", 1)
    reg.retire("acme", 1)
    with pytest.raises(RegistryError, match="files are gone"):
        reg.rollback("acme", 1)


def test_retire_newest_published_falls_back_to_previous(data_dir, peft_writer):
    reg = Registry(data_dir)
    for n in (1, 2):
        _new(reg, peft_writer)
        reg.publish("acme", n)
    reg.retire("acme", 2)
    assert reg.published()["acme"].name == "acme@1"
    assert reg.retire("acme", 2).status == "retired", "retiring twice is harmless"


def test_parse_version():
    from storage.layout import InvalidName
    from storage.registry import RegistryError

    assert parse_version("acme@12") == ("acme", 12)
    for bad in ("acme", "acme@", "@3", "acme@x"):
        with pytest.raises(RegistryError) as e:
            parse_version(bad)
        assert str(e.value) == f"{bad!r} is not a version name; expected <tenant>@<number>, e.g. acme@3"
    with pytest.raises(InvalidName, match="tenant 'a/b' is not a valid tenant name"):
        parse_version("a/b@1")


# ---------------------------------------------------------------------------------------------------------
# Crashes and concurrent readers

PUBLISHER = r"""
import sys, time
from pathlib import Path
from storage.registry import Registry

root, count, keep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
reg = Registry(root, keep_last=keep)

def write(d: Path) -> None:
    (d / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    with open(d / "adapter_model.safetensors", "wb") as f:
        for _ in range(16):          # 1 MiB in slow chunks: a wide window to be caught half-written
            f.write(b"\1" * 65536)
            f.flush()
            time.sleep(0.001)

parent = None
for _ in range(count):
    v = reg.create("acme", parent=parent, write=write, metrics={"reward": 0.5})
    reg.publish("acme", v.number, gate={"passed": True})
    parent = v.name
    print(v.name, flush=True)
"""

WEIGHTS_BYTES = 16 * 65536


def _assert_complete(reg: Registry, v) -> None:
    """A visible, non-retired version has all its files; a version without files is marked retired."""
    try:
        ok = (
            json.loads((v.path / "adapter_config.json").read_text())["peft_type"] == "LORA"
            and (v.path / "adapter_model.safetensors").stat().st_size == WEIGHTS_BYTES
        )
    except FileNotFoundError:
        ok = False
    if not ok:
        assert v.status == "retired" or reg.get(v.tenant, v.number).status == "retired", f"{v.name} is half-written"


def test_reader_never_sees_a_half_written_version(data_dir, python_subprocess):
    run, popen = python_subprocess
    publisher = popen(PUBLISHER, str(data_dir), "25", "3")
    reg = Registry(data_dir)
    observations = 0
    try:
        while publisher.poll() is None:
            for v in reg.versions("acme"):
                _assert_complete(reg, v)
                observations += 1
            for v in reg.published().values():
                _assert_complete(reg, v)
    finally:
        publisher.kill()
        out, err = publisher.communicate()
    assert publisher.returncode == 0, err
    assert out.split() == [f"acme@{n}" for n in range(1, 26)]
    assert observations > 5, "the reader should have looked many times while versions were written"
    assert [v.number for v in reg.versions("acme") if v.status == "published"] == [23, 24, 25]


def test_sigkilled_publisher_leaves_no_partial_version(data_dir, python_subprocess):
    run, popen = python_subprocess
    reg = Registry(data_dir, keep_last=3)
    for delay in (0.0, 0.01, 0.03, 0.07, 0.15, 0.3):
        publisher = popen(PUBLISHER, str(data_dir), "1000", "3")
        publisher.stdout.readline()  # one version is out: the publisher is mid-way through the next
        time.sleep(delay)
        publisher.send_signal(signal.SIGKILL)
        publisher.communicate()
        for v in reg.versions("acme"):
            _assert_complete(reg, v)
    # Whatever the kills interrupted, the registry goes on: numbers continue, nothing collides.
    numbers = [v.number for v in reg.versions("acme")]
    assert numbers, "the publisher should have published something before the kills"

    def write(d):
        (d / "adapter_config.json").write_text('{"peft_type": "LORA"}')
        (d / "adapter_model.safetensors").write_bytes(b"\1" * WEIGHTS_BYTES)

    v = reg.create("acme", parent=None, write=write)
    # A kill between a version's files and its record leaves an orphan whose number is not reused (see the
    # next test): the create records it retired and takes the number after it.
    skipped = [x for x in reg.versions("acme") if max(numbers) < x.number < v.number]
    assert all(x.status == "retired" for x in skipped), skipped
    assert v.number == max(numbers) + 1 + len(skipped)
    _assert_complete(reg, v)


CRASH_AFTER_RENAME = r"""
import os, sys
from storage.registry import Registry

reg = Registry(sys.argv[1])
def write(d):
    (d / "adapter_config.json").write_text("{}")
    (d / "adapter_model.safetensors").write_bytes(b"orphan")
# Die at the worst moment: files renamed into adapters/acme/1, metadata not yet written.
reg._write_meta = lambda v: os._exit(9)
reg.create("acme", parent=None, write=write)
"""


def test_crash_between_files_and_metadata_is_invisible_and_repaired(data_dir, python_subprocess, peft_writer):
    """The orphan's number is not reused (its files may be a version whose record was deleted by hand): the
    next create skips it, records it retired and deletes its files."""
    run, _ = python_subprocess
    result = run(CRASH_AFTER_RENAME, str(data_dir))
    assert result.returncode == 9, result.stderr
    assert (data_dir / "adapters" / "acme" / "1" / "adapter_model.safetensors").exists()
    reg = Registry(data_dir)
    assert reg.versions() == [] and reg.published() == {}
    with pytest.raises(VersionNotFound):
        reg.get("acme", 1)
    v = _new(reg, peft_writer)
    assert v.number == 2
    skipped = reg.get("acme", 1)
    assert (skipped.status, skipped.published_at) == ("retired", None) and "number skipped" in skipped.reason
    assert not skipped.path.exists(), "the orphan's files are removed"
    assert sorted(p.name for p in (data_dir / "adapters" / "acme").iterdir()) == ["2"]


# ---------------------------------------------------------------------------------------------------------
# The index hint: operations cost the same however long the history grows, and the hint is never trusted
# beyond what it can promise (missing, corrupt or stale hints give the same answers).


def _count_reads(reg: Registry, monkeypatch) -> list:
    calls = []
    get = reg.get

    def counting(tenant, number):
        calls.append(number)
        return get(tenant, number)

    monkeypatch.setattr(reg, "get", counting)
    return calls


def test_a_publish_reads_only_the_versions_not_yet_settled(data_dir, peft_writer, monkeypatch):
    reg = Registry(data_dir, keep_last=2)
    _new(reg, peft_writer)
    reg.publish("acme", 1)  # kept through the 150 rejects below: an old version that is still open
    for n in range(2, 152):
        _new(reg, peft_writer, parent="acme@1")
        reg.reject("acme", n, reason="probe reward fell")
    reads = _count_reads(reg, monkeypatch)
    _new(reg, peft_writer, parent="acme@1")
    reg.publish("acme", 152)
    # 1 and 152 published, the two kept rejected (150, 151) and 149, whose files the previous reject removed.
    assert sorted(set(reads)) == [1, 149, 150, 151, 152]
    assert reg.latest_published("acme").number == 152
    assert [v.number for v in reg.versions("acme") if v.status == "published"] == [1, 152]
    assert [v.number for v in reg.versions("acme") if v.path.exists()] == [1, 150, 151, 152]


def _truth(reg: Registry) -> dict:
    """Every answer the registry gives, from a full listing (no hint involved)."""
    versions = reg.versions("acme")
    published = [v for v in versions if v.status == "published"]
    return {
        "status": {v.number: (v.status, v.retired_at is not None) for v in versions},
        "files": sorted(v.number for v in versions if v.path.exists()),
        "latest": published[-1].number if published else None,
    }


@pytest.mark.parametrize("hint", ["missing", "corrupt", "stale", "beyond"])
def test_a_missing_corrupt_or_stale_hint_gives_the_same_answers(data_dir, peft_writer, hint):
    reg = Registry(data_dir, keep_last=2)
    index = data_dir / "registry" / "acme" / "index.json"
    for n in range(1, 7):
        _new(reg, peft_writer, parent=None)
        (reg.publish if n % 2 else lambda t, k: reg.reject(t, k, reason="x"))("acme", n)
    old = index.read_bytes()  # an older hint: what a crash or a lost rename leaves
    for n in range(7, 13):
        _new(reg, peft_writer, parent=None)
        (reg.publish if n % 3 else lambda t, k: reg.reject(t, k, reason="x"))("acme", n)
    _new(reg, peft_writer, parent=None)  # a candidate newer than any hint
    expected = _truth(reg)
    if hint == "missing":
        index.unlink()
    elif hint == "corrupt":
        index.write_bytes(b'{"format": 1, "last": "x"')
    elif hint == "stale":
        index.write_bytes(old)
    else:  # naming numbers beyond the newest (metadata deleted by hand)
        index.write_text(json.dumps({"format": 1, "last": 40, "open": [39, 40]}))
    fresh = Registry(data_dir, keep_last=2)
    if hint != "beyond":
        assert fresh.latest_published("acme").number == expected["latest"] == 11
        assert _create_number(fresh, peft_writer) == 14
        fresh.publish("acme", 14)
        assert fresh.latest_published("acme").number == 14
        assert fresh.published()["acme"].number == 14
        after = _truth(fresh)
        assert [n for n, (s, _) in after["status"].items() if s == "published"] == [11, 14]
        assert after["files"] == [9, 11, 12, 13, 14], "the rejected 12 and the candidate 13 keep theirs"
        assert json.loads(index.read_bytes())["open"] == [9, 10, 11, 12, 13, 14], "the hint is rebuilt"
    else:
        # The probe starts past the hint, so what it misses is what a full listing would have found; new
        # numbers still never reuse an existing one.
        assert _create_number(fresh, peft_writer) == 41
        assert fresh.get("acme", 13).status == "candidate"


def _create_number(reg: Registry, peft_writer) -> int:
    return _new(reg, peft_writer).number


def test_files_a_crashed_publisher_left_behind_are_removed_by_the_next_change(data_dir, peft_writer, monkeypatch):
    reg = Registry(data_dir, keep_last=1)
    _new(reg, peft_writer)
    reg.publish("acme", 1)
    _new(reg, peft_writer, parent="acme@1")
    monkeypatch.setattr(reg, "_remove_files", lambda versions: None)  # dies after marking, before deleting
    reg.publish("acme", 2)
    assert reg.get("acme", 1).status == "retired" and reg.get("acme", 1).path.exists()
    monkeypatch.undo()
    _new(reg, peft_writer, parent="acme@2")
    reg.reject("acme", 3, reason="x")
    assert not reg.get("acme", 1).path.exists()
    assert json.loads((data_dir / "registry" / "acme" / "index.json").read_bytes())["open"] == [1, 2, 3]
    _new(reg, peft_writer, parent="acme@2")
    reg.reject("acme", 4, reason="x")
    assert json.loads((data_dir / "registry" / "acme" / "index.json").read_bytes())["open"] == [2, 3, 4], (
        "a version leaves the hint once its files are seen gone"
    )


def test_repair_finishes_a_change_a_crash_cut_short(data_dir, peft_writer, monkeypatch):
    reg = Registry(data_dir, keep_last=1)
    _new(reg, peft_writer)
    reg.publish("acme", 1)
    _new(reg, peft_writer, parent="acme@1")
    monkeypatch.setattr(reg, "_write_head", lambda tenant: None)  # dies after the record, before HEAD.json ...
    monkeypatch.setattr(reg, "_remove_files", lambda versions: None)  # ... and before deleting acme@1's files
    reg.publish("acme", 2)
    monkeypatch.undo()
    assert reg.published()["acme"].name == "acme@1" and reg.get("acme", 1).path.exists()
    generation = reg.generation()
    assert reg.repair("acme") is True
    assert reg.published()["acme"].name == "acme@2" and reg.generation() == generation + 1
    assert not reg.get("acme", 1).path.exists()
    assert reg.repair("acme") is False and reg.generation() == generation + 1, "nothing left: no change"


def test_a_retried_retire_rewrites_head_before_deleting_the_files(data_dir, peft_writer, monkeypatch):
    """A retire killed between its record and HEAD.json left serving on the version it retired; the retry
    must point HEAD at the version before it, not delete the files HEAD still names."""
    reg = Registry(data_dir, keep_last=3)
    for n in (1, 2):
        _new(reg, peft_writer, parent=None if n == 1 else f"acme@{n - 1}")
        reg.publish("acme", n)

    def killed(tenant: str) -> None:
        raise SystemExit("killed")

    monkeypatch.setattr(reg, "_write_head", killed)  # dies after the record, before HEAD.json
    with pytest.raises(SystemExit):
        reg.retire("acme", 2)
    monkeypatch.undo()
    assert reg.get("acme", 2).status == "retired" and reg.published()["acme"].name == "acme@2"
    generation = reg.generation()
    reg.retire("acme", 2)
    assert reg.published()["acme"].name == "acme@1" and reg.generation() == generation + 1
    assert reg.published()["acme"].path.exists() and not reg.get("acme", 2).path.exists()


def test_candidates_are_the_versions_without_a_verdict(data_dir, peft_writer):
    reg = Registry(data_dir, keep_last=1)
    for n in range(1, 6):
        _new(reg, peft_writer)
        if n != 3:
            reg.reject("acme", n, reason="x")
    _new(reg, peft_writer)
    assert [v.name for v in reg.candidates("acme")] == ["acme@3", "acme@6"]
    assert reg.candidates("nobody") == []


def test_the_parsed_records_kept_are_bounded(data_dir, peft_writer, monkeypatch):
    monkeypatch.setattr("storage.registry.CACHE_VERSIONS", 8)
    reg = Registry(data_dir, keep_last=2)
    for n in range(1, 31):
        _new(reg, peft_writer)
        reg.reject("acme", n, reason=f"kl {n}")
    assert [v.reason for v in reg.versions("acme")] == [f"kl {n}" for n in range(1, 31)]
    assert len(reg._metas) <= 8
    # 28 lost its files in the last reject; the hint lets it go once a later change sees them gone.
    assert [v.name for v in reg.unsettled("acme")] == ["acme@28", "acme@29", "acme@30"]


def test_rollback_to_the_version_served_is_refused(data_dir, peft_writer):
    """A copy of what is served changes nothing served, yet it superseded the learner's step in flight."""
    reg = Registry(data_dir)
    _new(reg, peft_writer)
    reg.publish("acme", 1)
    in_flight = _new(reg, peft_writer, parent="acme@1")
    generation = reg.generation()
    with pytest.raises(RegistryError, match="acme@1: it is already the version served"):
        reg.rollback("acme", 1)
    assert reg.generation() == generation and reg.newest_number("acme") == 2, "no copy, no change"
    assert reg.publish("acme", in_flight.number, if_parent_served=True).status == "published"
    assert reg.rollback("acme", 1).name == "acme@3", "once another is served, it may be rolled back to"


def test_two_removers_of_one_version_both_succeed(data_dir, peft_writer):
    """remove_tree checks the directory exists, then renames it: another remover (a retire by hand and the
    learner's keep-last clean-up) may rename it in between, after its registry change was committed."""
    from pathlib import Path

    from storage.files import remove_tree

    reg = Registry(data_dir)
    v = _new(reg, peft_writer)
    other_trash = data_dir / "adapters" / "acme" / ".other-remover.trash"

    class RacedPath(type(Path())):
        def exists(self, *args, **kwargs):  # true when asked; the other remover renames it right after
            found = super().exists(*args, **kwargs)
            if found and not other_trash.exists():
                os.rename(self, other_trash)
            return found

    remove_tree(RacedPath(v.path))
    assert not v.path.exists()


# ---------------------------------------------------------------------------------------------------------
# A registry file that cannot be read (edited by hand, or written by a clora of another format) is its own
# tenant's problem: the other tenants' changes go on, and HEAD.json keeps moving.

DAMAGE = {
    "not JSON": b'{"status": "retired",}',
    "a field missing": b'{"format": 1, "tenant": "beta", "number": 1}',
    "another format": b'{"format": 2, "tenant": "beta", "number": 1, "name": "beta@1"}',
    # a field of the wrong type: it failed later, where it was used (every tenant's listing, the adapters view)
    "metrics not an object": b'{"format": 1, "tenant": "beta", "number": 1, "name": "beta@1", "parent": null, '
                             b'"status": "published", "created_at": "2026-01-01T00:00:00+00:00", "metrics": [1, 2]}',
    "parent not a string": b'{"format": 1, "tenant": "beta", "number": 1, "name": "beta@1", "parent": 7, '
                           b'"status": "published", "created_at": "2026-01-01T00:00:00+00:00"}',
    "an unknown status": b'{"format": 1, "tenant": "beta", "number": 1, "name": "beta@1", "parent": null, '
                         b'"status": "Published", "created_at": "2026-01-01T00:00:00+00:00"}',
}


def _two_tenants(reg: Registry, peft_writer) -> None:
    for t in ("acme", "beta"):
        reg.publish(t, _new(reg, peft_writer, t).number)


@pytest.mark.parametrize("head", ["rebuilt at every change", "acme's entry rewritten"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_an_unreadable_record_of_one_tenant_stops_no_other(data_dir, peft_writer, caplog, monkeypatch, damage, head):
    if head == "rebuilt at every change":
        monkeypatch.setattr("storage.registry.FULL_HEAD_EVERY", 1)
    reg = Registry(data_dir)
    _two_tenants(reg, peft_writer)
    bad = data_dir / "registry" / "beta" / "1.json"
    bad.write_bytes(DAMAGE[damage])
    for n in (2, 3):
        generation = reg.generation()
        reg.publish("acme", _new(reg, peft_writer, parent=f"acme@{n - 1}").number, if_parent_served=True)
        assert reg.generation() > generation
        assert reg.published()["acme"].name == f"acme@{n}"
        assert reg.published()["beta"].name == "beta@1", "beta keeps what it served"
    if head == "rebuilt at every change":
        assert [r.getMessage().count(str(bad)) for r in caplog.records] == [1], "logged once, not on every change"
        assert "beta@1" in caplog.records[0].getMessage()
    else:
        assert caplog.records == [], "acme's changes read none of beta's records"
    assert [v.name for v in reg.versions()] == ["acme@1", "acme@2", "acme@3"], "a listing of all leaves it out"

    # beta itself gets an error naming the file, before anything is written.
    for read in (lambda: reg.get("beta", 1), lambda: reg.versions("beta"), lambda: reg.latest_published("beta"),
                 lambda: _new(reg, peft_writer, "beta", parent="beta@1")):
        with pytest.raises(UnreadableRecord, match=str(bad)) as e:
            read()
        assert e.value.path == bad and not isinstance(e.value, KeyError)
    assert reg.numbers("beta") == [1]
    assert reg.repair("acme") is False


def test_retiring_the_served_version_while_an_older_record_is_unreadable_leaves_head_naming_no_deleted_files(
        data_dir, peft_writer):
    """HEAD.json keeps a tenant's old entry while one of its records cannot be read; not when that entry is
    the version just retired, whose files are deleted: serving would be told to load them."""
    reg = Registry(data_dir)
    reg.publish("acme", _new(reg, peft_writer).number)
    reg.publish("acme", _new(reg, peft_writer, parent="acme@1").number)
    (data_dir / "registry" / "acme" / "1.json").write_bytes(b"{bad")
    v = reg.retire("acme", 2)
    assert v.status == "retired" and not v.path.exists()
    assert "acme" not in Registry(data_dir).published()


def test_a_record_naming_another_version_cannot_be_read(data_dir, peft_writer):
    reg = Registry(data_dir)
    _new(reg, peft_writer)
    _new(reg, peft_writer)
    shutil.copy(data_dir / "registry" / "acme" / "1.json", data_dir / "registry" / "acme" / "2.json")
    with pytest.raises(UnreadableRecord, match="it holds acme@1, not acme@2"):
        Registry(data_dir).get("acme", 2)


def test_retention_leaves_an_unreadable_record_alone_and_newer_versions_publish(data_dir, peft_writer):
    reg = Registry(data_dir, keep_last=1)
    reg.publish("acme", _new(reg, peft_writer).number)
    reg.publish("acme", _new(reg, peft_writer, parent="acme@1").number)
    reg.publish("acme", _new(reg, peft_writer, parent="acme@2").number)  # retires acme@2
    (data_dir / "registry" / "acme" / "3.json").write_bytes(b"{")
    (data_dir / "registry" / "acme" / "index.json").unlink()  # a full listing: acme@3 is open again
    v = reg.create("acme", parent=None, write=peft_writer)
    assert reg.publish("acme", v.number).status == "published"
    assert reg.published()["acme"].name == "acme@4"
    assert reg.get("acme", 2).status == "retired" and (data_dir / "adapters" / "acme" / "3").exists(), (
        "retention leaves alone what it cannot read"
    )


def test_an_unreadable_head_is_rebuilt_with_a_larger_generation(data_dir, peft_writer, caplog):
    reg = Registry(data_dir)
    _two_tenants(reg, peft_writer)
    before = reg.generation()
    head = data_dir / "registry" / "HEAD.json"
    head.write_bytes(b"{ oops")
    with pytest.raises(UnreadableRecord, match="HEAD.json"):
        reg.generation()
    with pytest.raises(UnreadableRecord, match="HEAD.json"):
        reg.published()
    v = _new(reg, peft_writer, parent="acme@1")
    rebuilt = Registry(data_dir).generation()
    assert rebuilt > before, "a poller still sees a change"
    assert {t: x.name for t, x in reg.published().items()} == {"acme": "acme@1", "beta": "beta@1"}
    reg.publish("acme", v.number)
    assert reg.generation() == rebuilt + 1 and reg.published()["acme"].name == "acme@2"
    assert sum("HEAD.json cannot be read" in r.getMessage() for r in caplog.records) == 1


def test_a_head_of_another_format_is_rebuilt_past_its_generation(data_dir, peft_writer):
    reg = Registry(data_dir)
    _two_tenants(reg, peft_writer)
    head = data_dir / "registry" / "HEAD.json"
    head.write_text(json.dumps({"format": 2, "generation": 10**17, "published": {}}))
    reg2 = Registry(data_dir)
    reg2.publish("acme", _new(reg2, peft_writer, parent="acme@1").number)
    assert reg2.generation() > 10**17, "written by this process after it read a larger one"
    assert {t: x.name for t, x in reg2.published().items()} == {"acme": "acme@2", "beta": "beta@1"}


def test_repair_rebuilds_an_unreadable_head(data_dir, peft_writer):
    reg = Registry(data_dir)
    _two_tenants(reg, peft_writer)
    before = reg.generation()
    (data_dir / "registry" / "HEAD.json").write_bytes(b"")
    assert Registry(data_dir).repair("acme") is True
    assert reg.generation() > before
    assert {t: x.name for t, x in reg.published().items()} == {"acme": "acme@1", "beta": "beta@1"}
    assert reg.repair("acme") is False


def test_a_tenant_unreadable_while_head_is_too_is_left_out_of_head(data_dir, peft_writer):
    """Nothing says what the tenant served: it is left out (serving falls back to the base model for it)."""
    reg = Registry(data_dir)
    _two_tenants(reg, peft_writer)
    (data_dir / "registry" / "HEAD.json").write_bytes(b"[]")
    (data_dir / "registry" / "beta" / "1.json").write_bytes(b"[]")
    reg.publish("acme", _new(reg, peft_writer, parent="acme@1").number)
    assert {t: x.name for t, x in reg.published().items()} == {"acme": "acme@2"}


# ---------------------------------------------------------------------------------------------------------
# A number is never reused, even after its record was deleted by hand: serving tells versions by number.


@pytest.mark.parametrize("trace", ["adapter directory", "HEAD.json", "index hint"])
def test_a_number_whose_record_was_deleted_by_hand_is_not_reused(data_dir, peft_writer, trace):
    reg = Registry(data_dir)
    for n in (1, 2):
        reg.publish("acme", _new(reg, peft_writer, parent=f"acme@{n - 1}" if n > 1 else None).number)
    third = _new(reg, peft_writer, parent="acme@2")
    if trace == "HEAD.json":
        reg.publish("acme", 3)
    elif trace == "index hint":
        reg.reject("acme", 3, reason="x")
    stale_hint = (data_dir / "registry" / "acme" / "index.json").read_bytes()
    # What only the chosen trace survives of acme@3.
    (data_dir / "registry" / "acme" / "3.json").unlink()
    if trace != "index hint":
        (data_dir / "registry" / "acme" / "index.json").unlink()
    if trace != "adapter directory":
        shutil.rmtree(third.path)
    assert (reg.published()["acme"].name == "acme@3") == (trace == "HEAD.json")

    v = _new(reg, peft_writer, parent="acme@2")
    assert v.number == 4
    skipped = reg.get("acme", 3)
    assert skipped.status == "retired" and "acme@3 had no record when acme@4 was created" in skipped.reason
    assert not third.path.exists(), "the files of a version without a record go with its number"
    assert reg.published()["acme"].name == "acme@2", "HEAD.json follows the records"
    # Records stay consecutive, so a hint older than the skipped number still finds the newest version.
    (data_dir / "registry" / "acme" / "index.json").write_bytes(stale_hint)
    assert Registry(data_dir).newest_number("acme") == 4
    assert _create_number(Registry(data_dir), peft_writer) == 5


def _records(data_dir, tenant: str = "acme") -> list[str]:
    return sorted((p.name for p in (data_dir / "registry" / tenant).glob("*.json") if p.name != "index.json"),
                  key=lambda name: int(name.split(".")[0]))


@pytest.mark.parametrize("trace", ["adapter directory", "index hint", "HEAD.json"])
def test_a_number_far_past_the_newest_record_is_not_taken_for_one(data_dir, peft_writer, trace, caplog):
    """An operator's folder named by a date, or a hint or HEAD.json edited by hand, would otherwise make the create
    write a record for every number up to it, under the lock (20,000 took 20 s)."""
    reg = Registry(data_dir)
    reg.publish("acme", _new(reg, peft_writer).number)
    far = 1 + MAX_SKIP + 5  # past the bound by more than the two creates below move the newest record
    folder = data_dir / "adapters" / "acme" / str(far)
    if trace == "adapter directory":
        folder.mkdir()
        (folder / "notes.txt").write_text("kept by hand")
    elif trace == "index hint":
        (data_dir / "registry" / "acme" / "index.json").write_text(json.dumps({"format": 1, "last": far, "open": [1]}))
    else:
        head = json.loads((data_dir / "registry" / "HEAD.json").read_text())
        head["published"]["acme"]["number"] = far
        (data_dir / "registry" / "HEAD.json").write_text(json.dumps(head))

    assert _new(reg, peft_writer, parent="acme@1").number == 2
    assert _records(data_dir) == ["1.json", "2.json"], "no number skipped for it"
    assert [v.name for v in Registry(data_dir).unsettled("acme")] == ["acme@1", "acme@2"], "readers see them all"
    assert reg.published()["acme"].name == "acme@1"
    warned = [r.getMessage() for r in caplog.records if f"acme@{far}" in r.getMessage()]
    assert len(warned) == 1 and f"more than {MAX_SKIP} past the newest record (acme@1)" in warned[0]
    if trace == "adapter directory":
        assert str(folder) in warned[0] and "left as it is" in warned[0]
        assert _new(reg, peft_writer, parent="acme@1").number == 3
        assert len([r for r in caplog.records if f"acme@{far}" in r.getMessage()]) == 1, "logged once"
        assert [p.name for p in folder.iterdir()] == ["notes.txt"], "a folder without a record is never deleted"


def test_only_directories_named_by_a_number_as_written_are_traces(data_dir, peft_writer):
    reg = Registry(data_dir)
    _new(reg, peft_writer)
    acme = data_dir / "adapters" / "acme"
    for name in ("007", "+9", "\u0663", "\u00b2", "0"):  # int() reads the first four as numbers; "²" it refuses
        (acme / name).mkdir()
    (acme / "5").write_text("a file")
    (data_dir / "registry" / "acme" / "04.json").write_text("{}")
    assert _new(reg, peft_writer, parent="acme@1").number == 2
    assert reg.numbers("acme") == [1, 2]
    assert sorted(p.name for p in acme.iterdir()) == sorted(["1", "2", "007", "+9", "\u0663", "\u00b2", "0", "5"])


def test_numbers_skipped_within_the_bound_are_recorded_and_logged_as_a_range(data_dir, peft_writer, caplog,
                                                                             monkeypatch):
    monkeypatch.setattr(registry, "MAX_SKIP", 5)
    reg = Registry(data_dir)
    _new(reg, peft_writer)
    (data_dir / "adapters" / "acme" / "6").mkdir()  # 5 past acme@1: still a trace
    assert _new(reg, peft_writer).number == 7
    assert [reg.get("acme", n).status for n in range(2, 7)] == ["retired"] * 5
    assert not (data_dir / "adapters" / "acme" / "6").exists()
    [message] = [r.getMessage() for r in caplog.records]
    assert "5 number(s) of acme had no record (acme@2 to acme@6" in message and "acme@8 is next" not in message
    assert "acme@4" not in message, "a count and a range, not every name"



def test_a_run_of_folders_crossing_the_bound_is_taken_whole(data_dir, peft_writer, monkeypatch):
    """The folder one past the bound was far, and in the way of the number after the run: every create refused."""
    monkeypatch.setattr(registry, "MAX_SKIP", 5)
    reg = Registry(data_dir)
    _new(reg, peft_writer)
    for n in range(4, 10):  # a range copied back, from within the bound (acme@6) to past it
        (data_dir / "adapters" / "acme" / str(n)).mkdir()
    assert _new(reg, peft_writer).number == 10
    assert [_new(reg, peft_writer).number for _ in range(2)] == [11, 12]
    assert reg.numbers("acme") == list(range(1, 13))
    assert not (data_dir / "adapters" / "acme" / "9").exists()


def test_a_record_far_past_the_newest_version_costs_no_skipped_numbers(data_dir, peft_writer, monkeypatch, caplog):
    """Readers' probe jumped to it and the next create recorded every number below it as skipped (for a
    record at 100,000: two seconds to read, a minute to create)."""
    monkeypatch.setattr(registry, "MAX_SKIP", 5)
    reg = Registry(data_dir)
    for n in (1, 2):
        reg.publish("acme", _new(reg, peft_writer, parent=f"acme@{n - 1}" if n > 1 else None).number)
    record = json.loads((data_dir / "registry" / "acme" / "2.json").read_text())
    record.update(number=50, name="acme@50", status="retired")
    (data_dir / "registry" / "acme" / "50.json").write_text(json.dumps(record))
    shutil.copytree(data_dir / "adapters" / "acme" / "2", data_dir / "adapters" / "acme" / "50")

    fresh = Registry(data_dir)
    assert fresh.newest_number("acme") == 2 and fresh.latest_published("acme").name == "acme@2"
    assert fresh.newest_number("acme") == 2  # read again: logged once per process
    assert len([r for r in caplog.records if "50.json" in r.getMessage()]) == 1, "logged once"
    reg.publish("acme", _new(reg, peft_writer, parent="acme@2").number)
    assert reg.numbers("acme") == [1, 2, 3, 50], "no number skipped for it"
    assert Registry(data_dir).latest_published("acme").name == "acme@3"


def test_a_retire_past_a_hole_keeps_its_number(data_dir, peft_writer):
    """Its folder was what readers found it by past the hole: once deleted, the version was hidden and the next
    create took its number again, over its record."""
    reg = Registry(data_dir)
    reg.publish("acme", _new(reg, peft_writer).number)  # the hint says last 1
    for n in (2, 3):
        _new(reg, peft_writer, parent=f"acme@{n - 1}")
    (data_dir / "registry" / "acme" / "2.json").unlink()
    reg.retire("acme", 3)
    assert Registry(data_dir).newest_number("acme") == 3
    assert _new(reg, peft_writer, parent="acme@1").number == 4
    assert reg.get("acme", 3).status == "retired" and reg.get("acme", 3).parent == "acme@2"


def test_a_change_reads_only_its_own_tenants_records_for_head(data_dir, peft_writer, monkeypatch):
    """Rebuilding HEAD.json read every tenant's records under the one lock at every change: ~0.7 s a step's
    create and publish at 1,000 tenants. A change rewrites its own tenant's entry; the others' stay as they
    were, byte for byte."""
    reg = Registry(data_dir)
    for t in ("acme", "beta", "gamma"):
        reg.publish(t, _new(reg, peft_writer, t).number)
    before = json.loads((data_dir / "registry" / "HEAD.json").read_bytes())["published"]
    read = []
    real = Registry.latest_published
    monkeypatch.setattr(Registry, "latest_published", lambda self, t: (read.append(t), real(self, t))[1])
    reg.publish("acme", _new(reg, peft_writer, parent="acme@1").number, if_parent_served=True)
    assert set(read) == {"acme"}
    after = json.loads((data_dir / "registry" / "HEAD.json").read_bytes())["published"]
    assert after["acme"]["name"] == "acme@2"
    assert {t: after[t] for t in ("beta", "gamma")} == {t: before[t] for t in ("beta", "gamma")}
    raw = (data_dir / "registry" / "HEAD.json").read_bytes()
    assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode(), "as json writes it"


def test_what_a_crash_left_of_another_tenants_head_entry_is_repaired_by_the_next_full_rebuild(data_dir, peft_writer,
                                                                                             monkeypatch):
    monkeypatch.setattr("storage.registry.FULL_HEAD_EVERY", 4)
    reg = Registry(data_dir)
    reg.publish("acme", _new(reg, peft_writer).number)
    v = _new(reg, peft_writer, "beta")
    with monkeypatch.context() as m:
        m.setattr(reg, "_write_head", lambda tenant: None)  # dies after beta@1's record, before HEAD.json
        reg.publish("beta", v.number)
    assert "beta" not in reg.published()
    while (reg.generation() + 1) % 4:
        _new(reg, peft_writer, parent="acme@1")  # a change (a candidate) of acme's
        assert "beta" not in reg.published(), "acme's change rewrote acme's entry only"
    _new(reg, peft_writer, parent="acme@1")
    assert reg.published()["beta"].name == "beta@1", "the full rebuild read beta's records"


def test_a_head_entry_edited_into_one_that_does_not_read_is_rebuilt_by_any_change(data_dir, peft_writer):
    reg = Registry(data_dir)
    _two_tenants(reg, peft_writer)
    head = json.loads((data_dir / "registry" / "HEAD.json").read_text())
    head["published"]["beta"]["number"] = "one"
    (data_dir / "registry" / "HEAD.json").write_text(json.dumps(head))
    with pytest.raises(UnreadableRecord, match="HEAD.json"):
        Registry(data_dir).published()
    reg.publish("acme", _new(reg, peft_writer, parent="acme@1").number)
    assert {t: v.name for t, v in Registry(data_dir).published().items()} == {"acme": "acme@2", "beta": "beta@1"}


def test_a_head_entry_under_a_name_no_tenant_has_is_dropped_not_looked_up(data_dir, peft_writer):
    """Looked up as a tenant, a key edited in by hand ("acme backup") raised at every change of every tenant."""
    reg = Registry(data_dir)
    _two_tenants(reg, peft_writer)
    head = json.loads((data_dir / "registry" / "HEAD.json").read_text())
    head["published"]["acme backup"] = {"name": "acme@1"}
    (data_dir / "registry" / "HEAD.json").write_text(json.dumps(head))
    reg.publish("acme", _new(reg, peft_writer, parent="acme@1").number)
    assert {t: v.name for t, v in Registry(data_dir).published().items()} == {"acme": "acme@2", "beta": "beta@1"}


def test_a_head_entry_of_a_tenant_name_no_longer_valid_leaves_the_others_readable(data_dir, peft_writer, caplog):
    """An older clora allowed names such as `acme.`; its entry failed the whole of HEAD.json, and serving, unable
    to read what is published, left every tenant on the base model."""
    reg = Registry(data_dir)
    _two_tenants(reg, peft_writer)
    head = json.loads((data_dir / "registry" / "HEAD.json").read_text())
    head["published"]["acme."] = dict(head["published"]["acme"], tenant="acme.")
    (data_dir / "registry" / "HEAD.json").write_text(json.dumps(head))
    reader = Registry(data_dir)
    assert {t: v.name for t, v in reader.published().items()} == {"acme": "acme@1", "beta": "beta@1"}
    reader.published()
    assert caplog.text.count("HEAD.json names 'acme.', not a valid tenant name") == 1


def test_a_head_copy_put_back_by_hand_is_rebuilt_by_the_next_change_of_any_tenant(data_dir, peft_writer):
    """An older HEAD.json restored from a backup named beta@1, whose files keep_last had deleted; only beta's
    own change would have mended its entry."""
    reg = Registry(data_dir, keep_last=1)
    _two_tenants(reg, peft_writer)
    backup = (data_dir / "registry" / "HEAD.json").read_bytes()
    reg.publish("beta", _new(reg, peft_writer, "beta", parent="beta@1").number)  # beta@1's files go
    (data_dir / "registry" / "HEAD.json").write_bytes(backup)
    reg.publish("acme", _new(reg, peft_writer, parent="acme@1").number)
    published = Registry(data_dir).published()
    assert {t: v.name for t, v in published.items()} == {"acme": "acme@2", "beta": "beta@2"}
    assert published["beta"].path.exists()


@pytest.mark.parametrize("between", ["nothing", "a publish past the hole"])
def test_a_record_deleted_by_hand_among_the_newest_hides_no_version(data_dir, peft_writer, between):
    """Probing from the hint stopped at the hole for good: the versions after it were never served."""
    reg = Registry(data_dir)
    reg.publish("acme", _new(reg, peft_writer).number)  # the hint says last 1
    for n in (2, 3, 4):
        _new(reg, peft_writer, parent=f"acme@{n - 1}")
    (data_dir / "registry" / "acme" / "3.json").unlink()
    hint = data_dir / "registry" / "acme" / "index.json"

    fresh = Registry(data_dir)  # before anything fills the hole
    assert [v.number for v in fresh.unsettled("acme")] == [1, 2, 4] and fresh.newest_number("acme") == 4
    if between == "a publish past the hole":
        reg.publish("acme", 4)
        reg.publish("beta", _new(reg, peft_writer, "beta").number)  # rebuilds HEAD.json from every tenant's records
        assert reg.published()["acme"].name == "acme@4" == reg.latest_published("acme").name
        assert json.loads(hint.read_text())["last"] == 4

    v = _new(reg, peft_writer, parent="acme@2")
    assert v.number == 5
    skipped = reg.get("acme", 3)
    assert skipped.status == "retired" and "acme@3 had no record when acme@5 was created" in skipped.reason
    assert not (data_dir / "adapters" / "acme" / "3").exists()
    reg.publish("acme", 5)
    assert reg.published()["acme"].name == "acme@5" == reg.latest_published("acme").name
    assert json.loads(hint.read_text())["last"] == 5 and 3 not in json.loads(hint.read_text())["open"]
    reg.publish("acme", _new(reg, peft_writer, parent="acme@5").number)
    assert Registry(data_dir).published()["acme"].name == "acme@6"


def test_head_is_parsed_again_only_when_it_changed(data_dir, peft_writer, monkeypatch):
    """Serving polls the generation every half second; HEAD.json holds an entry per tenant (1.5 MB at 1,000),
    and was parsed whole at every poll."""
    import storage.registry as registry_module

    reg = Registry(data_dir)
    reg.publish("acme", _new(reg, peft_writer).number)
    parses = []
    real = registry_module.json.loads
    monkeypatch.setattr(registry_module.json, "loads", lambda raw, *a, **kw: parses.append(1) or real(raw, *a, **kw))
    first = reg.generation()
    assert [reg.generation() for _ in range(5)] == [first] * 5 and len(parses) <= 1
    other = Registry(data_dir)  # another process's change: a new file, so a new stamp
    other.publish("acme", _new(other, peft_writer, parent="acme@1").number)
    assert reg.generation() > first and reg.published()["acme"].name == "acme@2"
