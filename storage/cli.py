"""`clora query`, `clora adapters list|show|rollback|retire`, `clora compact` and `clora prune`.

Argument parsing only; the work is in query.py, registry.py, compact.py and retention.py. Only argparse (and
clora.argtypes, which imports nothing else) is imported at module level so `clora --help` stays fast. The data dir comes from `cfg.data_dir`, keep_last
from `cfg.learner.keep_versions`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import re
import sys

from clora.argtypes import positive, retention_days

FORMATS = ("table", "csv", "json", "parquet")
# --dataset's choices, written out so that `clora --help` imports no pyarrow: storage.layout.DATASETS and
# storage.retention.PRUNED_DATASETS (tests/storage/test_storage_cli.py holds them equal).
COMPACTED = ("interactions", "feedback", "trajectories", "dead_letters", "train_steps")
PRUNED = ("interactions", "feedback", "trajectories", "dead_letters")
MAX_CELL = 60  # characters of one cell in the readable table
STDOUT_PATHS = ("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1")  # `--out` naming stdout: written to it, not opened
FROM_CONFIG = object()  # `compact --every` without SECONDS: [compaction] every_seconds


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "query",
        parents=[common],
        help="run SQL over the stored data (views: interactions, feedback, trajectories, dead_letters, "
        "train_steps, adapters)",
        description="Runs one DuckDB SQL statement over the data dir, e.g. "
        "clora query \"select tenant, count(*), avg(reward) from trajectories group by 1\"",
    )
    p.add_argument("sql", help="the SQL statement")
    p.add_argument("--format", choices=FORMATS, default="table", help="output format (default: a readable table)")
    p.add_argument("--out", metavar="FILE", default=None, help="write to FILE instead of stdout (required for parquet)")
    p.set_defaults(func=cmd_query)

    p = sub.add_parser(
        "status",
        parents=[common],
        help="one line per tenant: the version served, the learner's state, its last reward, its backlog",
        description="What the data dir says now, without asking a running process: each tenant's served version "
        "(registry/HEAD.json), the learner's state of it (state/learner/status*.json: status, step, last mean "
        "reward, error), its untrained trajectories, and which clora processes marked themselves ready here "
        "(and whether each still runs, on this host). Exit 0; 1 when a tenant's last step failed or something it "
        "reads cannot be read (each such problem is listed).",
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("adapters", parents=[common], help="list, inspect, roll back or retire adapter versions")
    actions = p.add_subparsers(dest="adapters_command", metavar="ACTION", required=True)
    a = actions.add_parser(
        "list", parents=[common], help="one line per version that can still change (--all: every one)",
        description="One line per adapter version that can still change: candidates, published versions that keep "
        "their files, rejected ones kept to inspect. `latest` marks the version serving routes the tenant to "
        "(registry/HEAD.json). --all lists the whole history, as far as retention has kept its records. Exit 1 "
        "for a tenant with no versions that is not in the config.",
    )
    a.add_argument("--tenant", type=_tenant, default=None, help="only this tenant's versions")
    a.add_argument("--all", action="store_true",
                   help="the whole history, retired and settled rejects too (a learner adds a version per step)")
    a.set_defaults(func=cmd_adapters_list)
    a = actions.add_parser(
        "show", parents=[common], help="every field of one version, as JSON",
        description="Every field of one adapter version's registry record as JSON (status, parent, reason, gate "
        "checks, metrics, times), with its files' path and whether they are still there. Exit 1 for a version "
        "that does not exist.",
    )
    a.add_argument("version", type=_version, help="tenant@n")
    a.set_defaults(func=cmd_adapters_show)
    a = actions.add_parser(
        "rollback", parents=[common], help="serve an older version again (republished as a new newest version)",
        description="Copies an older version's files into a new newest published version whose parent is the old "
        "one (history is never rewritten); serving picks it up at its next registry poll, and the learner goes "
        "on from it. Refused for the version already served.",
    )
    a.add_argument("version", type=_version, help="tenant@n to roll back to")
    a.set_defaults(func=cmd_adapters_rollback)
    a = actions.add_parser(
        "retire", parents=[common], help="delete a version's files (its record stays)",
        description="Deletes a version's files; its record stays, with status retired, and the learner trains "
        "none of its samples. Retiring the version served moves the tenant to its newest published version left, "
        "or to the base model, from serving's next registry poll; the command says which.",
    )
    a.add_argument("version", type=_version, help="tenant@n")
    a.set_defaults(func=cmd_adapters_retire)

    p = sub.add_parser(
        "compact",
        parents=[common],
        help="merge small Parquet files per tenant (safe while ingest and the learner run)",
        description="Merges each tenant's small Parquet files of each dataset into one compacted file (and the "
        "learner's cursors), deleting the inputs after a grace period so running queries finish. Safe at any "
        "moment while ingest and the learner run.",
    )
    p.add_argument("--dataset", choices=COMPACTED, default=None,
                   help="only this dataset (default: all, and the learner cursors)")
    p.add_argument("--tenant", type=_data_tenant, default=None, help="only this tenant")
    p.add_argument(
        "--grace",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="delete merged inputs only once the merged file is this old, so running queries finish "
        "(default: [compaction] grace_seconds, 60; 0 deletes them now)",
    )
    p.add_argument(
        "--every",
        type=positive,
        nargs="?",
        const=FROM_CONFIG,
        default=None,
        metavar="SECONDS",
        help="run again every SECONDS until stopped (SIGTERM, Ctrl-C), pruning after each run when "
        "[retention] days is set; without SECONDS, every [compaction] every_seconds (600), as `clora up` runs it",
    )
    p.set_defaults(func=cmd_compact)

    p = sub.add_parser(
        "prune",
        parents=[common],
        help="delete stored data older than the retention, whole files at a time (safe while clora runs)",
        description="Deletes the Parquet files whose rows were all ingested longer ago than the retention "
        "([retention] days, or --older-than-days), the registry records of settled adapter versions last written "
        "before then, and the ids the learner's cursors keep of steps committed before then. --dry-run says what "
        "would go.",
    )
    p.add_argument(
        "--older-than-days",
        type=retention_days,
        default=None,
        metavar="DAYS",
        help="delete files whose rows were all ingested more than DAYS ago (default: [retention] days)",
    )
    p.add_argument("--dataset", choices=PRUNED, default=None, help="only this dataset (default: all of these)")
    p.add_argument("--tenant", type=_data_tenant, default=None, help="only this tenant")
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    p.set_defaults(func=cmd_prune)


def _seconds(text: str) -> float:
    """--grace: a finite number of seconds, 0 or more (NaN passed every check and no merged input was ever
    old enough to delete)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds, 0 or more")
    return value


