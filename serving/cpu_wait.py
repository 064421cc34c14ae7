"""On CPU, vLLM's processes poll for the next message with short sleeps instead of spinning (a vLLM plugin).

vLLM's shared-memory message queues (engine core <-> worker) let a reader that has just read a message
spin on `sched_yield` for a second before it blocks on its notification socket. On a GPU host that spin
costs a host core nobody needed. On a CPU host the same cores run the model, and in clora the learner
too: on 2 cores, with the engine busy about half the time, the worker process sat at ~99% CPU and the
engine core at ~35%, leaving the learner ~57% of a core. Here each turn of that loop sleeps
`POLL_SLEEP_S` instead of yielding: the reader still sees a message within that time (engine steps take
milliseconds), and an idle reader no longer burns a core. The loop, its one-second window and the
notification socket are vLLM's own; only the pause between polls changes.

`register` is a `vllm.general_plugins` entry point (pyproject.toml), run in every vLLM process. It does
nothing off CPU, or with `CLORA_ENGINE_WAIT=spin` (vLLM's own behaviour).
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

ENV = "CLORA_ENGINE_WAIT"  # "sleep" (default) or "spin"
POLL_SLEEP_S = 0.0002


def pause() -> None:
    time.sleep(POLL_SLEEP_S)


def register() -> None:
    choice = os.environ.get(ENV, "sleep")
    if choice not in ("sleep", "spin"):
        raise ValueError(f"{ENV} must be 'sleep' or 'spin', got {choice!r}")
    from vllm.platforms import current_platform

    if choice == "spin" or not current_platform.is_cpu():
        return
    from vllm.distributed.device_communicators import shm_broadcast

    if not hasattr(shm_broadcast, "sched_yield"):
        logger.warning("vLLM's shm_broadcast has no sched_yield; its queues keep spinning")
        return
    shm_broadcast.sched_yield = pause
    logger.debug("vLLM's message-queue readers sleep %.1f ms between polls", POLL_SLEEP_S * 1e3)
