"""storage.retention: whole files older than the cutoff go, newer and mixed ones stay, compaction's state stays
consistent, and `clora prune` / the compactor loop apply it."""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest

from storage.compact import compact
from storage.cursors import Cursors
from storage.files import FileLock
from storage.parquet import live_files, read_dataset, write_dataset
from storage.retention import DAY_S, newest_ms, prune, prune_spool_dead

pytestmark = pytest.mark.unit

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)  # conftest.trajectories(): row k is ingested at T0 + start + k seconds


@pytest.fixture
def files(data_dir, make_trajectories):
    """trajectories of acme: f0..f3 hold rows ingested at T0 + 0..3 s, + 10..13 s, + 20..23 s, + 30..33 s;
    `mixed` at T0 + 22..25 s."""
    for f in range(4):
        write_dataset(data_dir, "trajectories", make_trajectories([f"f{f}-{k}" for k in range(4)], start=f * 10), file_id=f"f{f}")
    write_dataset(data_dir, "trajectories", make_trajectories([f"m-{k}" for k in range(4)], start=22), file_id="mixed")
    return data_dir / "trajectories" / "tenant=acme"


def names(directory):
    return sorted(p.name for p in directory.glob("*.parquet"))


def test_files_whose_rows_are_all_older_than_the_cutoff_go_and_the_others_stay(data_dir, files, make_trajectories):
    now = T0.timestamp() + 100
    # cutoff T0 + 25 s: f0, f1, f2 are all older; mixed's newest row is at T0 + 25 s exactly, f3's after
    (dry,) = prune(data_dir, older_than_s=75, now_s=now, dry_run=True)
    assert (dry.files, dry.rows) == (3, 12) and dry.bytes > 0
    assert names(files) == ["f0.parquet", "f1.parquet", "f2.parquet", "f3.parquet", "mixed.parquet"]  # dry run

    (done,) = prune(data_dir, older_than_s=75, now_s=now)
    assert (done.files, done.rows) == (3, 12)
    assert names(files) == ["f3.parquet", "mixed.parquet"]
    assert sorted(read_dataset(data_dir, "trajectories").column("id").to_pylist()) == sorted(
        [f"f3-{k}" for k in range(4)] + [f"m-{k}" for k in range(4)]
    )
    assert prune(data_dir, older_than_s=75, now_s=now)[0].files == 0  # nothing left to do
    assert newest_ms(data_dir, str(files / "f3.parquet")) == (round(T0.timestamp() * 1000) + 33_000, 4)


def test_a_process_reads_each_files_date_once_across_its_prunes(data_dir, files, make_trajectories, monkeypatch):
    """The compactor's loop prunes at every run, and read every stored file's footer each time: the whole
    history's, a compacted file's footer listing every name it supersedes."""
    import storage.parquet as parquet

    reads = []
    real = parquet.newest_ms
    monkeypatch.setattr(parquet, "newest_ms", lambda *a: reads.append(a[1]) or real(*a))
    now = T0.timestamp() + 100
    first = prune(data_dir, older_than_s=75, now_s=now, dry_run=True)
    assert len(reads) == 5
    assert prune(data_dir, older_than_s=75, now_s=now, dry_run=True) == first and len(reads) == 5
    (files / "f3.parquet").unlink()  # a file of the same name but not the same one is dated again
    write_dataset(data_dir, "trajectories", make_trajectories([f"g-{k}" for k in range(9)], start=0), file_id="f3")
    (again,) = prune(data_dir, older_than_s=75, now_s=now, dry_run=True)
    assert reads[5:] == [str(files / "f3.parquet")] and (again.files, again.rows) == (4, 21)


