"""The `clora` console entry point: one argparse tree that hands each subcommand to the package owning it.

Each package keeps its command-line surface in its own `cli.py` with a function
`add_commands(sub, common)` that registers one or more subparsers and sets `func=<callable(args) -> int>`
on each. Those modules import only argparse at module level, so `clora --help` stays fast; the heavy
imports (torch, vLLM, kafka) happen inside the command that needs them.

Every subcommand accepts `--config` (the parent parser `common`); `args.config_path` then holds it and
`clora.cli.config_from_args(args)` loads the typed config once.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import logging
import os
import select
import sys
import tempfile
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

# Modules that contribute subcommands, in the order `clora --help` lists them.
COMMAND_MODULES = (
    "clora.commands",  # up, demo, simulate, config
    "serving.cli",  # serve
    "ingest.cli",  # ingest, broker
    "learner.cli",  # learn, model
    "storage.cli",  # query, adapters, compact, prune
    "clora.bench",  # bench
)


def _config_file(text: str) -> str:
    """--config's value: not empty (`--config "$UNSET"` fell back to ./clora.toml or the built-in defaults)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (an unset variable?): name a TOML file, or leave --config out")
    return text


def common_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config",
        dest="config_path",
        metavar="FILE",
        type=_config_file,
        default=argparse.SUPPRESS,  # so a subcommand's parser does not reset a value given before it
        help="clora.toml to load (default: $CLORA_CONFIG, else ./clora.toml if present, else built-in defaults)",
    )
    return common


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("clora")
    except metadata.PackageNotFoundError:  # run from a source tree that was not installed
        return "(not installed)"


def build_parser(modules: Sequence[str] = COMMAND_MODULES) -> argparse.ArgumentParser:
    common = common_parser()
    parser = argparse.ArgumentParser(
        prog="clora",
        description="Continual multi-LoRA reinforcement learning fed by production traffic.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"clora {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # the package has no command-line surface yet
                continue
            raise
        module.add_commands(sub, common)
    return parser


def config_from_args(args: argparse.Namespace, *, writes_data_dir: bool = False, reads_data_dir: bool = False):
    """Loads the config named by --config (or the defaults); exits with the listed problems if it is bad.
    `writes_data_dir`: the command writes under data_dir, which is then created and checked first, so that
    a path that cannot be used is one line (`clora: data_dir X: <reason>`, exit 2), not a traceback later.
    `reads_data_dir`: the command only reads it: a data_dir that is not a directory is that same line, and
    one that does not exist a note on stderr (an empty answer from the wrong directory says nothing)."""
    from clora.config import ConfigError, load_config, unknown_env_variables

    try:
        cfg = load_config(getattr(args, "config_path", None))
    except ConfigError as e:
        print(f"clora: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for line in unknown_env_variables().values():
        print(f"clora: warning: {line}", file=sys.stderr)
    setup_logging(cfg.log_level)
    raise_open_files_limit()
    if writes_data_dir:
        ensure_data_dir(cfg)
    elif reads_data_dir:
        data_dir = Path(cfg.data_dir)
        if not data_dir.exists():
            print(missing_data_dir_note(data_dir), file=sys.stderr)
        elif not data_dir.is_dir():
            print(data_dir_error(data_dir, NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))),
                  file=sys.stderr)
            raise SystemExit(2)
    return cfg


def missing_data_dir_note(data_dir: Path) -> str:
    """What a command that finds no data dir says (an empty answer from the wrong directory says nothing)."""
    return (f"clora: note: data_dir {data_dir} does not exist: nothing is stored there yet (is it the data "
            "directory you meant? --config, CLORA_DATA_DIR)")


def ensure_data_dir(cfg) -> None:
    """Creates and checks data_dir, for a command that writes there; exits with one line (exit 2) when it
    cannot be used."""
    try:
        prepare_data_dir(cfg.data_dir)
    except OSError as e:
        print(data_dir_error(cfg.data_dir, e), file=sys.stderr)
        raise SystemExit(2) from None


def base_model_dir(cfg) -> Path:
    """The configured base model directory, or the tiny local model (built under <data_dir>/models on first
    use). A configured path that is not a model directory exits with one line (exit 2)."""
    if cfg.model.path is not None:
        problem = model_path_problem(Path(cfg.model.path))
        if problem is not None:
            print(f"clora: {problem}", file=sys.stderr)
            raise SystemExit(2)
        return Path(cfg.model.path)
    from learner.tiny_model import ModelBuildError, ensure_tiny
    from storage.registry import Registry

    registry = Path(cfg.data_dir) / "registry"
    try:
        return ensure_tiny(Path(cfg.data_dir) / "models", cfg.model.seed,
                           adapters_on_it=lambda: registry.is_dir() and bool(Registry(cfg.data_dir).tenants()))
    except ModelBuildError as e:
        print(f"clora: {e}", file=sys.stderr)
        raise SystemExit(2) from None


# What a model directory holds besides config.json: its weights (one file, or shards with an index) and its
# tokenizer, in any of the formats transformers and vLLM load.
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def model_path_problem(path: Path) -> str | None:
    """Why a configured model.path is not a model directory, or None when it is one. Names only what is
    missing; whether the files inside can be read shows when the model is loaded."""
    if not path.exists():
        return f"model.path {path} does not exist"
    if not (path / "config.json").is_file():
        return f"model.path {path} is not a model directory (it has no config.json)"
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES):
        return f"model.path {path} has no weights (no *.safetensors or pytorch_model*.bin)"
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return f"model.path {path} has no tokenizer (no {', '.join(TOKENIZER_FILES)})"
    return None


