"""`rollouts` mode: on-policy GRPO, sampling through the serving tier like any app would.

A step for a tenant:
  1. prompts: `prompts_file` lines (rendered with the chat template, taken in rotation), or the prompts
     of the tenant's untrained production trajectories (storage.cursors), `batch_size // group_size` of them;
  2. G = `group_size` completions per prompt, sampled by a `Sampler`:
       - `ServingSampler` (default, `learner.rollout_sampler = "serving"`): POST /v1/completions with
         `model=<tenant>`, `n=G`, the tenant's api key, through the serving tier's OpenAI-compatible API,
         so the tenant's newest published adapter samples and every tenant's rollouts batch together in
         the one engine. Requests for all rollouts tenants are in flight at once (`Prefetcher`): while the
         learner trains tenant A, tenants B, C, ... are being sampled; with `learner.sample_ahead`, A's
         next batch too (loop.py). Requests carry
         `metadata: {"source": "rollout"}` so the interactions the serving tier logs can be told apart, and
         `priority: learner.rollout_priority` (1) so the engine starts production requests (0) first;
       - `LocalSampler` (`"local"`): the learner's own model (`Policy.generate`); no serving tier needed,
         exactly on-policy, but sampling then takes the learner's time;
  3. rewards from the tenant's programmatic scorer (ingest.scorers.build_scorer; a sample whose scorer
     call fails is left out, counted as `n_score_failed`), GRPO advantages (reward - group mean) / group
     std (maths.grpo_advantages; without the division with `learner.scale_advantages` off);
  4. one importance-weighted policy-gradient update (update.py) on the tokens the engine sampled (the serving tier
     returns them: `return_token_ids`), with their sampled log-probabilities (`logprobs: 0`, vLLM's raw
     ones, at temperature 1) as the behaviour log-probs: a batch sampled ahead by the previous version, or
     by an older one, is importance-weighted (truncated at `learner.behaviour_weight_cap`) instead of
     being taken as on-policy (for samples made by the version being trained the weight is 1). Re-tokenising the text instead would
     train on sequences the policy never produced (a special token sampled mid-text is dropped, invalid
     UTF-8 becomes U+FFFD, a non-canonical split is merged). From a server that does not return them:
     the re-tokenised text, the end-of-sequence token appended to a completion that ended on its own, and
     weight 1. At a `learner.temperature` T other than 1 the engine's log-probs (temperature 1) are not
     the sampling distribution's: the update trains the policy that samples, softmax(logits / T), a
     sample of the current version is on-policy (ratio 1), and an earlier version's sample gets its old
     log-probs recomputed from that version's adapter files (left out as stale once they are pruned).
     The local sampler's samples carry their token ids and are on-policy. Samples made by an
     adapter version more than `learner.max_staleness` served versions behind (the
     `x-clora-adapter-version` header; logs_mode.py says how versions are counted) are left out, unscored.

A step whose samples were all left out (every scorer call failed, every sample stale) raises
`NoUsableSamples`, naming the count and the first reason: nothing is committed, so the step's prompts and
trajectories are not consumed untrained; the tenant backs off and samples again (loop.py). A batch sampled
ahead that went stale while it waited is sampled again by the loop before it gets here (`all_stale`).

The serving tier logs rollouts like any other interaction, so they come back as the tenant's trajectories.
They must never become prompts (the same prompts would be sampled again and again, and the tenant's
backlog would grow by G - 1 rows per prompt per step): a row is recognised as a rollout by its id (the
learner remembers the interaction ids of the completions it sampled: the response `id`, "<id>-<i>" for
choice i when n > 1, as the serving tier names its events) or by `metadata.source == "rollout"`. Such rows
are committed with the step that sees them. A tenant with a prompts file commits its production
trajectories the same way (it learns from the file).

Stopping: sampling runs in daemon threads (`_in_thread`), and the learner waits for it in short waits
that give up once its stop event is set (`Stopped`): a stop does not wait out a request blocked for up to
the HTTP timeout, neither in the loop nor at the process's exit. The step that was waiting commits nothing,
and what its abandoned requests sample is never trained.

Deliberately not here: the HTTP API itself (serving/), scorers (ingest/scorers.py), publishing (loop.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import torch

from clora.loopback import trust_env
from learner import maths
from learner.batch import pack, pad_values
from learner.logs_mode import (
    BehaviourFromLogits,
    fits,
    known_logprob,
    prompt_text,
    row_metadata,
    stale_reason,
    turn_end_id,
    version_number,
)
from learner.policy import Policy, picked_logprobs
from learner.types import Sample
from learner.update import UpdateResult, pg_update

logger = logging.getLogger(__name__)

ROLLOUT_SOURCE = "rollout"
VERSION_HEADER = "x-clora-adapter-version"


class SamplingError(RuntimeError):
    """The sampler could not produce completions (the serving tier refused, timed out, or is down)."""


class Stopped(Exception):
    """The learner is stopping: a wait for samples gave up (the step that waited commits nothing)."""


class NoUsableSamples(RuntimeError):
    """Every sample of a step was left out (failed scoring, stale): there is nothing to train, and the
    step must not commit its trajectories as if there were. `unscorable`: every sample was left out because
    its scorer call failed (a dependency down, or a prompt the scorer cannot handle: retrying may never help)."""

    def __init__(self, message: str, *, unscorable: bool = False):
        super().__init__(message)
        self.unscorable = unscorable


# ---------------------------------------------------------------------------------------------------------
# Prompts


@dataclass(frozen=True)
class RolloutPlan:
    """What one rollouts step samples from, and which trajectory ids the step consumes."""

    prompts: tuple[str, ...]  # rendered prompts
    consumed_ids: tuple[str, ...]  # untrained trajectory ids this step commits (prompt sources and skipped rows)


def render_user_prompt(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def read_prompts_file(path: Path) -> list[str]:
    try:
        lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as e:
        raise SamplingError(f"cannot read prompts_file {path}: {e}") from e
    prompts = [line for line in lines if line]
    if not prompts:
        raise SamplingError(f"prompts_file {path} has no prompts")
    return prompts


def is_rollout_row(metadata_json: str | None) -> bool:
    return row_metadata(metadata_json).get("source") == ROLLOUT_SOURCE


def plan_from_rows(
    rows: pa.Table,
    n_prompts: int,
    *,
    file_prompts: Sequence[str] = (),
    step: int = 0,
    own_rollouts: Collection[str] = (),
    tokenizer=None,
    max_prompt_tokens: int | None = None,
) -> RolloutPlan:
    """The step's prompts: `n_prompts` from `file_prompts` (rotating with `step`) when given, else the
    rendered prompts of the untrained production rows (rows that are the learner's own rollouts, by id
    in `own_rollouts` or by metadata, are not production): as the model sees them (logs_mode.prompt_text,
    which renders a messages-only row with `tokenizer`'s chat template; without a tokenizer, the stored
    text). A row with `prompt_token_ids` (a prompt whose text does not re-tokenize to what was served: sent
    as ids, or given a BOS by serving) gets those ids decoded, special tokens kept as text, which the
    learner's tokenizer reads back as the same special tokens. Every row looked at is consumed. A prompt of
    more than `max_prompt_tokens` tokens (with `tokenizer`) is skipped, consumed: serving would refuse it as
    past the context, failing the step, and the next step would plan from the same rows."""
    consumed, prompts = [], []
    columns = ["id", "prompt", "messages_json", "metadata_json"]
    columns += ["prompt_token_ids"] if "prompt_token_ids" in rows.column_names else []
    for row in rows.select(columns).to_pylist():
        rollout = row["id"] in own_rollouts or is_rollout_row(row["metadata_json"])
        if file_prompts or rollout:
            prompt = None
        elif tokenizer is not None and row.get("prompt_token_ids"):
            prompt = tokenizer.decode(row["prompt_token_ids"])
        else:
            prompt = prompt_text(row, tokenizer) if tokenizer else row["prompt"]
        # sent as ids without special tokens (loop._requests): counted so
        if prompt and len(prompts) < n_prompts and max_prompt_tokens is not None and tokenizer is not None \
                and not fits(tokenizer, prompt, max_prompt_tokens):
            logger.info("rollouts: the prompt of %s is longer than the context leaves room for (%d tokens); skipped",
                        row["id"], max_prompt_tokens)
            prompt = None
        if not prompt:
            consumed.append(row["id"])
        elif len(prompts) < n_prompts:
            consumed.append(row["id"])
            prompts.append(prompt)
    if file_prompts:
        start = (step * n_prompts) % len(file_prompts)
        prompts = [file_prompts[(start + i) % len(file_prompts)] for i in range(n_prompts)]
    return RolloutPlan(prompts=tuple(prompts), consumed_ids=tuple(consumed))


# ---------------------------------------------------------------------------------------------------------
# Threads that do not hold up a stop

STOP_POLL_SECONDS = 0.2  # how often a wait for samples looks at the stop event


def _in_thread(fn: Callable, *args, name: str, slots: threading.Semaphore | None = None) -> Future:
    """fn(*args) in a daemon thread of its own, after taking one of `slots` when given (until then its Future
    can be cancelled, as a queued job of a thread pool). Not a ThreadPoolExecutor: the interpreter joins
    those threads at exit, so a request blocked in an HTTP read held up the process's end for up to the
    client's timeout."""
    future: Future = Future()

    def work() -> None:
        with slots if slots is not None else contextlib.nullcontext():
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args)
            except BaseException as e:  # the waiter gets it from the future
                future.set_exception(e)
            else:
                future.set_result(result)

    threading.Thread(target=work, name=name, daemon=True).start()
    return future