def _usage_error_of(check):
    """`check(text)` as an argparse type: the StorageError it raises is a usage error (exit 2), found before
    anything touches the data dir."""
    def argument(text: str):
        from storage.layout import StorageError

        try:
            return check(text)
        except StorageError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return argument


def _parse_version(text: str) -> tuple[str, int]:  # imported when used: `clora --help` stays light
    from storage.registry import parse_version

    return parse_version(text)


def _check_tenant(text: str, allow_unknown: bool = False) -> str:
    from storage.layout import check_tenant

    return check_tenant(text, allow_unknown=allow_unknown)


_version = _usage_error_of(_parse_version)  # tenant@n, as (tenant, n)
_tenant = _usage_error_of(_check_tenant)  # --tenant of `adapters list` (a path such as ../x is a usage error)
# --tenant of `compact` and `prune`: a tenant's name, or `_unknown` (dead letters of no readable tenant)
_data_tenant = _usage_error_of(functools.partial(_check_tenant, allow_unknown=True))


def _config(args: argparse.Namespace, *, writes: bool = False):
    """The config, with the data dir checked as the command will use it.

    A data dir that does not exist gets the note every reading command prints (config_from_args's) and is
    not created, even by a command that writes: nothing is stored there, so a write has nothing to act on
    (no version to roll back or retire, no file to compact or prune), and a typo in --config or
    CLORA_DATA_DIR must not leave an empty data dir behind. One that cannot be listed, or, for a command that
    writes, written in or made (a file on its path), is one line, `clora: data_dir <path>: <reason>`, exit 2,
    as config_from_args makes a data_dir that is a file: not a failure of every part of the command."""
    import os
    from pathlib import Path

    from clora.cli import config_from_args, data_dir_error, missing_data_dir_note, prepare_data_dir

    cfg = config_from_args(args, reads_data_dir=not writes)
    data_dir = Path(cfg.data_dir)
    if not writes and not data_dir.exists():  # config_from_args printed the note
        return cfg
    try:
        os.listdir(data_dir)
        if writes:
            prepare_data_dir(data_dir, create=False)
    except FileNotFoundError:  # listdir's: missing, where a folder could be made (a reading command returned above)
        print(missing_data_dir_note(data_dir), file=sys.stderr)
    except OSError as e:
        print(data_dir_error(data_dir, e), file=sys.stderr)
        raise SystemExit(2) from None
    return cfg