def test_superseded_inputs_go_with_or_before_their_compacted_file_and_never_come_back(data_dir, files):
    compact(data_dir, "trajectories", grace_s=3600)  # one compacted file; its inputs wait on disk for the grace
    assert len(names(files)) == 6 and len(live_files(data_dir, "trajectories")) == 1
    before = read_dataset(data_dir, "trajectories").sort_by("id")

    # The compacted file holds rows up to T0 + 33 s: it stays, and so do its rows, while its old inputs go.
    (r,) = prune(data_dir, older_than_s=75, now_s=T0.timestamp() + 100)
    assert r.files == 0  # no live file was deleted
    assert names(files) == [n for n in names(files) if n.startswith("compacted-")] + ["f3.parquet", "mixed.parquet"]
    assert read_dataset(data_dir, "trajectories").sort_by("id").equals(before)

    # Everything old: the compacted file and its remaining inputs all go; no input becomes live again.
    (r,) = prune(data_dir, older_than_s=10, now_s=T0.timestamp() + 100)
    assert (r.files, r.rows) == (1, 20)
    assert names(files) == [] and read_dataset(data_dir, "trajectories").num_rows == 0


def test_a_partition_a_compaction_holds_is_skipped(data_dir, files):
    with FileLock(data_dir / "locks" / "compact-trajectories-acme.lock", blocking=False):
        (r,) = prune(data_dir, older_than_s=75, now_s=T0.timestamp() + 100)
    assert r.skipped and len(names(files)) == 5
    assert prune(data_dir, older_than_s=75, now_s=T0.timestamp() + 100)[0].files == 3


def test_a_timestamp_without_a_zone_is_dated_as_utc_whatever_the_local_zone(data_dir, files, make_trajectories,
                                                                         monkeypatch):
    """A file another writer put there may hold naive timestamps: the footer's statistics were read in the
    machine's local zone (five hours off in New York), the column itself (without statistics) as UTC."""
    import pyarrow.parquet as pq

    table = make_trajectories([f"n-{k}" for k in range(3)], start=40)  # T0 + 40..42 s
    at = table.schema.get_field_index("ingested_at")
    naive = table.set_column(at, pa.field("ingested_at", pa.timestamp("ms")), table.column(at).cast(pa.timestamp("ms")))
    pq.write_table(naive, files / "naive.parquet")
    pq.write_table(naive, files / "naive-nostats.parquet", write_statistics=False)
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        for name in ("naive.parquet", "naive-nostats.parquet"):
            assert newest_ms(data_dir, str(files / name)) == (round(T0.timestamp() * 1000) + 42_000, 3)
    finally:
        monkeypatch.undo()
        time.tzset()


def test_files_without_statistics_or_rows_are_read_and_an_unreadable_one_is_left_alone(data_dir, files, make_trajectories):
    import pyarrow.parquet as pq

    table = make_trajectories([f"n-{k}" for k in range(3)], start=40)  # T0 + 40..42 s
    pq.write_table(table, files / "nostats.parquet", write_statistics=False)
    assert newest_ms(data_dir, str(files / "nostats.parquet")) == (round(T0.timestamp() * 1000) + 42_000, 3)
    pq.write_table(table.slice(0, 0), files / "empty.parquet")
    assert newest_ms(data_dir, str(files / "empty.parquet")) == (None, 0)
    (files / "broken.parquet").write_bytes(b"PAR1 not really")

    (r,) = prune(data_dir, older_than_s=55, now_s=T0.timestamp() + 100)  # cutoff T0 + 45 s: all but broken
    assert (r.files, r.rows, r.unreadable) == (7, 23, 1) and "1 unreadable files left alone" in str(r)
    assert names(files) == ["broken.parquet"]


def _dead_letter(at: datetime, offset: int) -> pa.Table:
    """One dead letter of acme, ingested at `at`."""
    return pa.table(
        {
            "tenant": ["acme"], "reason": ["invalid_json"], "detail": [f"sent at {at}"], "raw": [b"{"],
            "kafka_topic": ["clora.interactions"], "kafka_partition": [0], "kafka_offset": [offset], "ingested_at": [at],
        }
    )


def _kept(data_dir) -> list[datetime]:
    return sorted(read_dataset(data_dir, "dead_letters").column("ingested_at").to_pylist())