def _await(future: Future, stop: threading.Event | None) -> None:
    """Waits until `future` is done, or raises Stopped once `stop` is set (the future's thread is left to
    finish or to die with the process)."""
    while not future.done():
        if stop is not None and stop.is_set():
            raise Stopped("stopped while waiting for rollouts to be sampled")
        futures_wait([future], timeout=STOP_POLL_SECONDS)


# ---------------------------------------------------------------------------------------------------------
# Samplers


@dataclass(frozen=True)
class SampleRequest:
    tenant: str
    api_key: str
    prompt: str  # rendered
    n: int
    max_tokens: int
    temperature: float
    # The tenant's adapter version the learner holds ("acme@3"; None: none yet). A local sampler samples
    # with exactly that adapter and labels its samples with it; the serving tier labels its own.
    version: str | None = None
    # The prompt as the learner tokenizes it for training (no special tokens added: a rendered template has
    # them). Sent to serving as token ids, so the engine samples from exactly the prompt that is trained on,
    # whatever the serving tier would add to a text prompt (a BOS, as vLLM's completions endpoint does).
    prompt_ids: tuple[int, ...] | None = None


class Sampler(Protocol):
    background: bool  # whether sampling may run in other threads while the learner trains

    def sample(self, requests: Sequence[SampleRequest]) -> list[list[Sample]]: ...


