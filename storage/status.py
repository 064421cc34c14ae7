"""`clora status`: what the data dir says of each tenant and of the processes, read without asking any
of them (a learner, serving or ingest that is down, or on another host, is seen all the same).

Per tenant (those of the config, of the registry, of the learner's status files and of the trajectories):
the version served (registry/HEAD.json, as serving reads it), the learner's state of it (the status files
each learner writes after every step: `state/learner/status.json`, `status-K-of-N.json` per shard), its
last step's mean reward, and its untrained trajectories (the cursors' backlog, as the learner counts it).
Per process: the ready marks under `state/ready/` (which process marked itself ready, its pid, when) and
whether that pid still runs, which says something only on the host that ran it.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from storage.cursors import Cursors
from storage.layout import DataDir
from storage.registry import Registry, UnreadableRecord

ERROR_CHARS = 80  # of a tenant's error, in the table (--json has all of it)


def gather(cfg) -> dict:
    dd = DataDir(cfg.data_dir)
    problems: list[str] = []
    try:
        served = {t: v.name for t, v in Registry(dd).published().items()}
    except UnreadableRecord as e:
        served = {}
        problems.append(str(e))
    learner = _learner_status(dd.state / "learner", problems)
    try:
        cursors = Cursors(dd)
        backlog = cursors.backlog()
        problems += [f"backlog of {t} cannot be read: {why}" for t, why in sorted(cursors.backlog_errors.items())]
        problems += [f"trajectories of {t} left out of training, their file damaged: {path}"
                     for t, paths in cursors.damaged_files().items() for path in paths]
    except OSError as e:
        backlog = {}
        problems.append(f"the trajectories cannot be listed: {e}")
    configured = {t.name for t in cfg.tenants}
    tenants = []
    for name in sorted(configured | set(served) | set(learner) | set(backlog)):
        entry = learner.get(name, {})
        last = entry.get("last") if isinstance(entry.get("last"), dict) else {}
        tenants.append({
            "tenant": name,
            "configured": name in configured,
            "served": served.get(name),
            "status": entry.get("status"),
            "step": entry.get("step"),
            "reward_mean": _finite(last.get("reward_mean")),
            "last_step_at": last.get("ts"),
            "backlog": backlog.get(name, 0),
            "error": entry.get("error"),
        })
    return {"data_dir": str(cfg.data_dir), "processes": _processes(dd.state / "ready"), "tenants": tenants,
            "problems": problems}


def _finite(x):
    """A number for JSON (the learner's files may hold NaN, which strict JSON readers refuse), else None."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def _learner_status(directory: Path, problems: list[str]) -> dict[str, dict]:
    """tenant -> its entry in the learners' status files: the entry of the process that trains it (an
    unsharded learner's file keeps another's entries as "elsewhere"; a shard's lists its own), from the file
    written last where several have one (a shard file of an earlier layout is never deleted)."""
    out: dict[str, dict] = {}
    files = []
    for path in directory.glob("status*.json") if directory.is_dir() else []:
        try:
            files.append((path.stat().st_mtime, path))
        except OSError:
            continue
    for _, path in sorted(files, reverse=True):
        try:
            entries = json.loads(path.read_bytes())
            if not isinstance(entries, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            problems.append(f"{path} cannot be read: {e}")
            continue
        for tenant, entry in entries.items():
            if isinstance(entry, dict) and (tenant not in out or out[tenant].get("status") == "elsewhere"):
                out[tenant] = entry
    return out


def _processes(directory: Path) -> list[dict]:
    out = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            mark = json.loads(path.read_bytes())
            pid, at = int(mark["pid"]), float(mark["at"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out.append({"process": path.stem, "pid": pid, "ready_at": at, "running": _running(pid)})
    return out


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it runs
        return True
    return True


def table(report: dict) -> str:
    now = time.time()
    procs = ", ".join(
        f"{p['process']} (pid {p['pid']}, {'running' if p['running'] else 'not running, no clean stop'}, ready "
        f"{_ago(now - p['ready_at'])} ago)" for p in report["processes"]) or "none marked ready"
    lines = [f"data_dir {report['data_dir']}", f"processes: {procs}", ""]
    header = ("TENANT", "SERVED", "LEARNER", "STEP", "REWARD", "BACKLOG", "ERROR")
    rows = [header] + [(
        t["tenant"] + ("" if t["configured"] else " *"),
        t["served"] or "base",
        t["status"] or "-",
        "-" if t["step"] is None else str(t["step"]),
        "-" if t["reward_mean"] is None else f"{t['reward_mean']:.3f}",
        str(t["backlog"]),
        (t["error"] or "")[:ERROR_CHARS],
    ) for t in report["tenants"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    if not report["tenants"]:
        lines.append("(no tenants: none configured, none in storage)")
    if any(not t["configured"] for t in report["tenants"]):
        lines.append("* not in the config (created by ingest, or removed from the config with data in storage)")
    lines += [f"problem: {p}" for p in report["problems"]]
    return "\n".join(line.rstrip() for line in lines)


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"