# ---------------------------------------------------------------------------------------------------------
# query


def cmd_query(args: argparse.Namespace) -> int:
    import duckdb

    from storage.layout import StorageError
    from storage.query import query

    cfg = _config(args)  # an unreadable data dir: `clora: data_dir …`, exit 2, as for the other storage commands
    if args.format == "parquet" and not args.out:
        print("clora query: --format parquet needs --out FILE", file=sys.stderr)
        return 2
    try:
        statements = len(duckdb.extract_statements(args.sql))
    except duckdb.Error:  # not SQL: running it reports DuckDB's own error, pointing at the spot
        statements = 1
    if statements != 1:
        print(f"clora query: give one SQL statement (got {statements}); run each on its own" if statements
              else "clora query: no SQL statement given", file=sys.stderr)
        return 2
    try:
        table = query(cfg.data_dir, args.sql)
    except KeyboardInterrupt:  # query() interrupted DuckDB; nothing was written
        print("clora query: interrupted", file=sys.stderr)
        return 130
    except duckdb.Error as e:  # parser, binder, IO errors: the message, not a traceback
        print(f"clora query: {duckdb_error_line(e, args.sql)}", file=sys.stderr)
        return 1
    except (StorageError, OSError) as e:
        print(f"clora query: {e}", file=sys.stderr)
        return 1
    except (ValueError, OverflowError) as e:  # a result Arrow cannot hold
        print(f"clora query: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    try:
        write_table(table, args.format, args.out)
    except KeyboardInterrupt:  # write_table leaves no partial --out file
        print("clora query: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # --out in a missing directory, a full disk
        where = args.out if args.out else "stdout"  # the file named, not the hidden one written first
        print(f"clora query: cannot write the result to {where}: {e.strerror or e}", file=sys.stderr)
        return 1
    except (OverflowError, ValueError) as e:  # a value Python cannot hold ('infinity'::date), an unwritable type
        print(f"clora query: cannot convert the result to {args.format}: {type(e).__name__}: {e} "
              "(cast the column to VARCHAR in the SQL)", file=sys.stderr)
        return 1
    return 0


# DuckDB's pointer into the statement, under its message: "LINE <n>: <that line, cut around the spot>" and
# a row of ^ under the offending token.
_ERROR_CONTEXT = re.compile(r"\s*\nLINE (\d+): (.*)\n( *)(\^+)\s*$")
_MISSING_TABLE = re.compile(r"Table with name .* does not exist")
_SUGGESTION = re.compile(r'\s*Did you mean "([^"]*)"\?')
# DuckDB's words for a file it cannot read as Parquet (a cut-short copy, bytes changed on disk).
_DAMAGED_FILE = re.compile(r"too small to be a Parquet file|No magic bytes|decompression failure|Invalid Parquet"
                           r"|Failed to read file", re.IGNORECASE)


def duckdb_error_line(e: Exception, sql: str | None = None) -> str:
    """DuckDB's message for `e` on one line: its pointer block becomes "(line N, at "token")", continuation
    lines (candidate columns, functions) are joined on, and for a table that does not exist a suggestion
    that is not one of the views (DuckDB's catalog tables, "pg_enum", and clora's own "_clora_*") gives way
    to the list of views. Given the user's statement `sql`, a pointer at a token it does not hold (one into
    a view's own SQL, as for a damaged data file) is left out, and a data file DuckDB cannot read as
    Parquet is named as damaged."""
    import duckdb

    from storage.query import VIEWS

    text, where = str(e).strip(), ""
    if m := _ERROR_CONTEXT.search(text):
        text = text[: m.start()]
        line, shown, pad, marks = m.groups()
        token = _under_marks(shown, len(pad) - len(f"LINE {line}: "), len(marks))
        # A parser error names the token already ("syntax error at or near "selec"").
        where = f" (line {line})" if not token or f'"{token}"' in text else f' (line {line}, at "{token}")'
        if sql is not None and token and token not in sql:
            where = ""
    text = " ".join(part.strip() for part in text.splitlines() if part.strip())
    if _MISSING_TABLE.search(text):
        suggestion = _SUGGESTION.search(text)
        if suggestion is None or suggestion.group(1).rsplit(".", 1)[-1].lower() not in VIEWS:
            text = _SUGGESTION.sub("", text) + f" (the views are {', '.join(VIEWS)})"
    if isinstance(e, duckdb.InvalidInputException) and ".parquet" in text and _DAMAGED_FILE.search(text):
        text += (" (a damaged data file: restore it, or move it out of the data dir if the rows only it holds"
                 " are not needed)")
    return text + where


def _under_marks(shown: str, start: int, width: int) -> str:
    """The text of `shown` under the marks at columns [start, start + width): DuckDB counts columns as a
    terminal shows them, so a wide character (CJK) takes two and a combining mark, tab or control none (it
    goes with the character before it)."""
    import unicodedata

    column, under, inside = 0, [], False
    for ch in shown:
        if unicodedata.combining(ch) or unicodedata.category(ch) in ("Cc", "Cf", "Me", "Mn"):
            if inside:
                under.append(ch)
            continue
        inside = start <= column < start + width
        if inside:
            under.append(ch)
        column += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return "".join(under).strip()


def write_table(table, fmt: str, out: str | None) -> None:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        table = table.rename_columns(_unique_names(table.column_names))  # readable by name
        _write_whole(out, lambda f: pq.write_table(table, f))
        return
    text = {"table": format_table, "csv": format_csv, "json": format_json}[fmt](table)
    if out:
        _write_whole(out, lambda f: f.write(text.encode("utf-8")))
    else:
        sys.stdout.write(text)


def _write_whole(out: str, write) -> None:
    """`write(f)` into a binary file, a hidden sibling of `out` that is renamed over it once complete, so a
    write that fails or is interrupted (Ctrl-C, a full disk) leaves no partial file and the previous one
    intact; the previous file's permissions carry over. A symbolic link is followed (the file it names is
    replaced, the link stays). `--out /dev/stdout` (STDOUT_PATHS) is written to this process's stdout as it
    is open (opening the name again would truncate a file the shell opened with `>>`). Any other device,
    pipe, or path in or through /dev or /proc is written as it is: renaming over it would replace the
    device's name itself. Python opens the file, so an OSError says why in `strerror`, without the
    hidden file's name."""
    import os
    import stat
    from pathlib import Path

    from storage.files import fsync_dir, tmp_name

    if os.path.abspath(out) in STDOUT_PATHS:  # this process's stdout, as the shell opened it (`>>` appends)
        sys.stdout.flush()
        write(sys.stdout.buffer)
        sys.stdout.buffer.flush()
        return
    if _written_in_place(out):
        with open(out, "wb") as f:
            write(f)
        return
    final = Path(os.path.realpath(out))
    tmp = tmp_name(final)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # durable before it replaces the previous file: a power loss leaves one of them
        try:
            os.chmod(tmp, stat.S_IMODE(final.stat().st_mode))
        except FileNotFoundError:  # a new file: the umask's mode, as open() gave it
            pass
        os.replace(tmp, final)
        fsync_dir(final.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _written_in_place(out: str) -> bool:
    """Whether `--out` is written as it is rather than replaced: a device or pipe, or a path in or through
    /dev or /proc (their names cannot be renamed over; as root, /dev/stdout itself would be)."""
    import os
    from pathlib import Path

    given, final = Path(os.path.abspath(out)), Path(os.path.realpath(out))
    if any(p.parts[1:2] in (("dev",), ("proc",)) for p in (given, final)):
        return True
    return final.exists() and not final.is_file()


def _rows(table) -> list[tuple]:
    """The rows as tuples, by position: to_pylist()'s dicts keep one value per name, and a join's `select *`
    repeats names."""
    return list(zip(*(column.to_pylist() for column in table.columns)))


def format_table(table) -> str:
    """Aligned columns, long cells cut to MAX_CELL characters, and a row count."""
    names = table.column_names
    rows = [[_cell(v) for v in row] for row in _rows(table)]
    widths = [max([len(n)] + [len(r[i]) for r in rows]) for i, n in enumerate(names)]
    lines = [
        "  ".join(n.ljust(w) for n, w in zip(names, widths)),
        "  ".join("-" * w for w in widths),
        *("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows),
    ]
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _cell(v) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        s = f"{v:.6g}"
    elif isinstance(v, datetime.datetime):
        s = v.isoformat(sep=" ", timespec="milliseconds")
    elif hasattr(v, "isoformat"):  # date, time
        s = v.isoformat()
    else:
        s = str(v)
    s = s.replace("\n", "\\n")
    return s if len(s) <= MAX_CELL else s[: MAX_CELL - 1] + "…"


def format_csv(table) -> str:
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(table.column_names)
    for row in _rows(table):
        w.writerow(["" if v is None else v for v in row])
    return buf.getvalue()


def format_json(table) -> str:
    """A JSON array of row objects (timestamps as ISO 8601, bytes as latin-1 text, NaN and infinities as
    null, which is all JSON has for them). A repeated column name gets a suffix: id, id_1, id_2, ..."""
    import json

    def default(v):
        if hasattr(v, "isoformat"):
            return v.isoformat()
        if isinstance(v, bytes):
            return v.decode("latin-1")
        return str(v)

    keys = _unique_names(table.column_names)
    rows = [dict(zip(keys, (_finite(v) for v in row))) for row in _rows(table)]
    return json.dumps(rows, default=default, ensure_ascii=False, indent=1, allow_nan=False) + "\n"


def _unique_names(names: list[str]) -> list[str]:
    """`names` with each repeat suffixed _1, _2, ... (skipping any name another column has)."""
    original, used, out = set(names), set(), []
    for name in names:
        key, k = name, 0
        while key in used:
            k += 1
            key = f"{name}_{k}"
            if key in original:
                key = name  # another column's own name: try the next suffix
        used.add(key)
        out.append(key)
    return out


def _finite(v):
    """`v` with every non-finite float in it (nested in lists, structs and maps too) made None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


# ---------------------------------------------------------------------------------------------------------
# adapters


def _registry(args: argparse.Namespace, *, writes: bool = False):
    from storage.registry import Registry

    cfg = _config(args, writes=writes)
    return Registry(cfg.data_dir, keep_last=cfg.learner.keep_versions)


# Besides StorageError, what a registry record damaged by hand raises when read (bad JSON, a missing or
# mistyped field) and what a disk error does: one line on stderr, not a traceback.
UNREADABLE = (OSError, ValueError, KeyError, TypeError)


def _fail(command: str, e: Exception, context: str = "a registry record cannot be read") -> int:
    """Prints why `command` failed; `context` says what went wrong for a damaged record (a value the
    registry did not expect). An OSError is the file or directory it names and the system's reason: a
    registry/ folder that cannot be listed is not a damaged record."""
    from storage.layout import StorageError

    if isinstance(e, StorageError):
        print(f"clora adapters {command}: {e}", file=sys.stderr)
    elif isinstance(e, OSError) and e.filename and e.strerror:
        print(f"clora adapters {command}: {e.filename}: {e.strerror}", file=sys.stderr)
    else:
        print(f"clora adapters {command}: {context} ({type(e).__name__}: {e})", file=sys.stderr)
    return 1


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from storage.status import gather, table

    cfg = _config(args)
    report = gather(cfg)
    print(json.dumps(report, indent=1, allow_nan=False) if args.json else table(report))
    # A status file (or a backlog) that cannot be read may hide a failing tenant: not "healthy" either.
    return 1 if report["problems"] or any(t["status"] == "error" for t in report["tenants"]) else 0


def cmd_adapters_list(args: argparse.Namespace) -> int:
    from clora.cli import config_from_args
    from storage.layout import StorageError
    from storage.query import adapters_table, served_or_none
    from storage.registry import UnreadableRecord

    registry = _registry(args)
    try:
        if args.tenant is not None and args.tenant not in registry.tenants():
            # No versions: a tenant of the config that has not published yet, or a typo (which must not look
            # like a tenant without versions).
            if config_from_args(args).tenant(args.tenant) is None:
                known = ", ".join(registry.tenants()) or "none"
                print(f"clora adapters list: tenant {args.tenant!r} has no adapter versions and is not in the "
                      f"config (tenants with versions: {known})", file=sys.stderr)
                return 1
        if args.all:
            versions, hidden = registry.versions(args.tenant), 0
        else:
            tenants = [args.tenant] if args.tenant is not None else registry.tenants()
            versions, hidden = [], 0
            for t in tenants:
                try:
                    # Settled ones the registry's hint has not caught up with yet (files gone) are history too.
                    mine = [v for v in registry.unsettled(t) if v.retired_at is None or v.path.exists()]
                except UnreadableRecord as e:
                    if args.tenant is not None:
                        raise
                    print(f"clora adapters list: tenant {t!r} left out: {e}", file=sys.stderr)  # the others still list
                    continue
                versions += mine
                # What --all would add: the records on disk (retention deletes settled ones: the numbers
                # are not all there), not the newest number.
                hidden += len(set(registry.numbers(t)) - {v.number for v in mine})
        served = served_or_none(registry)  # what `latest` marks: what serving routes to
    except (StorageError, *UNREADABLE) as e:
        return _fail("list", e)
    columns = ["name", "status", "latest", "parent", "created_at", "published_at", "reason", "metrics"]
    sys.stdout.write(format_table(adapters_table(versions, served).select(columns)))
    if hidden > 0:
        print(f"({hidden} older versions, retired or rejected with their files gone, not shown: --all lists them)")
    return 0


def cmd_adapters_show(args: argparse.Namespace) -> int:
    import json

    from storage.layout import StorageError

    tenant, number = args.version
    registry = _registry(args)
    try:
        v = registry.get(tenant, number)
    except (StorageError, *UNREADABLE) as e:
        return _fail("show", e, f"the registry record of {tenant}@{number} cannot be read")
    print(json.dumps({**v.to_json(), "path": str(v.path), "files_present": v.path.is_dir()}, indent=2))
    return 0


def cmd_adapters_rollback(args: argparse.Namespace) -> int:
    from storage.layout import StorageError

    tenant, number = args.version
    registry = _registry(args, writes=True)
    try:
        v = registry.rollback(tenant, number)  # looks the version up before it writes anything
    except (StorageError, *UNREADABLE) as e:
        return _fail("rollback", e, f"rolling back to {tenant}@{number} failed")
    print(f"{v.name} published (a copy of {v.parent}); serving picks it up at its next registry poll")
    return 0


def cmd_adapters_retire(args: argparse.Namespace) -> int:
    from storage.layout import StorageError

    tenant, number = args.version
    registry = _registry(args, writes=True)
    try:
        # Looked up first: retire takes the registry's lock, and a version that does not exist must not
        # leave a lock file (or a data dir) behind.
        registry.get(tenant, number)
        before = _served(registry, tenant)  # None when it cannot be read: the retire goes on
        v = registry.retire(tenant, number)
    except (StorageError, *UNREADABLE) as e:
        return _fail("retire", e, f"retiring {tenant}@{number} failed")
    after = _served(registry, tenant)
    if after is None:  # the retire is done: only what follows from it cannot be said
        print(f"{v.name} retired; its files are deleted (what {tenant} is served now cannot be read: "
              f"clora adapters list --tenant {tenant})")
    elif after == before:
        print(f"{v.name} retired; its files are deleted; {tenant} is still served {after}")
    else:
        print(f"{v.name} retired; its files are deleted; {tenant} is now served {after} (from serving's next "
              "registry poll)")
    return 0


def _served(registry, tenant: str) -> str | None:
    """What serving gives `tenant`: its newest published version's name, or "the base model"; None when the
    registry cannot say (a record that cannot be read)."""
    from storage.layout import StorageError

    try:
        v = registry.latest_published(tenant)
    except (StorageError, *UNREADABLE):
        return None
    return "the base model" if v is None else v.name


# ---------------------------------------------------------------------------------------------------------
# compact


def cmd_compact(args: argparse.Namespace) -> int:
    from clora.cli import config_from_args, ensure_data_dir

    # The loop is a service beside ingest and the learner (`clora up`): it marks itself ready under the data
    # dir, and a data dir not there yet fills up as they run (made once its options are checked). A single
    # run on a missing one has nothing to do.
    cfg = _config(args, writes=True) if args.every is None else config_from_args(args)
    grace = cfg.compaction.grace_seconds if args.grace is None else args.grace
    if not_a_tenant := _not_a_tenant(cfg, args.tenant):
        print(f"clora compact: {not_a_tenant}", file=sys.stderr)
        return 1
    if args.every is None:
        return _compact_once(cfg, args, grace)
    if args.every is FROM_CONFIG:
        if cfg.compaction.every_seconds <= 0:
            print("clora compact: --every without SECONDS takes [compaction] every_seconds, which is 0 (off); "
                  "set it or pass --every SECONDS", file=sys.stderr)
            return 2
        args.every = cfg.compaction.every_seconds
    ensure_data_dir(cfg)
    return _compact_every(cfg, args, grace)


def _not_a_tenant(cfg, tenant: str | None) -> str | None:
    """Why `--tenant` names no tenant, or None: one neither in the config nor with anything in the data dir
    (a typo, which must not look like a tenant with nothing to do, as in `adapters list`). `_unknown`, the
    dead letters of no readable tenant, is one."""
    from storage.cursors import Cursors
    from storage.layout import DATASETS, UNKNOWN_TENANT, StorageError
    from storage.parquet import partition_tenants
    from storage.registry import Registry

    if tenant is None or tenant == UNKNOWN_TENANT or cfg.tenant(tenant) is not None:
        return None
    try:
        on_disk = {t for dataset in DATASETS for t in partition_tenants(cfg.data_dir, dataset)}
        on_disk |= {*Registry(cfg.data_dir).tenants(), *Cursors(cfg.data_dir).tenants()}
    except (StorageError, OSError) as e:  # a part of the data dir that cannot be listed
        return str(e)
    if tenant in on_disk:  # no longer configured, or created on the fly (ingest.unknown_tenant = "create")
        return None
    known = ", ".join(sorted(on_disk - {UNKNOWN_TENANT})) or "none"
    return f"tenant {tenant!r} has no data and is not in the config (tenants with data: {known})"


def _compact_once(cfg, args: argparse.Namespace, grace: float) -> int:
    """One run; a partition's, dataset's or cursor's failure is its line on stderr (compact() logs its
    traceback at DEBUG only), what went well a line on stdout."""
    from pathlib import Path

    from storage.compact import compact
    from storage.layout import StorageError

    if not Path(cfg.data_dir).exists():  # nothing stored (_config said so); a named tenant's lock would create it
        results = []
    else:
        try:
            results = compact(cfg.data_dir, args.dataset, args.tenant, grace_s=grace)
        except (StorageError, OSError) as e:  # compact() reports its partitions' own; this is what is left
            print(f"clora compact: {e}", file=sys.stderr)
            return 1
    for r in results:
        if r.inputs or r.removed or r.waiting or r.skipped or r.left_out or r.error:
            print(r, file=sys.stderr if r.error else sys.stdout, flush=True)
    merged = sum(r.inputs for r in results)
    print(f"compacted {merged} files in {sum(1 for r in results if r.outputs)} partition(s)", flush=True)
    failed = [r.where for r in results if r.error]
    if failed:  # the others were compacted; the run as a whole did not do what was asked
        print(f"clora compact: {len(failed)} failed: {', '.join(failed)} (see above)", file=sys.stderr, flush=True)
        return 1
    return 0


def _compact_every(cfg, args: argparse.Namespace, grace: float) -> int:
    """The loop `clora up` runs: a run every `args.every` seconds until SIGTERM or Ctrl-C, each followed by
    `clora prune` when `[retention] days` is set. A run that fails
    (a disk error, a file that will not read) is reported and the next one comes on time."""
    import signal
    import time

    from clora.up import StopFlag
    from storage.files import clear_ready, mark_ready
    from storage.layout import DataDir

    stop = StopFlag()  # not a threading.Event: its set() in a handler can deadlock against the loop's wait()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    mark_ready(DataDir(cfg.data_dir).state, "compactor")
    print(f"compacting {cfg.data_dir} every {args.every:g}s (Ctrl-C to stop)", flush=True)
    prunes = cfg.retention.days > 0 and args.dataset in (None, *PRUNED)
    if cfg.retention.days > 0 and not prunes:  # said once, not as a failure of every run
        print(f"[retention] days is set, but {args.dataset} is not pruned: only compacted", flush=True)
    while not stop.is_set():
        started = time.monotonic()
        try:
            _compact_once(cfg, args, grace)
        except Exception as e:  # noqa: BLE001 (one failed run must not end the loop; the next may succeed)
            print(f"clora compact: this run failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if prunes:  # on its own: a compaction that keeps failing must not stop retention
            try:
                _prune(cfg, cfg.retention.days, args.dataset, args.tenant, dry_run=False, command="compact")
            except Exception as e:  # noqa: BLE001
                print(f"clora compact: pruning failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        stop.wait(max(0.0, args.every - (time.monotonic() - started)))
    clear_ready(DataDir(cfg.data_dir).state, "compactor")  # a clean stop: a mark left behind says otherwise
    print("compactor stopped", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------------------
# prune


def cmd_prune(args: argparse.Namespace) -> int:
    cfg = _config(args, writes=not args.dry_run)
    days = cfg.retention.days if args.older_than_days is None else args.older_than_days
    if days <= 0:
        print("clora prune: no retention: give --older-than-days DAYS, or set [retention] days in the config",
              file=sys.stderr)
        return 2
    if short := cfg.retention_too_short(days):
        print(f"clora prune: --older-than-days {short}", file=sys.stderr)
        return 2
    if not_a_tenant := _not_a_tenant(cfg, args.tenant):
        print(f"clora prune: {not_a_tenant}", file=sys.stderr)
        return 1
    return _prune(cfg, days, args.dataset, args.tenant, dry_run=args.dry_run, command="prune")


def _prune(cfg, days: float, dataset: str | None, tenant: str | None, *, dry_run: bool, command: str) -> int:
    """Prunes each part on its own; a failure is its line on stderr (the storage functions log its traceback
    at DEBUG only), what went well a line on stdout."""
    from pathlib import Path

    from storage.layout import UNKNOWN_TENANT, StorageError
    from storage.retention import DAY_S, PartlyDone, forget_trained, prune, prune_registry, prune_spool_dead

    older_than_s = days * DAY_S
    # Dead letters without a readable tenant (_unknown) have data files only: no adapters, no learner cursor.
    data_only = bool(dataset) or tenant == UNKNOWN_TENANT
    failed = []

    def step(what: str, default, run):
        """Each part on its own: one that fails (a directory that cannot be listed, a full disk) must not
        keep the others from running, or one bad directory turns retention off for everything."""
        try:
            return run()
        except (StorageError, ValueError, OSError) as e:
            print(f"clora {command}: {what}: {e}", file=sys.stderr, flush=True)
            failed.append(what)
            return e.done if isinstance(e, PartlyDone) else default  # what the other tenants' parts did

    kw = dict(older_than_s=older_than_s, dry_run=dry_run)
    if not Path(cfg.data_dir).exists():  # nothing stored (_config said so); a named tenant's locks would create it
        results, records, forgotten, spooled = [], {}, {}, 0
    else:
        results = step("data files", [], lambda: prune(cfg.data_dir, dataset=dataset, tenant=tenant, **kw))
        records = {} if data_only else step("adapter records", {},
                                            lambda: prune_registry(cfg.data_dir, tenant=tenant, **kw))
        forgotten = {} if data_only else step("trained ids", {},
                                              lambda: forget_trained(cfg.data_dir, tenant=tenant, **kw))
        spooled = 0 if data_only or tenant else step("serving dead letters", 0,
                                                     lambda: prune_spool_dead(cfg.data_dir, **kw))
    for r in results:
        if r.files or r.skipped or r.unreadable or r.error:
            print(r, file=sys.stderr if r.error else sys.stdout, flush=True)
    failed += [r.where for r in results if r.error]
    verb = "would delete" if dry_run else "deleted"
    print(f"pruned (older than {days:g} days): {verb} {sum(r.files for r in results)} files, "
          f"{sum(r.rows for r in results)} rows, {sum(r.bytes for r in results) / 1e6:.1f} MB, "
          f"{sum(records.values())} adapter version records, {spooled} serving dead-letter day files; "
          f"{sum(forgotten.values())} trained ids forgotten", flush=True)
    if failed:  # the rest was pruned; the run as a whole did not do what was asked
        print(f"clora {command}: pruning failed for {len(failed)}: {', '.join(failed)} (see above)", file=sys.stderr,
              flush=True)
        return 1
    return 0