class LocalSampler:
    """Samples with the learner's own model (one generate call per tenant)."""

    background = False

    def __init__(self, policy: Policy):
        self.policy = policy

    def sample(self, requests: Sequence[SampleRequest]) -> list[list[Sample]]:
        out: list[list[Sample]] = [[] for _ in requests]
        by_key: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            by_key.setdefault((r.tenant, r.version, r.n, r.max_tokens, r.temperature), []).append(i)
        for (tenant, version, n, max_tokens, temperature), idx in by_key.items():
            results = self.policy.generate(
                tenant, [requests[i].prompt for i in idx], n=n, max_new_tokens=max_tokens, temperature=temperature
            )
            for i, samples in zip(idx, results):
                out[i] = [replace(s, version=version) for s in samples]
        return out


# How long a rollout request goes on asking through answers worth sending again (429, 503, a network error)
# before its step fails; one deadline for the request, whatever mix of them it meets.
RETRY_WAIT_S = 120.0
RETRY_STATUSES = (429, 503)
NETWORK_RETRY_S = 1.0  # the wait before asking again after a network error (there is no Retry-After to honour)
# A 401 is asked again for this long after the first try: a tenant's api_key changed in the config reaches the
# learner and serving each at its own re-read (every 5 s), and the learner's may come first.
AUTH_RETRY_S = 15.0


def _retry_after(resp) -> float:
    try:
        return min(10.0, max(0.05, float(resp.headers.get("retry-after", "1"))))
    except ValueError:
        return 1.0