def test_a_low_volume_partition_compacted_after_every_write_still_loses_its_old_rows(data_dir):
    """A dead letter every 3 days over 30 days, compacted after each: each stays in its own day's file
    (compaction merged them all into one file, always holding a recent row, which retention never deleted)."""
    for n, day in enumerate(range(0, 31, 3)):
        write_dataset(data_dir, "dead_letters", _dead_letter(T0 + timedelta(days=day), n), file_id=f"dl{day:02d}")
        compact(data_dir, "dead_letters", grace_s=0)
    now = T0 + timedelta(days=30)
    (r,) = prune(data_dir, older_than_s=7 * DAY_S, dataset="dead_letters", now_s=now.timestamp())
    assert (r.files, r.rows) == (8, 8)  # days 0..21; days 24, 27 and 30 are within the 7 days
    assert _kept(data_dir) == [T0 + timedelta(days=d) for d in (24, 27, 30)]


def test_retention_keeps_rows_at_most_a_day_beyond_the_cutoff(data_dir):
    """A dead letter every 5 hours for 10 days, compacted after each: whatever the cutoff, every row older
    than a day before it is gone, and none newer than it is."""
    times = [T0 + timedelta(hours=5 * n) for n in range(48)]
    for n, at in enumerate(times):
        write_dataset(data_dir, "dead_letters", _dead_letter(at, n), file_id=f"dl{n:03d}")
        compact(data_dir, "dead_letters", grace_s=0)
    for hours_ago in (200, 150, 101, 60, 7):  # each prune runs on what the previous one left
        now = times[-1]
        cutoff = now - timedelta(hours=hours_ago)
        (r,) = prune(data_dir, older_than_s=hours_ago * 3600, dataset="dead_letters", now_s=now.timestamp())
        kept = _kept(data_dir)
        assert [t for t in times if t >= cutoff] == [t for t in kept if t >= cutoff]
        assert kept[0] >= cutoff - timedelta(days=1), (hours_ago, kept[0], cutoff)


def test_only_the_datasets_fed_from_kafka_are_pruned(data_dir):
    with pytest.raises(ValueError, match="train_steps is not pruned"):
        prune(data_dir, older_than_s=10, dataset="train_steps")
    for bad in (0, float("inf")):
        with pytest.raises(ValueError, match="must be a finite number above 0"):
            prune(data_dir, older_than_s=bad)


def test_prune_command(tmp_path, data_dir, files, monkeypatch, capsys, caplog):
    from clora.cli import build_parser

    config = tmp_path / "clora.toml"
    config.write_text(f'data_dir = "{data_dir}"\n')
    monkeypatch.delenv("CLORA_DATA_DIR", raising=False)
    monkeypatch.setenv("CLORA_CONFIG", str(config))
    parser = build_parser(["storage.cli"])

    def run(*argv):
        args = parser.parse_args(argv)
        return args.func(args), *capsys.readouterr()

    code, _, err = run("prune")
    assert code == 2 and "--older-than-days" in err and "[retention] days" in err
    code, _, err = run("prune", "--older-than-days", "1")  # shorter than the 72 h feedback may wait
    assert code == 2 and "pending_expiry_hours" in err
    # A learner cursor whose two steps were committed on T0 + 1 day, folded into a snapshot.
    cursors = Cursors(data_dir)
    for step, ids in ((1, ["f0-0", "f0-1"]), (2, ["f0-2"])):
        cursors.commit("acme", step=step, ids=ids, checkpoint=lambda d: (d / "weights").write_bytes(b"w"))
        meta = data_dir / "cursors" / "acme" / f"step-{step:020d}" / "commit.json"
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "created_at": "2025-01-02T00:00:00+00:00"}))
    cursors.compact("acme")
    # The rows are from T0 (2025): all older than 30 days.
    before = sorted(p.relative_to(data_dir) for p in data_dir.rglob("*"))
    code, out, _ = run("prune", "--older-than-days", "30", "--dry-run")
    assert code == 0 and "would delete 5 files, 20 rows" in out and len(names(files)) == 5
    assert sorted(p.relative_to(data_dir) for p in data_dir.rglob("*")) == before  # a dry run writes nothing, locks included
    assert "0 adapter version records, 0 serving dead-letter day files; 3 trained ids forgotten" in out
    assert cursors.trained_ids("acme") == {"f0-0", "f0-1", "f0-2"}
    with caplog.at_level("INFO", logger="storage.retention"):
        code, out, _ = run("prune", "--older-than-days", "30")
    assert code == 0 and "deleted 5 files, 20 rows" in out and names(files) == []
    printed = [line for line in out.splitlines() if line.startswith("trajectories/")]
    assert printed and not [r for r in caplog.records if r.levelno >= logging.INFO and "pruned" in r.getMessage()]
    assert "3 trained ids forgotten" in out and cursors.trained_ids("acme") == set() and cursors.latest_step("acme") == 2

    config.write_text(f'data_dir = "{data_dir}"\n[retention]\ndays = 2\n')  # refused when loaded
    with pytest.raises(SystemExit) as exit_:
        run("prune")
    assert exit_.value.code == 2 and "pending_expiry_hours" in capsys.readouterr().err