def prepare_data_dir(path: Path, *, create: bool = True) -> Path:
    """Creates the data directory if needed and checks that clora can write there (by writing a file: the
    permission bits do not tell a read-only or full file system); raises OSError otherwise (before any child
    of `clora up` starts: each would fail on it, and be restarted, over and over). With create=False (a
    check) nothing is created: a data dir not there yet is checked by writing in the nearest folder above it
    that is. Returns the folder written in."""
    path = Path(path)
    if not create:
        while not path.exists() and path.parent != path:
            path = path.parent
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
    path.mkdir(parents=True, exist_ok=True)
    try:
        fd, probe = tempfile.mkstemp(prefix=".clora-write-check-", dir=path)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)
        os.unlink(probe)
    return path


def raise_open_files_limit() -> None:
    """Raises this process's soft limit on open files to its hard limit: the learner holds a lock file open
    per tenant it trains, and at the common soft limit of 1,024 its 1,020th tenant made every open() of the
    process fail (Parquet reads, checkpoints). Children inherit it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a hard limit of "unlimited" some systems refuse as a soft one
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1 << 20), hard))


def data_dir_error(data_dir: Path, e: OSError) -> str:
    """`clora: data_dir X: <reason>` (and the path it concerns when that is another one, under it)."""
    where = f" ({e.filename})" if e.filename and Path(e.filename) != Path(data_dir) else ""
    return f"clora: data_dir {data_dir}: {e.strerror or e}{where}"


class _IsoTimes(logging.Formatter):
    """Times as ISO 8601 with milliseconds and the UTC offset (2026-12-07T09:15:02.118+00:00): lines of several
    processes and days sort and line up with the broker's and Prometheus' own."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return datetime.fromtimestamp(record.created).astimezone().isoformat(timespec="milliseconds")


def setup_logging(level: str = "INFO") -> None:
    line = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=line)
    for handler in logging.getLogger().handlers:  # basicConfig's own (it makes none where handlers exist)
        if handler.formatter is not None and handler.formatter._fmt == line and not isinstance(handler.formatter, _IsoTimes):
            handler.setFormatter(_IsoTimes(line))
    # kafka-python narrates every connection and the HTTP clients every request at INFO (matplotlib its font
    # cache); their warnings and errors still show.
    for noisy in ("kafka", "httpx", "httpx2", "httpcore", "openai", "matplotlib"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    # Except where kafka-python says, at INFO, that records it was to read are gone (deleted by the topic's
    # retention before they were read, or truncated by an unclean leader election): a warning.
    fetcher = logging.getLogger("kafka.consumer.fetcher")
    if logging.getLogger().level <= logging.WARNING:
        fetcher.setLevel(logging.INFO)
        if not any(isinstance(f, _RecordsGone) for f in fetcher.filters):
            fetcher.addFilter(_RecordsGone())
    if not sys.stderr.isatty():
        # A progress bar in a log (or in `clora up`'s prefixed output) is only its cursor moves.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")


class _RecordsGone(logging.Filter):
    """Passes kafka-python's fetcher warnings, and its INFO lines that say records were lost, as warnings."""

    SAYS = ("Fetch offset %s is out of range", "Truncation detected")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        if isinstance(record.msg, str) and record.msg.startswith(self.SAYS):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            return True
        return False


def main(argv: Sequence[str] | None = None) -> int:
    keep_the_current_directory_off_the_path()
    try:  # a Ctrl-C while the parser's modules import (half a second): not a traceback
        parser = build_parser()
    except KeyboardInterrupt:
        return 130
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser, whose usage shows the options it does take
        _chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # another pipe (a query's --out to a FIFO, a child's stdin): a failure, not a reader done
        # The reader of our output went away (`clora config show | head -1`): it has what it wanted. Point
        # stdout at /dev/null so that the interpreter's flush at exit does not fail on the pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command `args` chose, the innermost one."""
    while True:
        chooser = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = None if chooser is None else chooser.choices.get(getattr(args, chooser.dest, None))
        if chosen is None:
            return parser
        parser = chosen


def keep_the_current_directory_off_the_path() -> None:
    """No module in the current directory stands in for an installed one: a user's `ingest.py` or `storage.py`
    there never shadows clora's own packages, nor a `snappy.py` the optional import of a library (kafka-python
    probes for several). `python -m` puts that directory first on sys.path, and a directory on sys.path comes
    before an editable install's finder, so it is taken off. A `python:` scorer's module there is still
    imported: ingest/scorers.py searches the directory for it, last, while it loads. `clora up` starts its
    processes with `python -P -m` so that the directory is not first even for the package the process runs."""
    try:
        cwd = os.getcwd()
    except OSError:  # the directory was deleted: nothing there to import
        return
    sys.path[:] = [p for p in sys.path if p not in ("", cwd)]


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has gone (poll reports an error or hang-up on it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no poll here, or stdout closed or replaced
        return False


if __name__ == "__main__":
    sys.exit(main())