class ServingSampler:
    """Samples through the serving tier's `/v1/completions`, all of a call's requests concurrently, in threads
    of that call's own: a tenant whose requests wait out 429s (its in-flight limit) holds no thread another
    tenant's rollouts need. The threads are daemons (`_in_thread`). A request answered 429 or 503 (honouring
    its Retry-After), or failing on the network, is sent again until RETRY_WAIT_S after its first try; any
    other answer, or one still refused then, fails the call (SamplingError, naming the status). Every try of
    a request carries the request's Idempotency-Key, so serving runs it once (serving/idempotency.py)."""

    background = True

    def __init__(self, base_url: str, *, timeout: float = 300.0, concurrency: int = 32, priority: int = 1):
        import httpx

        self.base_url = base_url.rstrip("/")
        self.priority = priority  # the requests' place in the engine's queue (learner.rollout_priority)
        # No cap on connections: concurrent calls (the prefetcher samples several tenants at once) must not
        # wait for one another's connections; each call caps its own threads.
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout, trust_env=trust_env(self.base_url),
                                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self._concurrency = concurrency

    def sample(self, requests: Sequence[SampleRequest]) -> list[list[Sample]]:
        if not requests:
            return []
        slots = threading.BoundedSemaphore(min(self._concurrency, len(requests)))
        futures = [_in_thread(self._one, r, name="rollout-http", slots=slots) for r in requests]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:  # after a failure, the requests not started yet
                f.cancel()

    def _one(self, r: SampleRequest) -> list[Sample]:
        import httpx

        body = {
            "model": r.tenant,
            "prompt": list(r.prompt_ids) if r.prompt_ids else r.prompt,
            "n": r.n,
            "max_tokens": r.max_tokens,
            "temperature": r.temperature,
            "metadata": {"source": ROLLOUT_SOURCE},
            "return_token_ids": True,  # the tokens sampled, to train on exactly those
            "logprobs": 0,  # and their log-probabilities (no alternatives), the importance ratios' old ones
            "priority": self.priority,  # behind production requests (0) in the engine's queue
        }
        # Asked again, within one deadline, whatever says "not now": one failed request fails the whole step,
        # throwing away its other requests' completions, and the tenant backs off for 5 s to 5 minutes.
        #   429: the tenant has serving.max_inflight_per_tenant completions in the engine (a step's rollouts and
        #        the next step's, sampled ahead, plus the tenant's own traffic): wait for room, as asked;
        #   503: the server is stopping for a restart (`server_stopping`) or its engine is not answering
        #        (`engine_unavailable`): wait as asked (1 s without a Retry-After);
        #   a network error (refused, reset: the server restarting): wait NETWORK_RETRY_S. A read that times
        #        out (the client's `timeout`, longer than RETRY_WAIT_S) has used up the deadline already;
        #   401, for AUTH_RETRY_S only: the tenant's new api_key, which serving has not read yet.
        # Any other answer fails at once: asking again would get the same.
        # One Idempotency-Key for every try: a request whose answer the network lost after serving generated
        # it gets that answer again, not a second generation and a second interaction event.
        headers = {"Authorization": f"Bearer {r.api_key}", "Idempotency-Key": f"rollout-{uuid.uuid4().hex}"}
        first = time.monotonic()
        deadline = first + RETRY_WAIT_S
        network_errors = 0
        while True:
            try:
                resp = self._client.post("/v1/completions", json=body, headers=headers)
            except (httpx.NetworkError, httpx.TimeoutException, httpx.RemoteProtocolError) as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SamplingError(f"tenant {r.tenant!r}: rollout request to {self.base_url} failed: "
                                        f"{type(e).__name__}: {e} (still failing after {RETRY_WAIT_S:g} s)") from e
                if not network_errors:  # once per request: a restart's every second would flood the log
                    logger.info("tenant %s: rollout request to %s failed (%s: %s); asking again for up to %g s",
                                r.tenant, self.base_url, type(e).__name__, e, RETRY_WAIT_S)
                network_errors += 1
                time.sleep(min(NETWORK_RETRY_S, left))
                continue
            except httpx.HTTPError as e:  # a proxy's refusal, a malformed URL: asking again would not help
                raise SamplingError(f"tenant {r.tenant!r}: rollout request to {self.base_url} failed: {e}") from e
            if resp.status_code == 401 and time.monotonic() - first < AUTH_RETRY_S:
                time.sleep(1.0)
                continue
            if resp.status_code not in RETRY_STATUSES or time.monotonic() >= deadline:
                break
            time.sleep(min(_retry_after(resp), max(0.0, deadline - time.monotonic())))
        if resp.status_code != 200:
            still = f" (still after {RETRY_WAIT_S:g} s)" if resp.status_code in RETRY_STATUSES else ""
            raise SamplingError(
                f"tenant {r.tenant!r}: {self.base_url}/v1/completions answered {resp.status_code}{still}: "
                f"{resp.text[:300]}"
            )
        label = resp.headers.get(VERSION_HEADER) or ""
        version = label if "@" in label else None  # "base" (the model's name): no adapter yet
        try:
            body = resp.json()
            choices = sorted(body.get("choices", []), key=lambda c: c.get("index", 0))
            return [
                Sample(
                    text=c.get("text") or "",
                    token_ids=_token_ids(c),
                    finished=c.get("finish_reason") == "stop",
                    version=version,
                    interaction_id=interaction_id(body.get("id"), c.get("index", 0), len(choices)),
                    logprobs=_sampled_logprobs(c),
                )
                for c in choices
            ]
        except (ValueError, TypeError, AttributeError) as e:  # not JSON, or not the completions answer's shape
            raise SamplingError(f"tenant {r.tenant!r}: {self.base_url}/v1/completions answered 200 with a body that "
                                f"is not a completions answer ({type(e).__name__}: {e}): {resp.text[:300]}") from e

    def close(self) -> None:
        self._client.close()