def test_one_dataset_that_cannot_be_listed_does_not_turn_retention_off_for_the_rest(
        tmp_path, data_dir, files, monkeypatch, capsys):
    """A file in feedback/'s place stopped the whole run before trajectories, the registry, the cursors and
    serving's dead letters were pruned, at every compactor cycle: the disk filled while one line was logged."""
    from clora.cli import build_parser
    from storage.layout import DataDir

    (data_dir / "feedback").write_text("not a directory")
    dead = DataDir(data_dir).serving_spool_dead
    dead.mkdir(parents=True)
    (dead / "2025-01-01.jsonl").write_text("{}\n")
    config = tmp_path / "clora.toml"
    config.write_text(f'data_dir = "{data_dir}"\n')
    monkeypatch.delenv("CLORA_DATA_DIR", raising=False)
    monkeypatch.setenv("CLORA_CONFIG", str(config))
    args = build_parser(["storage.cli"]).parse_args(["prune", "--older-than-days", "30"])
    assert args.func(args) == 1
    out, err = capsys.readouterr()
    assert names(files) == [] and not (dead / "2025-01-01.jsonl").exists()  # the others were pruned
    assert "deleted 5 files, 20 rows" in out and "failed" not in out  # failures are on stderr
    failure, summary = err.splitlines()
    assert failure.startswith("feedback: failed: NotADirectoryError") and "pruning failed for 1: feedback" in summary

    results = prune(data_dir, older_than_s=30 * DAY_S)
    assert [(r.where, r.error is not None) for r in results if r.error] == [("feedback", True)]


def test_one_partition_that_fails_does_not_stop_the_others(data_dir, files, make_trajectories, monkeypatch):
    from storage import retention

    write_dataset(data_dir, "trajectories", make_trajectories(["g-0"], tenant="globex"), file_id="g0")
    listing = retention.partition_listing

    def disk_error_for_acme(dd, dataset, tenant):
        if tenant == "acme":
            raise OSError(5, "Input/output error")
        return listing(dd, dataset, tenant)

    monkeypatch.setattr(retention, "partition_listing", disk_error_for_acme)
    results = {r.where: r for r in prune(data_dir, older_than_s=30 * DAY_S)}
    assert results["trajectories/tenant=acme"].error == "OSError: [Errno 5] Input/output error"
    assert str(results["trajectories/tenant=acme"]) == "trajectories/tenant=acme: failed: OSError: [Errno 5] Input/output error"
    assert results["trajectories/tenant=globex"].files == 1 and len(names(files)) == 5


