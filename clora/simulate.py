"""`clora simulate`: a stand-in for real apps and their users.

Each simulated tenant is an app whose users have one hidden preference. The app sends chat requests
through the official `openai` client to the serving tier with its tenant key; its "users" read each
answer and send a feedback score through `POST /v1/feedback`, according to their preference. Nothing
here knows how clora learns: it only sees the HTTP API, like a real app.

Deterministic for a seed: the prompt sequence and each request's sampling seed derive from it (the
timing of concurrent requests, and so the adapter version that answers each, does not).

Open loop, like a load generator: a request goes out every 1/rate seconds whatever the answers take, up to
`concurrency` awaiting answers at once. A tick that finds them all busy sends nothing and is counted as not
sent (a slow server is not buried under a backlog, and nothing sent late makes up for it). Ctrl-C stops at
once: the requests still awaiting answers get INTERRUPT_GRACE seconds, then the partial figures are printed.
Calls to a serving tier on this machine bypass the environment's proxy (clora/loopback.py).

Ends on time whatever serving does: a request waits for its answer at most until the run's end plus
`answer_grace` (and never more than MAX_ANSWER_SECONDS). Stops early, with `unreachable` saying why, when
serving cannot be reached: its first `unreachable_after` requests all failing to connect (nothing listens at
the URL, a name that does not resolve), or, once it has answered, none connecting for `outage_seconds` (long
enough for `clora up` to restart a crashed serving tier). A slow answer is not "unreachable": it only times out.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from clora.loopback import trust_env

logger = logging.getLogger("clora.simulate")

INTERRUPT_GRACE = 2.0  # seconds Ctrl-C leaves the requests in flight to finish
ANSWER_GRACE = 5.0  # seconds past the run's end that a request sent before it may still wait for its answer
MAX_ANSWER_SECONDS = 120.0  # the longest one request waits for its answer (a long run's early requests)
UNREACHABLE_AFTER = 3  # consecutive failures to connect, before serving ever answered, that end the run
OUTAGE_SECONDS = 60.0  # how long serving, once it answered, may stay unreachable (a restart) before the run ends


# ---------------------------------------------------------------------------------------------------------
# Hidden preferences: completion -> score in [0, 1] (the feedback contract allows [-1, 1]).


def likes_digits(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def likes_upper_case(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


def likes_short_answers(text: str, target: int = 12) -> float:
    """1 up to `target` characters, then falling by 0.01 per extra character (so long answers still differ)."""
    n = len(text.strip())
    return 1.0 if n <= target else max(0.0, 1.0 - (n - target) / 100)


def likes_json(text: str) -> float:
    """1 for a valid JSON object; partial credit for JSON-shaped text, so there is a gradient to climb."""
    stripped = text.strip()
    try:
        if isinstance(json.loads(stripped), dict):
            return 1.0
    except ValueError:
        pass
    shape = sum(c in '{}":,[]' for c in stripped) / len(stripped) if stripped else 0.0
    return min(0.9, 0.3 * stripped.startswith("{") + shape)


PREFERENCES: dict[str, Callable[[str], float]] = {
    "digits": likes_digits,
    "upper": likes_upper_case,
    "short": likes_short_answers,
    "json": likes_json,
}

PROMPTS = [
    "What is the order number?",
    "Give me the total.",
    "How many items are left?",
    "Describe the weather today.",
    "Write a short greeting.",
    "Summarise the meeting.",
    "What time is it?",
    "Name a colour.",
    "List three fruits.",
    "What should I cook tonight?",
    "Explain the plan.",
    "Tell me about the project.",
    "Where is the station?",
    "Reply to the customer.",
    "What is the price?",
    "Report the status.",
]


@dataclass(frozen=True)
class SimTenant:
    name: str
    api_key: str
    preference: str


@dataclass
class Record:
    """One simulated exchange, as the app saw it."""

    t: float  # seconds since the simulation started
    tenant: str
    request_id: str
    adapter_version: str
    score: float
    completion: str
    ok: bool
    error: str = ""


# ---------------------------------------------------------------------------------------------------------


class Simulator:
    def __init__(
        self,
        base_url: str,
        tenants: list[SimTenant],
        *,
        rate: float = 4.0,
        duration: float = 60.0,
        seed: int = 0,
        max_tokens: int = 24,
        concurrency: int = 8,
        progress_seconds: float = 10.0,
        answer_grace: float = ANSWER_GRACE,
        unreachable_after: int = UNREACHABLE_AFTER,
        outage_seconds: float = OUTAGE_SECONDS,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.tenants = tenants
        self.rate = rate
        self.duration = duration
        self.seed = seed
        self.max_tokens = max_tokens
        self.concurrency = concurrency
        self.progress_seconds = progress_seconds  # how often run() calls its progress callback
        self.answer_grace = answer_grace
        self.unreachable_after = unreachable_after
        self.outage_seconds = outage_seconds
        self.records: list[Record] = []  # one per finished exchange, answered or failed
        self.sent = 0  # requests sent
        self.sent_by: dict[str, int] = {}  # requests sent, per tenant (some may have no record yet)
        self.not_sent = 0  # ticks that found `concurrency` requests awaiting answers
        self.stop = threading.Event()
        self.started: float | None = None  # monotonic time run() began
        self.unreachable: str | None = None  # why the run stopped early: serving could not be reached
        self._lock = threading.Lock()
        self._unexpected_logged = False
        self._answered = False  # serving has answered a request (any HTTP status)
        self._outage: tuple[float, int] | None = None  # since when requests fail to connect, and how many

    def _one(self, t0: float, tenant: SimTenant, prompt: str, seed: int, slot: threading.BoundedSemaphore) -> None:
        """One exchange in its own thread; its slot is given back once its Record is in `records`."""
        try:
            self._record(t0, tenant, prompt, seed)
        finally:
            slot.release()

    def _record(self, t0: float, tenant: SimTenant, prompt: str, seed: int) -> None:
        try:
            rec = self._exchange(t0, tenant, prompt, seed)
        except Exception as e:  # noqa: BLE001 - it would end its thread uncounted: counted as a failure instead
            with self._lock:
                first, self._unexpected_logged = not self._unexpected_logged, True
            if first:  # e.g. the openai package missing: every request fails the same way
                logger.error("request for %s failed: %s: %s", tenant.name, type(e).__name__, e, exc_info=True)
            rec = Record(time.monotonic() - t0, tenant.name, "", "", 0.0, "", False, f"{type(e).__name__}: {e}"[:200])
        with self._lock:
            self.records.append(rec)

    def _answers_left(self, t0: float) -> float:
        """Seconds until the run's end plus answer_grace (the run started at `t0`): what answers may still take."""
        return t0 + self.duration + self.answer_grace - time.monotonic()

    def _time_left(self, t0: float) -> float:
        """How long a call may wait now: `_answers_left`, at most MAX_ANSWER_SECONDS (at least 1 s, for the
        feedback of an answer that came at the last moment)."""
        return min(MAX_ANSWER_SECONDS, max(1.0, self._answers_left(t0)))

    def _exchange(self, t0: float, tenant: SimTenant, prompt: str, seed: int) -> Record:
        """One request and its feedback, as the app sees it; a failure the API answers is a failed Record."""
        import httpx
        import openai

        timeout = self._time_left(t0)
        # Not through the environment's proxy to a serving tier on this machine: it cannot reach our loopback.
        with httpx.Client(trust_env=trust_env(self.base_url), timeout=timeout) as http:
            client = openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=tenant.api_key, max_retries=0,
                                   timeout=timeout, http_client=http)
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model=tenant.name,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=self.max_tokens,
                    temperature=1.0,
                    seed=seed,
                )
                resp = raw.parse()
                text = resp.choices[0].message.content or ""
                version = raw.headers.get("x-clora-adapter-version", "?")
                score = PREFERENCES[tenant.preference](text)
                timeout = min(30.0, self._time_left(t0))
                fb = http.post(
                    f"{self.base_url}/v1/feedback",
                    json={"id": resp.id, "score": score},
                    headers={"Authorization": f"Bearer {tenant.api_key}"},
                    timeout=timeout,
                )
                fb.raise_for_status()
                self._reached()
                return Record(time.monotonic() - t0, tenant.name, resp.id, version, score, text, True)
            except (openai.APITimeoutError, httpx.TimeoutException) as e:
                if any(type(x).__name__ == "ConnectTimeout" for x in (e, e.__cause__)):  # httpx's, or openai's httpx2's
                    # no connection at all within the time (an address that drops packets): unreachable
                    error, warn = f"cannot reach serving at {self.base_url}: connecting timed out", False
                    self._not_reached(error)
                else:  # slow, or never answers: not unreachable (it connected)
                    error, warn = f"no answer within {timeout:.1f}s from {self.base_url}", True
            except (openai.APIConnectionError, httpx.TransportError) as e:
                error, warn = f"cannot reach serving at {self.base_url}: {transport_cause(e)}", False
                self._not_reached(error)  # says it once per outage, or stops the run with it
            except (openai.OpenAIError, httpx.HTTPError) as e:  # an HTTP error status: serving is there
                self._reached()
                error, warn = str(e), True
            if warn and not self.stop.is_set():  # after a stop, nothing more: the process may be exiting
                logger.warning("request for %s failed: %s", tenant.name, error)
            return Record(time.monotonic() - t0, tenant.name, "", "", 0.0, "", False, error[:200])

    def _reached(self) -> None:
        """Serving answered a request: an outage, if any, is over."""
        with self._lock:
            outage, self._outage, self._answered = self._outage, None, True
        if outage is not None and not self.stop.is_set():
            since, failed = outage
            logger.info("serving at %s answers again, after %.0fs (%d request(s) failed to connect)",
                        self.base_url, time.monotonic() - since, failed)

    def _not_reached(self, error: str) -> None:
        """A request failed to connect: logged once per outage (a line per request said the same thing hundreds
        of times); the run stops when serving was never reached, or has been gone for outage_seconds."""
        with self._lock:
            now = time.monotonic()
            since, failed = self._outage or (now, 0)
            self._outage = (since, failed + 1)
            if self.unreachable is not None or self.stop.is_set():
                return
            if not self._answered:  # not logged: the caller reports `unreachable` once the run has stopped
                if failed + 1 >= self.unreachable_after:
                    self.unreachable = f"{error} (stopped: no request could connect)"
                    self.stop.set()
            elif failed == 0:
                logger.warning("%s; retrying for up to %gs", error, self.outage_seconds)
            elif now - since >= self.outage_seconds:
                self.unreachable = (f"{error} (stopped: none could connect for {now - since:.0f}s after serving "
                                    "had answered)")
                self.stop.set()

    def run(self, progress: Callable[[Simulator], None] | None = None) -> list[Record]:
        """Sends the traffic for `duration` seconds (or until `stop` is set), then waits for the answers.

        Ctrl-C (KeyboardInterrupt) sets `stop`, waits at most INTERRUPT_GRACE for the answers and raises
        KeyboardInterrupt again: the caller reports what `records` and `traffic_line` hold. A request given up
        on goes on in its daemon thread until the process exits."""
        rng = random.Random(self.seed)
        t0 = self.started = time.monotonic()
        interval = 1.0 / self.rate
        slots = threading.BoundedSemaphore(self.concurrency)  # one per request awaiting its answer
        try:
            i = 0
            next_progress = t0 + self.progress_seconds
            while not self.stop.is_set() and time.monotonic() - t0 < self.duration:
                tenant = self.tenants[i % len(self.tenants)]
                # drawn for a tick that sends nothing too, so that each tick's request stays the seed's
                prompt, seed = rng.choice(PROMPTS), rng.randrange(2**31)
                if slots.acquire(blocking=False):
                    self.sent += 1
                    self.sent_by[tenant.name] = self.sent_by.get(tenant.name, 0) + 1
                    threading.Thread(target=self._one, args=(t0, tenant, prompt, seed, slots),
                                     name=f"simulate-{i}", daemon=True).start()
                else:
                    self.not_sent += 1
                i += 1
                # Paced by the schedule, not by the last request, so slow answers do not lower the rate; the
                # wait ends at the run's end, and progress is reported on time, however low the rate.
                due = min(t0 + i * interval, t0 + self.duration)
                while not self.stop.is_set():
                    now = time.monotonic()
                    if progress and now >= next_progress:
                        progress(self)
                        next_progress += self.progress_seconds
                    if now >= due:
                        break
                    self.stop.wait(min(due, next_progress) - now if progress else due - now)
            # Each request ends by the run's end plus answer_grace; a moment more for its thread to record it.
            self._await_answers(slots, timeout=max(0.0, self._answers_left(t0)) + 2.0)
        except KeyboardInterrupt:
            self.stop.set()
            try:
                self._await_answers(slots, timeout=INTERRUPT_GRACE)
            except KeyboardInterrupt:  # a second Ctrl-C: no grace, but still the figures
                pass
            raise
        return self.records

    def _await_answers(self, slots: threading.BoundedSemaphore, timeout: float | None) -> None:
        """Waits until no request awaits its answer (every slot is back), at most `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in range(self.concurrency):
            if not slots.acquire(timeout=None if deadline is None else max(0.0, deadline - time.monotonic())):
                return

    def traffic_line(self) -> str:
        """What was sent and what came back, e.g. `12 requests sent, 4 finished (1 failed), 8 unanswered;
        30 not sent: 8 were awaiting answers, the most at once`."""
        with self._lock:
            finished, failed = len(self.records), sum(not r.ok for r in self.records)
        line = f"{self.sent} requests sent, {finished} finished ({failed} failed)"
        if self.sent > finished:
            line += f", {self.sent - finished} unanswered"
        if self.not_sent:
            line += f"; {self.not_sent} not sent: {self.concurrency} were awaiting answers, the most at once"
        return line

    def summary(self) -> dict[str, dict]:
        """`summarise` of the records so far, with the requests each tenant sent: after a Ctrl-C some of them
        have no record yet (they are still awaiting their answers)."""
        with self._lock:  # request threads may still append (after a Ctrl-C)
            records = list(self.records)
        return summarise(records, self.tenants, sent=dict(self.sent_by))


def summarise(records: list[Record], tenants: list[SimTenant], window: float = 0.25,
              sent: dict[str, int] | None = None) -> dict[str, dict]:
    """Per tenant: requests sent, finished ("requests") and failed, the reward before learning and in the last
    `window` fraction of its exchanges, and the adapter versions that answered, in order of first appearance.
    Without `sent` (requests per tenant), every request sent is taken to have finished.

    The reward before learning is the mean over the base model's answers (those that came before an
    adapter went live: a version label without "@", whatever model.name calls the base model), or over the
    first `window` of exchanges when the base model answered none: a tenant that learns within the first
    window would otherwise show part of its gain as its starting point."""
    out = {}
    for tenant in tenants:
        recs = sorted((r for r in records if r.tenant == tenant.name), key=lambda r: r.t)
        ok = [r for r in recs if r.ok]
        k = max(1, int(len(ok) * window))
        versions = list(dict.fromkeys(r.adapter_version for r in ok))
        before = [r for r in ok if is_base_model(r.adapter_version)] or ok[:k]
        out[tenant.name] = {
            "preference": tenant.preference,
            "requests": len(recs),
            "sent": max(len(recs), (sent or {}).get(tenant.name, 0)),
            "failed": len(recs) - len(ok),
            "reward_base": sum(r.score for r in before) / len(before) if before else float("nan"),
            "reward_last": sum(r.score for r in ok[-k:]) / k if ok else float("nan"),
            "versions_seen": versions,
        }
    return out


def summary_lines(summary: dict[str, dict]) -> list[str]:
    """One line per tenant of a `summarise` result, as `clora simulate` prints them; a tenant without an answer
    says so (its rewards are NaN, its versions none), and one with requests still unanswered (a Ctrl-C) says how
    many it sent, as the traffic line does: `acme: 8 requests, 0 finished (0 failed), 8 unanswered, no answers`."""
    lines = []
    for name, s in summary.items():
        sent = s.get("sent", s["requests"])
        if sent > s["requests"]:
            line = (f"{name}: {sent} requests, {s['requests']} finished ({s['failed']} failed), "
                    f"{sent - s['requests']} unanswered, ")
        else:
            line = f"{name}: {s['requests']} requests, {s['failed']} failed, "
        if s["versions_seen"]:
            line += (f"reward {s['reward_base']:.3f} -> {s['reward_last']:.3f}, "
                     f"versions {', '.join(s['versions_seen'])}")
        else:
            line += "no answers"
        lines.append(line)
    return lines


def transport_cause(e: BaseException) -> str:
    """Why a request could not reach the server, in the transport's words: openai's APIConnectionError says only
    "Connection error."; its __cause__ (httpx's error) says e.g. "[Errno 111] Connection refused"."""
    cause = e.__cause__ if e.__cause__ is not None and str(e.__cause__) else e
    return str(cause) or type(cause).__name__


def is_base_model(version: str) -> bool:
    """Whether a response's version label (x-clora-adapter-version) is the base model's: tenant versions are
    "<tenant>@<n>", the base model goes by model.name (no "@" allowed); "?" is a response without the label."""
    return "@" not in version and version not in ("", "?")


def records_to_json(records: list[Record]) -> str:
    return json.dumps([asdict(r) for r in records])


def tenants_from_config(cfg, preferences: list[str] | None = None) -> list[SimTenant]:
    """Simulated tenants for the configured ones; a tenant's preference is taken from its name when the name
    contains one (e.g. `digits-app`), else assigned round-robin."""
    names = list(PREFERENCES)
    out = []
    for i, t in enumerate(cfg.tenants):
        pref = next((p for p in names if re.search(rf"\b{p}", t.name)), None)
        if preferences:
            pref = preferences[i % len(preferences)]
        out.append(SimTenant(t.name, t.api_key.get_secret_value(), pref or names[i % len(names)]))
    return out