def _token_ids(choice: dict) -> tuple[int, ...] | None:
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        return None  # a server without `return_token_ids`: the text is re-tokenised
    return tuple(ids)


def _sampled_logprobs(choice: dict) -> tuple[float, ...] | None:
    """The sampled tokens' log-probs when there is one per returned token id, NaN for a missing, non-finite
    or placeholder one (logs_mode.NO_LOGPROB; pg_update then uses the current policy's there); None
    otherwise."""
    ids = choice.get("token_ids")
    values = (choice.get("logprobs") or {}).get("token_logprobs")
    if not isinstance(ids, list) or not isinstance(values, list) or len(values) != len(ids):
        return None
    return tuple(known_logprob(v) if isinstance(v, (int, float)) else math.nan for v in values)


def interaction_id(response_id: str | None, index: int, n: int) -> str | None:
    """The id the serving tier gives the interaction of choice `index`: the response id, or "<id>-<index>"
    when the response has several choices."""
    if not response_id:
        return None
    return response_id if n == 1 else f"{response_id}-{index}"


@dataclass(frozen=True)
class SampledBatch:
    """A finished sampling job: what it sampled, for which step, and how long the sampler took."""

    plan: RolloutPlan
    samples: list[list[Sample]]
    step: int  # the tenant's step the job was planned for
    seconds: float  # from the job's start to its last completion