def test_one_tenant_whose_registry_fails_does_not_stop_the_others_records_pruning(
        tmp_path, data_dir, peft_writer, monkeypatch, capsys):
    from clora.cli import build_parser
    from storage.registry import Registry

    registry = Registry(data_dir, keep_last=1)
    for tenant in ("acme", "globex"):
        for _ in range(3):  # keep_last 1: the first is retired, and settled once a third is published
            v = registry.create(tenant, parent=None, write=peft_writer)
            registry.publish(tenant, v.number)
    prune_records = Registry.prune

    def disk_error_for_acme(self, tenant, **kw):
        if tenant == "acme":
            raise OSError(5, "Input/output error")
        return prune_records(self, tenant, **kw)

    monkeypatch.setattr(Registry, "prune", disk_error_for_acme)
    config = tmp_path / "clora.toml"
    config.write_text(f'data_dir = "{data_dir}"\n')
    monkeypatch.delenv("CLORA_DATA_DIR", raising=False)
    monkeypatch.setenv("CLORA_CONFIG", str(config))
    args = build_parser(["storage.cli"]).parse_args(["prune", "--older-than-days", "30"])
    future = time.time() + 60 * DAY_S
    monkeypatch.setattr(time, "time", lambda: future)
    assert args.func(args) == 1
    out, err = capsys.readouterr()
    assert "1 adapter version records" in out, out  # globex's
    assert "pruning adapter records failed for acme (OSError" in err and "pruning failed for 1: adapter records" in err
    assert Registry(data_dir).numbers("globex") == [2, 3] and Registry(data_dir).numbers("acme") == [1, 2, 3]


def test_the_compactor_loop_of_a_dataset_never_pruned_says_so_once(tmp_path, data_dir, compactor_loop):
    config = tmp_path / "loop.toml"
    config.write_text(f'data_dir = "{data_dir}"\n[retention]\ndays = 30\n')
    ready = data_dir / "state" / "ready" / "compactor.json"

    def several_runs(proc):  # its output is read once it has stopped: runs 0.2 s apart, over 1 s once ready
        return ready.exists() and time.time() - json.loads(ready.read_text())["at"] > 1.0

    code, out, _ = compactor_loop(config, several_runs, args=("--dataset", "train_steps"))
    assert code == 0, out
    assert out.count("compacted 0 files") >= 2, out
    assert out.count("[retention] days is set, but train_steps is not pruned: only compacted") == 1, out
    assert "pruning failed" not in out, out


def test_the_config_refuses_a_retention_shorter_than_the_feedback_wait():
    from pydantic import ValidationError

    from clora.config import Config

    with pytest.raises(ValidationError, match="retention.days 2 is shorter than ingest.pending_expiry_hours 72"):
        Config.model_validate({"retention": {"days": 2}})
    assert Config.model_validate({"retention": {"days": 2}, "ingest": {"pending_expiry_hours": 48}}).retention.days == 2
    assert Config().retention.days == 0  # keeps everything by default
    with pytest.raises(ValidationError, match="compaction.every_seconds is 0"):
        Config.model_validate({"retention": {"days": 30}, "compaction": {"every_seconds": 0}})


def test_the_compactor_loop_prunes_with_a_retention_set(tmp_path, data_dir, files, compactor_loop):
    config = tmp_path / "loop.toml"
    config.write_text(f'data_dir = "{data_dir}"\n[retention]\ndays = 30\n')
    code, out, _ = compactor_loop(config, lambda proc: not names(files))
    assert code == 0, out
    assert names(files) == [] and "pruned (older than 30 days): deleted" in out


