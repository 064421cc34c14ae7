"""`python -m learner` (and `clora learn`): the learner process.

`main()` reads the config once, resolves the base model (the configured path, or the tiny local model,
built on first use), installs signal handlers (SIGTERM / Ctrl-C: finish the current step, then stop; a
step still waiting for its rollouts is dropped, committing nothing; a second Ctrl-C stops at once) and hands over to `learner.loop.run`, which re-reads the config file every
few seconds to pick up new tenants.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger("learner")


def main_from_args(args: argparse.Namespace) -> int:
    from clora.cli import base_model_dir, config_from_args
    from clora.config import load_config
    from clora.up import StopFlag
    from learner.loop import run
    from clora.metrics_endpoint import MetricsPortError
    from learner.metrics import LearnerMetrics
    from learner.policy import PolicyError

    cfg = config_from_args(args, writes_data_dir=True)
    shard = args.shard  # a Shard (parsed by argparse) or None
    path = base_model_dir(cfg)
    stop = StopFlag()  # not a threading.Event: its set() from the handler can deadlock against the loop's wait()

    def on_signal(signum, _frame):
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        logger.info("signal %d: stopping after the current step", signum)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    config_file = getattr(args, "config_path", None)
    base, k = cfg.learner.metrics_port, shard.index if shard is not None else 0
    try:
        metrics = LearnerMetrics(port=base + k if base else 0, host=cfg.learner.metrics_host,
                                 setting=f"learner.metrics_port {base} + shard {k} (port {base + k})" if k else None)
    except MetricsPortError as e:
        logger.error("clora learn: %s", e)
        return 2
    try:
        learner = run(
            cfg,
            model_path=path,
            reload=lambda: load_config(config_file),
            once=args.once,
            until_idle=args.until_idle,
            max_steps=args.max_steps,
            bars=not args.no_progress,
            stop=stop,
            shard=shard,
            metrics=metrics,
        )
    except PolicyError as e:  # the base model cannot be loaded (a tenant's own failures are its status, below)
        logger.error("clora learn: %s", e)
        return 2
    failed = sorted(name for name, t in learner.tenants.items() if t.status == "error")
    if failed:
        logger.error("tenants whose last step failed: %s", ", ".join(failed))
    return 1 if failed and (args.once or args.until_idle) else 0


def main(argv: Sequence[str] | None = None) -> int:
    from clora.cli import common_parser, keep_the_current_directory_off_the_path
    from learner.cli import add_learn_arguments

    keep_the_current_directory_off_the_path()  # nothing there shadows clora or an installed module

    parser = argparse.ArgumentParser(
        prog="python -m learner", parents=[common_parser()], description="The clora learner process (same as `clora learn`)."
    )
    add_learn_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