class Prefetcher:
    """At most one sampling job in flight per tenant, run in background threads (serving sampler only), at
    most `workers` at once when given. By default every tenant's job runs at once (a thread each, waiting on
    HTTP): with a fixed number of threads, tenants whose requests wait out 429s and 503s (for up to
    RETRY_WAIT_S) held them all, and every other tenant's rollouts waited behind them. Its waits give up when
    the `stop` they are given is set (`Stopped`)."""

    def __init__(self, sampler: Sampler, workers: int | None = None):
        self.sampler = sampler
        self._slots = threading.BoundedSemaphore(workers) if workers is not None else None
        self._jobs: dict[str, tuple[RolloutPlan, int, Future]] = {}
        # Discarded jobs that were already running (a future cannot be cancelled then): their requests
        # still hold the tenant's place in the serving tier, so the tenant's next job starts after them.
        self._discarded: dict[str, Future] = {}

    def pending(self, tenant: str) -> bool:
        return tenant in self._jobs

    def busy(self, tenant: str) -> bool:
        """Whether the tenant's job (or a discarded one) is still sampling (taking it now would wait)."""
        job = self._jobs.get(tenant)
        discarded = self._discarded.get(tenant)
        return (job is not None and not job[2].done()) or (discarded is not None and not discarded.done())

    def wait_any(self, tenants: Collection[str], timeout: float, stop: threading.Event | None = None) -> None:
        """Returns once one of `tenants`' jobs (or discarded jobs) still sampling has finished, after `timeout`
        seconds, or once `stop` is set (looked at every STOP_POLL_SECONDS)."""
        futures = [f for t in tenants for f in (self._jobs[t][2] if t in self._jobs else None, self._discarded.get(t))
                   if f is not None and not f.done()]
        deadline = time.monotonic() + timeout
        while futures and (stop is None or not stop.is_set()) and (left := deadline - time.monotonic()) > 0:
            done, _ = futures_wait(futures, timeout=min(left, STOP_POLL_SECONDS), return_when="FIRST_COMPLETED")
            if done:
                return

    def start(self, tenant: str, plan: RolloutPlan, requests: Sequence[SampleRequest], *, step: int = 0) -> None:
        """Starts the tenant's job, unless one is in flight: its own, or a discarded one still running (the
        loop asks again on its next pass; waiting here would hold up every tenant)."""
        self._forget_finished()
        if tenant in self._jobs or self._discarded_running(tenant):
            return
        future = _in_thread(self._timed, list(requests), name="rollout-prefetch", slots=self._slots)
        self._jobs[tenant] = (plan, step, future)

    def _timed(self, requests: list[SampleRequest]) -> tuple[list[list[Sample]], float]:
        started = time.perf_counter()
        samples = self.sampler.sample(requests)
        return samples, time.perf_counter() - started

    def take(self, tenant: str, stop: threading.Event | None = None) -> SampledBatch | None:
        """The tenant's finished job (waiting for it), or None if none was started; re-raises its error.
        Raises Stopped when `stop` is set while it waits (the job is dropped)."""
        job = self._jobs.pop(tenant, None)
        if job is None:
            self._settle(tenant, stop)  # the caller samples next (`sample`)
            return None
        plan, step, future = job
        try:
            _await(future, stop)
        except Stopped:
            self._discarded[tenant] = future  # still sampling: a next job of the tenant starts after it
            raise
        samples, seconds = future.result()
        return SampledBatch(plan=plan, samples=samples, step=step, seconds=seconds)

    def sample(self, requests: Sequence[SampleRequest],
               stop: threading.Event | None = None) -> tuple[list[list[Sample]], float]:
        """(samples, seconds) of `requests`, sampled now and waited for as `take` waits (a thread of its own,
        not one of the `workers`: the caller has nothing else to do meanwhile)."""
        if stop is not None and stop.is_set():
            raise Stopped
        future = _in_thread(self._timed, list(requests), name="rollout-sample")
        try:
            _await(future, stop)
        except Stopped:
            for tenant in {r.tenant for r in requests}:  # still sampling: the tenant's next job starts after it
                self._discarded[tenant] = future
            raise
        return future.result()

    def _discarded_running(self, tenant: str) -> bool:
        discarded = self._discarded.get(tenant)
        if discarded is not None and discarded.done():
            del self._discarded[tenant]
            return False
        return discarded is not None

    def _settle(self, tenant: str, stop: threading.Event | None) -> None:
        """Waits for the tenant's discarded job if it is still running: two in flight would double the
        tenant's requests at once (past serving.max_inflight_per_tenant, refused). Rare: a config change, a
        step out of step; the scheduler takes other ready tenants first (`busy`)."""
        discarded = self._discarded.get(tenant)
        if discarded is not None:
            _await(discarded, stop)
            del self._discarded[tenant]

    def discard(self, tenant: str) -> None:
        self._forget_finished()
        job = self._jobs.pop(tenant, None)
        if job is not None and not job[2].cancel():
            self._discarded[tenant] = job[2]  # running: its outcome is dropped, but the next job waits for it

    def _forget_finished(self) -> None:
        """Drops the discarded jobs that have finished: nothing waits for them any more, and each holds its
        samples (a tenant that left the config never asks again, so its own checks would never drop it)."""
        for tenant in [t for t, future in self._discarded.items() if future.done()]:
            del self._discarded[tenant]

    def close(self) -> None:
        """Cancels the jobs not started yet; running ones are abandoned (daemon threads: nothing waits for them)."""
        for _, _, future in self._jobs.values():
            future.cancel()
        for future in self._discarded.values():
            future.cancel()


# ---------------------------------------------------------------------------------------------------------
# The step


@dataclass(frozen=True)
class RolloutStep:
    update: UpdateResult | None  # None: every group's rewards were equal, so there was nothing to learn
    reward_mean: float
    rewards: tuple[float, ...]
    n_samples: int  # samples trained on
    n_dropped: int  # samples left out for their version (stale, foreign) or for having no tokens
    score_seconds: float = 0.0  # time spent in the scorer
    n_score_failed: int = 0  # samples left out because the scorer failed on them


def score_samples(scorer: Callable[[str, str], float], prompt: str,
                  samples: Sequence[Sample]) -> tuple[list[float], list[str]]:
    """Rewards per sample, NaN for a sample the scorer failed on (it is left out of training), and the
    first line of each failure's message."""
    from ingest.scorers import ScorerError, apply

    rewards, errors = [], []
    for s in samples:
        try:
            rewards.append(apply(scorer, s.text, prompt))
        except ScorerError as e:
            error = str(e).splitlines()[0]  # logged once per step, with the tenant (train_step)
            rewards.append(math.nan)
            errors.append(error)
    return rewards, errors


def all_stale(samples: Sequence[Sequence[Sample]], tenant: str, current_version: int, max_staleness: int,
              served: Sequence[int] | None = None, *, temperature: float = 1.0,
              version_files: Callable[[int], Path | None] | None = None,
              withdrawn: Collection[int] = ()) -> str | None:
    """When every sample is too many versions behind `current_version` (or foreign, or withdrawn) to train on,
    or at a `temperature` != 1 made by a version whose files are gone (train_step leaves those out too), why
    the first one is; None when some sample is fresh, or there are none."""
    reasons = [_left_out(s, tenant, current_version, max_staleness, served, temperature, version_files, withdrawn)
               for g in samples for s in g]
    return reasons[0] if reasons and all(reasons) else None