def test_servings_dead_letter_day_files_go_once_their_whole_day_is_older_than_the_retention(data_dir):
    """Events Kafka refused for good (serving/spool.py) were kept for ever."""
    from storage.layout import DataDir

    dead = DataDir(data_dir).serving_spool_dead
    dead.mkdir(parents=True)
    for name in ("2025-01-01.jsonl", "2025-01-09.jsonl", "2025-01-10.jsonl", "notes.jsonl", "2025-01-01.txt"):
        (dead / name).write_text("{}\n")
    now = datetime(2025, 1, 20, 12, tzinfo=timezone.utc).timestamp()
    # cutoff 2025-01-10 12:00: the 9th ended before it, the 10th did not
    assert prune_spool_dead(data_dir, older_than_s=10 * DAY_S, now_s=now, dry_run=True) == 2
    assert len(list(dead.iterdir())) == 5
    assert prune_spool_dead(data_dir, older_than_s=10 * DAY_S, now_s=now) == 2
    assert sorted(p.name for p in dead.iterdir()) == ["2025-01-01.txt", "2025-01-10.jsonl", "notes.jsonl"]
    assert prune_spool_dead(data_dir / "nowhere", older_than_s=DAY_S) == 0


def test_a_superseded_input_that_cannot_be_read_goes_with_its_compacted_file(data_dir, files):
    """Left alone as unreadable, it would be live again once the file superseding it was deleted: an old file
    back among the live ones, failing every read of the dataset."""
    compact(data_dir, "trajectories", grace_s=3600)  # its inputs wait on disk for the grace period
    damaged = files / "f0.parquet"
    damaged.write_bytes(damaged.read_bytes()[:-100])

    (r,) = prune(data_dir, older_than_s=10, now_s=T0.timestamp() + 100)
    assert (r.files, r.rows, r.unreadable) == (1, 20, 0)
    assert names(files) == [] and live_files(data_dir, "trajectories") == []


def test_a_damaged_cursor_snapshot_of_one_tenant_does_not_stop_forgetting_the_others(data_dir, caplog):
    """pyarrow's error for a truncated snapshot (a ValueError) went past the per-tenant guard: the tenants
    after it were never forgotten, and the message named neither tenant nor file. The failure is PartlyDone's
    to report (`clora prune` prints it): the log has its traceback at DEBUG, and no line of its own above."""
    caplog.set_level("DEBUG", logger="storage.retention")
    from storage.retention import PartlyDone, forget_trained

    cursors = Cursors(data_dir)
    for tenant in ("aaa", "bbb"):
        for step in (1, 2, 3):
            cursors.commit(tenant, step=step, ids=[f"{tenant}-{step}-{i}" for i in range(5)],
                           checkpoint=lambda d: (d / "weights").write_bytes(b"w"))
        cursors.compact(tenant)
    (snapshot,) = (data_dir / "cursors" / "aaa").glob("trained-*.parquet")
    with snapshot.open("r+b") as f:
        f.truncate(10)
    with pytest.raises(PartlyDone, match=r"forgetting trained ids failed for aaa \(") as e:
        forget_trained(data_dir, older_than_s=1, now_s=time.time() + 10 * DAY_S)
    assert e.value.done == {"bbb": 15} and cursors.trained_ids("bbb") == set()
    (logged,) = [r for r in caplog.records if "forgetting trained ids of tenant aaa failed" in r.getMessage()]
    assert logged.levelname == "DEBUG" and logged.exc_info is not None


def test_failures_are_the_callers_to_report_with_their_tracebacks_logged_at_debug(
        data_dir, files, monkeypatch, caplog):
    """`clora prune` prints each failed result on stderr; an ERROR log with a traceback above it buried
    that line."""
    from storage import retention

    (data_dir / "interactions").write_text("not a directory")

    def disk_error(dd, dataset, tenant):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(retention, "partition_listing", disk_error)
    caplog.set_level("DEBUG", logger="storage.retention")
    failed = [r.where for r in prune(data_dir, older_than_s=30 * DAY_S) if r.error]
    assert failed == ["interactions", "trajectories/tenant=acme"]
    with_traceback = [r.getMessage() for r in caplog.records if r.exc_info]
    assert with_traceback == ["retention: listing the tenants of interactions failed",
                              "retention: pruning trajectories/tenant=acme failed"]
    assert all(r.levelname == "DEBUG" for r in caplog.records if r.exc_info or "failed" in r.getMessage())
