"""Every path clora keeps under its data directory, in one place.

Nothing else in clora joins path segments under the data dir: ingest, learner and serving ask a `DataDir`
(or call the storage functions that do). The tree:

    <root>/
      interactions/tenant=<t>/<file_id>.parquet     every interaction, scored or not   (storage.parquet)
      feedback/tenant=<t>/<file_id>.parquet         every feedback event
      trajectories/tenant=<t>/<file_id>.parquet     scored interactions: what the learner trains on
      dead_letters/tenant=<t>/<file_id>.parquet     rejected messages ("_unknown" when no tenant was readable)
      train_steps/tenant=<t>/<file_id>.parquet      one row per learner step
      adapters/<t>/<n>/                             PEFT files of version <t>@<n>     (storage.registry)
      registry/HEAD.json, registry/<t>/<n>.json     registry metadata: the commit point of a version
      cursors/<t>/step-<step>/                      learner checkpoint + ids trained at that step (storage.cursors)
      state/                                        process-private durable state (ingest offsets, spools)
      state/serving-spool/dead/<YYYY-MM-DD>.jsonl   events Kafka refused for good (serving.spool; pruned by retention)
      state/serving-adapters/<host>-<pid>/          serving's copies of the adapters it loaded
      state/damaged-checkpoints/<t>/step-<step>-<utc>/  learner checkpoints set aside as damaged (storage.cursors)
      models/                                       base models (the tiny local model is built here)
      locks/                                        advisory lock files (compaction, registry, cursors, learner tenants)

What this module deliberately leaves to others: what goes *in* those files (schema.py, registry.py,
cursors.py) and how they are written atomically (files.py).

Storage is a local directory today. Readers list and open files through `DataDir.filesystem` (a pyarrow
`FileSystem`), so the read side moves to object storage by swapping that object; see files.py for what the
write side would need.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.fs as pafs

from clora.config import TENANT_NAME, TENANT_NAME_RULE

DATASETS = ("interactions", "feedback", "trajectories", "dead_letters", "train_steps")

# The partition that holds dead letters whose tenant could not be read. It starts with "_" so it can never
# collide with a configured tenant (TENANT_NAME requires a letter or digit first).
UNKNOWN_TENANT = "_unknown"

# Characters of a Parquet file id: they become a file name, so no separators and no leading dot/underscore
# (hive readers skip names starting with "." or "_").
FILE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class StorageError(Exception):
    """Base of every error the storage package raises on purpose."""


class InvalidName(StorageError, ValueError):
    """A tenant, dataset or file id that cannot be used as a path component."""


def check_tenant(tenant: str, *, allow_unknown: bool = False) -> str:
    """Returns `tenant` if it is a usable tenant name (and so a safe directory name); raises InvalidName."""
    if isinstance(tenant, str) and (TENANT_NAME.match(tenant) or (allow_unknown and tenant == UNKNOWN_TENANT)):
        return tenant
    raise InvalidName(f"tenant {tenant!r} is not a valid tenant name (it must be {TENANT_NAME_RULE})")


def is_tenant(name: str) -> bool:
    """Whether `name` is a usable tenant name (a directory found on disk may be anything)."""
    return isinstance(name, str) and bool(TENANT_NAME.match(name))


def check_dataset(name: str) -> str:
    if name not in DATASETS:
        raise InvalidName(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
    return name


class DataDir:
    """The data directory: `DataDir(root)`; every attribute is a path under `root` (created on demand)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().absolute()  # "~/data" from a config file or a quoted env value
        self.filesystem: pafs.FileSystem = pafs.LocalFileSystem()

    def __repr__(self) -> str:
        return f"DataDir({str(self.root)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DataDir) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    # --- datasets -------------------------------------------------------------------------------------
    def dataset(self, name: str) -> Path:
        return self.root / check_dataset(name)

    def partition(self, dataset: str, tenant: str) -> Path:
        """<root>/<dataset>/tenant=<tenant>: one hive partition."""
        return self.dataset(dataset) / f"tenant={check_tenant(tenant, allow_unknown=True)}"

    # --- adapters and their registry ------------------------------------------------------------------
    @property
    def adapters(self) -> Path:
        return self.root / "adapters"

    def adapter_dir(self, tenant: str, number: int) -> Path:
        return self.adapters / check_tenant(tenant) / str(int(number))

    @property
    def registry(self) -> Path:
        return self.root / "registry"

    # --- learner cursors and checkpoints --------------------------------------------------------------
    @property
    def cursors(self) -> Path:
        return self.root / "cursors"

    def tenant_cursors(self, tenant: str) -> Path:
        return self.cursors / check_tenant(tenant)

    # --- everything else ------------------------------------------------------------------------------
    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def serving_spool(self) -> Path:
        return self.state / "serving-spool"

    @property
    def serving_spool_dead(self) -> Path:
        """One `<YYYY-MM-DD>.jsonl` per UTC day of refusals (serving/spool.py writes them; retention prunes)."""
        return self.serving_spool / "dead"

    def damaged_checkpoints(self, tenant: str) -> Path:
        """Where the learner sets a tenant's damaged checkpoints aside (kept for a look, never read again)."""
        return self.state / "damaged-checkpoints" / check_tenant(tenant)

    @property
    def serving_adapters(self) -> Path:
        return self.state / "serving-adapters"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def locks(self) -> Path:
        return self.root / "locks"


def as_datadir(root: str | Path | DataDir) -> DataDir:
    """Lets every storage function take a path or a DataDir."""
    return root if isinstance(root, DataDir) else DataDir(root)