def _left_out(sample: Sample, tenant: str, current_version: int, max_staleness: int, served: Sequence[int] | None,
              temperature: float, version_files: Callable[[int], Path | None] | None,
              withdrawn: Collection[int] = ()) -> str | None:
    """Why train_step leaves `sample` out as stale, or None: too many versions behind (or foreign, or
    withdrawn), or at a temperature != 1 made by a version whose files are gone."""
    why = stale_reason(sample.version, tenant, current_version, max_staleness, served, withdrawn=withdrawn)
    if not why and temperature != 1.0:
        why = _no_behaviour(version_number(sample.version, tenant), current_version, version_files, temperature)
    return why


def _none_usable(n_prompts: int, n: int, failed: list[str], stale: list[str], empty: int) -> str:
    """Why a step has no sample left to train on."""
    if n == 0:
        return f"the sampler returned no completions for {n_prompts} prompts"
    if len(failed) == n:
        return f"all {n} samples failed scoring: {failed[0]}"
    if len(stale) == n:
        return f"all {n} samples stale ({stale[0].removeprefix('stale: ')})"
    parts = [f"{len(failed)} failed scoring ({failed[0]})"] if failed else []
    parts += [f"{len(stale)} stale ({stale[0].removeprefix('stale: ')})"] if stale else []
    parts += [f"{empty} without completion tokens"] if empty else []
    return f"none of {n} samples usable: " + ", ".join(parts)


def _no_behaviour(number: int, current: int, version_files: Callable[[int], Path | None] | None,
                  temperature: float) -> str | None:
    """Why a fresh sample made by version `number` cannot be trained at `temperature` != 1, or None: its
    behaviour log-probs must be recomputed from its version's files, which are gone (train_step's note)."""
    if number in (current, 0) or (version_files is not None and version_files(number) is not None):
        return None
    return (f"stale: version {number}'s adapter files are gone, so its log-probs at temperature {temperature:g} "
            "cannot be recomputed")


def _recomputed_behaviour(policy: Policy, tenant: str, batch, made_by: Sequence[int], current: int,
                          version_files: Callable[[int], Path | None] | None,
                          temperature: float) -> tuple[torch.Tensor, BehaviourFromLogits | None]:
    """[B, C] log-probs at `temperature` of each row's sampling version (NaN for the current version's
    rows: the ratio is 1 there), one pass over its own rows per earlier version; and, when the base model
    (version 0) drew rows, the function that makes theirs from the update's base-model reference pass
    (pg_update's behaviour_from_base_logits), those rows NaN in the tensor."""
    old = torch.full(batch.completion_ids.shape, math.nan, dtype=torch.float32)
    from_base = None
    for number in sorted(set(made_by) - {current}):
        rows = [i for i, v in enumerate(made_by) if v == number]
        if number == 0:
            from_base = BehaviourFromLogits(rows, lambda logits, part, _at: picked_logprobs(
                logits, part.completion_ids, temperature))
            continue
        directory = version_files(number)
        if directory is None:
            raise NoUsableSamples(f"version {number}'s adapter files went away during the step")
        part = batch.rows(torch.tensor(rows))
        old[rows] = policy.logprobs_of_version(part, tenant, directory, temperature=temperature).to("cpu", torch.float32)
    return old, from_base


def completion_tokens(policy: Policy, sample: Sample) -> tuple[list[int], tuple[float, ...] | None]:
    """(the completion's token ids to train on, their sampled log-probs or None): the sampled tokens when
    the sampler gave them (and they are in the vocabulary), else the re-tokenised text (see the module note)."""
    if sample.token_ids is not None and all(t < policy.vocab_size for t in sample.token_ids):
        return list(sample.token_ids), sample.logprobs
    ids = policy.tokenizer(sample.text, add_special_tokens=False).input_ids
    # the turn's end, as the chat template ends one: rollout prompts are the template's (a prompts file's, and
    # serving's rows'), but for an app's row with a prompt of its own
    return (ids + [turn_end_id(policy.tokenizer)] if sample.finished else ids), None


def train_step(
    policy: Policy,
    tenant: str,
    prompts: Sequence[str],
    samples: Sequence[Sequence[Sample]],
    scorer: Callable[[str, str], float],
    *,
    current_version: int,
    max_staleness: int,
    clip_eps: float,
    behaviour_weight_cap: float = maths.BEHAVIOUR_WEIGHT_CAP,
    epochs: int = 1,
    served: Sequence[int] | None = None,
    kl_coef: float,
    entropy_coef: float = 0.0,
    max_grad_norm: float,
    max_len: int,
    skip_unscorable: bool = False,
    temperature: float = 1.0,
    version_files: Callable[[int], Path | None] | None = None,
    withdrawn: Collection[int] = (),
    scale_advantages: bool = True,
) -> RolloutStep:
    """Scores the groups, computes GRPO advantages and makes one update (see the module note). Raises
    NoUsableSamples when every sample is left out, unless every one failed scoring and `skip_unscorable`
    is set (the loop's last try of the same prompts): then the step trains nothing and is committed as
    skipped, so one prompt its scorer never handles cannot hold up the tenant for good.

    `temperature`: the one the samples were drawn at; the update trains the policy at it. Away from 1 the
    sampler's log-probs (temperature 1) are not the behaviour policy's: samples of the current version are
    on-policy (ratio 1), those of an earlier one get log-probs recomputed with that version's adapter
    files (`version_files(number)`, None once they are gone: the sample is left out as stale)."""
    tempered = temperature != 1.0
    if tempered and version_files is not None:
        version_files = functools.cache(version_files)  # one registry lookup per version, not per sample
    prompt_ids, completion_ids, behaviour, rewards, groups, made_by = [], [], [], [], [], []
    stale, failed, empty = [], [], 0  # why samples were left out
    n = 0
    score_seconds = 0.0
    for g, (prompt, group) in enumerate(zip(prompts, samples)):
        n += len(group)
        fresh = []
        for sample in group:
            reason = _left_out(sample, tenant, current_version, max_staleness, served, temperature, version_files,
                               withdrawn)
            if reason:
                stale.append(reason)
            else:
                fresh.append(sample)
        if not fresh:
            continue
        started = time.perf_counter()
        scores, errors = score_samples(scorer, prompt, fresh)
        score_seconds += time.perf_counter() - started
        failed += errors
        p_ids = policy.tokenizer(prompt, add_special_tokens=False).input_ids
        for sample, reward in zip(fresh, scores):
            if math.isnan(reward):
                continue
            c_ids, c_logprobs = completion_tokens(policy, sample)
            if not c_ids:
                empty += 1
                continue
            prompt_ids.append(p_ids)
            completion_ids.append(c_ids)
            behaviour.append(None if tempered else c_logprobs)
            made_by.append(version_number(sample.version, tenant))
            rewards.append(reward)
            groups.append(g)
    if failed and rewards:  # all of them failing is NoUsableSamples' to say
        logger.warning("tenant %s: the scorer failed on %d of %d rollout samples, left out (first: %s)", tenant,
                       len(failed), n, failed[0])
    counts = dict(n_samples=len(rewards), n_dropped=len(stale) + empty, n_score_failed=len(failed),
                  score_seconds=score_seconds)
    if not rewards:
        unscorable = n > 0 and len(failed) == n
        if unscorable and skip_unscorable:
            return RolloutStep(update=None, reward_mean=math.nan, rewards=(), **counts)
        raise NoUsableSamples(_none_usable(len(prompts), n, failed, stale, empty), unscorable=unscorable)
    reward_t = torch.tensor(rewards, dtype=torch.float64)
    advantages = maths.grpo_advantages(reward_t, torch.tensor(groups, dtype=torch.long), scale=scale_advantages)
    reward_mean = float(reward_t.mean())
    if not bool(advantages.abs().gt(0).any()):
        return RolloutStep(update=None, reward_mean=reward_mean, rewards=tuple(rewards), **counts)
    batch = pack(prompt_ids, completion_ids, pad_id=policy.pad_token_id, max_len=max_len)
    old = pad_values(behaviour, batch.completion_width) if any(b is not None for b in behaviour) else None
    from_base = None
    if tempered and any(v != current_version for v in made_by):
        old, from_base = _recomputed_behaviour(policy, tenant, batch, made_by, current_version, version_files,
                                               temperature)
    result = pg_update(
        policy,
        tenant,
        batch,
        advantages.float(),
        old_logprobs=old,
        clip_eps=clip_eps,
        behaviour_weight_cap=behaviour_weight_cap,
        epochs=epochs,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        max_grad_norm=max_grad_norm,
        temperature=temperature,
        behaviour_from_base_logits=from_base,
    )
    return RolloutStep(update=result, reward_mean=reward_mean, rewards=tuple(rewards), **counts)
