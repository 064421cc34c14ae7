"""Retries that are safe: a completion request sent with an `Idempotency-Key` header runs once.

A client that loses the answer to a completion (the connection reset after serving finished, a proxy's
timeout) and sends the request again would, without a key, get a second generation and log a second
interaction event: a second trajectory row for one request, and feedback for the one the client saw
leaving the other unscored (or scored twice, by a programmatic scorer). With a key, the first request
with that key runs; one sent again with the same key and the same body gets the first one's answer
(status 200, the same body and `x-request-id`, plus `idempotent-replayed: true`), streamed or not, and
nothing else is generated or logged. A request sent again while the first is still running waits for it
(the IETF draft answers it 409 instead; a client retrying after a lost connection would then have to try
again until the first ends), and a streamed one then gets every event at once. At most `MAX_WAITING` tries
of a key wait at once; another is a 409 `idempotency_key_in_use` with Retry-After, the draft's answer.

Keys are per tenant (two tenants' keys never meet) and kept `ttl_s` after the answer (config
`serving.idempotency_ttl_seconds`; 0 turns keys off), and answers kept take at most `max_bytes` in all
(`serving.idempotency_cache_mib`); past it the oldest answer of the tenant keeping the most bytes leaves
first, so one tenant's flood of large answers pushes out its own, not another tenant's; an answer larger than
that is kept for the tries already waiting only. A key sent with another body (or to the other completion
route) is a 422 `idempotency_key_reused`, as the IETF's Idempotency-Key draft says; bodies are compared byte
for byte. Only a whole answer is kept (a stream whose client left after its last token is whole, and logged):
a refusal, a generation that failed, a client that left before the end, or a stream that ended in an error
leaves the key free, so the request sent again runs (none of those logged an interaction). The keys live in
the serving process's memory: a request sent again to another serving replica, or after serving restarted,
runs again.

Runs on the event loop only, like the rest of the API: no lock.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from serving.errors import BadRequest, IdempotencyKeyInUse, IdempotencyKeyReused

logger = logging.getLogger(__name__)

HEADER = "idempotency-key"
REPLAYED = "idempotent-replayed"  # on a response that is a kept answer given again
MAX_KEY_CHARS = 255
ENTRY_BYTES = 256  # what a kept answer costs beyond its body and headers (its objects, its place in the dict)
MAX_WAITING = 2  # tries of one key waiting for its first request at once: a client's retry, and a retry of that


def fingerprint(route: str, body: bytes) -> bytes:
    """What a key is bound to: the route and the request body, byte for byte."""
    return hashlib.blake2b(route.encode() + b"\0" + body, digest_size=16).digest()


def check_key(key: str) -> str:
    """The header's value if it is a usable key: 1 to 255 visible ASCII characters; else a 400."""
    if not 0 < len(key) <= MAX_KEY_CHARS or not all("!" <= c <= "~" for c in key):
        shown = repr(key) if len(key) <= 64 else f"{len(key)} characters long"
        raise BadRequest(f"the Idempotency-Key header must be 1 to {MAX_KEY_CHARS} visible ASCII characters "
                         f"(a UUID, say); this one is {shown}", param="Idempotency-Key")
    return key


@dataclass
class Answer:
    """A kept answer (always a 200: nothing else is kept): what is sent again for the key."""

    headers: dict[str, str]
    chunks: list[bytes]  # the body: one JSON document, or a stream's server-sent events in order
    stream: bool
    kept_at: float
    size: int = field(init=False)  # what it takes under `max_bytes`

    def __post_init__(self) -> None:
        self.size = sum(map(len, self.chunks)) + sum(len(k) + len(v) for k, v in self.headers.items()) + ENTRY_BYTES

    @property
    def media_type(self) -> str:
        return "text/event-stream" if self.stream else "application/json"


@dataclass(eq=False)
class Ticket:
    """The first request of a key, running: it `keep`s its answer or `abandon`s the key (whichever first;
    later calls do nothing). Either wakes the requests waiting for it."""

    keys: Keys
    slot: tuple[str, str]
    fingerprint: bytes
    done: asyncio.Event = field(default_factory=asyncio.Event)
    answer: Answer | None = None  # once kept: what the requests that waited get, kept for later ones or not
    waiting: int = 0  # tries of the key waiting for this run now

    def keep(self, headers: dict[str, str], chunks: list[bytes], *, stream: bool) -> None:
        """The run's whole answer (a 200): kept for the key."""
        self._end(Answer(headers, chunks, stream, self.keys.clock()))

    def abandon(self) -> None:
        """The run gave no whole answer: the key is free again."""
        self._end(None)

    def _end(self, answer: Answer | None) -> None:
        if self.done.is_set():
            return
        self.done.set()
        self.answer = answer
        self.keys.settle(self, answer)


class Keys:
    """The idempotency keys of one serving process: running first requests, and kept answers."""

    def __init__(self, ttl_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_bytes, self.clock = ttl_s, max_bytes, clock
        self._running: dict[tuple[str, str], Ticket] = {}
        self._kept: dict[tuple[str, str], tuple[bytes, Answer]] = {}  # oldest first
        self._bytes = 0
        self._tenants: dict[str, dict[tuple[str, str], None]] = {}  # each tenant's kept slots, oldest first
        self._tenant_bytes: Counter[str] = Counter()

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    @property
    def kept_bytes(self) -> int:
        return self._bytes

    def counts(self) -> dict[str, int]:
        """Keys whose first request is running, and keys whose answer is kept (expired ones left out)."""
        self._expire()
        return {"running": len(self._running), "kept": len(self._kept)}

    async def claim(self, tenant: str, key: str, fingerprint: bytes,
                    wait: Callable[[asyncio.Event], object]) -> Ticket | Answer:
        """A Ticket when this request is the key's first (or the first's answer was not kept), else the kept
        Answer. A request whose key's first is running waits for it through `await wait(event)` (which
        may raise: its own client leaving), unless MAX_WAITING do already (409). 422 when the key was used
        with another fingerprint."""
        slot = (tenant, key)
        while True:
            self._expire()
            running = self._running.get(slot)
            if running is None:
                break
            if running.fingerprint != fingerprint:
                raise _reused(key)
            # A waiting try holds its body and no in-flight slot: unbounded, one tenant's tries of one key held
            # memory without limit. A retry or two wait (spared a loop of tries); more get the draft's 409.
            if running.waiting >= MAX_WAITING:
                raise IdempotencyKeyInUse(
                    f"the Idempotency-Key {key!r} is in use: its first request is still running and "
                    f"{running.waiting} tries wait for it already; retry after it ends", param="Idempotency-Key")
            running.waiting += 1
            try:
                await wait(running.done)
            finally:
                running.waiting -= 1
            if running.answer is not None:  # even if it is too large to keep for later tries
                return running.answer
        kept = self._kept.get(slot)
        if kept is not None:
            bound, answer = kept
            if bound != fingerprint:
                raise _reused(key)
            return answer
        ticket = Ticket(self, slot, fingerprint)
        self._running[slot] = ticket
        return ticket

    def settle(self, ticket: Ticket, answer: Answer | None) -> None:
        """Ends `ticket`'s run: its key is free again, or (with `answer`) kept, as room allows."""
        if self._running.get(ticket.slot) is ticket:
            del self._running[ticket.slot]
        if answer is None:
            return
        if answer.size > self.max_bytes:
            logger.info("an answer of %d bytes is over serving.idempotency_cache_mib: its key (tenant %s) is not "
                        "kept, and the request sent again would run again", answer.size, ticket.slot[0])
            return
        if ticket.slot in self._kept:
            self._drop(ticket.slot)
        tenant = ticket.slot[0]
        self._kept[ticket.slot] = (ticket.fingerprint, answer)
        self._tenants.setdefault(tenant, {})[ticket.slot] = None
        self._bytes += answer.size
        self._tenant_bytes[tenant] += answer.size
        while self._bytes > self.max_bytes:
            # The oldest answer of the tenant keeping the most bytes leaves: a tenant's flood of large
            # answers pushes out its own, never the few of a tenant keeping less. Never the answer just kept
            # (it fits alone): one large answer would otherwise leave at once whenever another tenant held
            # the rest.
            self._drop(next(slot for tenant in sorted(self._tenant_bytes, key=self._tenant_bytes.__getitem__,
                                                      reverse=True)
                            for slot in self._tenants[tenant] if slot != ticket.slot))

    def _expire(self) -> None:
        oldest = self.clock() - self.ttl_s
        while self._kept:
            slot = next(iter(self._kept))
            if self._kept[slot][1].kept_at > oldest:
                return
            self._drop(slot)

    def _drop(self, slot: tuple[str, str]) -> None:
        _, answer = self._kept.pop(slot)
        tenant = slot[0]
        self._bytes -= answer.size
        self._tenant_bytes[tenant] -= answer.size
        del self._tenants[tenant][slot]
        if not self._tenants[tenant]:
            del self._tenants[tenant], self._tenant_bytes[tenant]


def _reused(key: str) -> IdempotencyKeyReused:
    return IdempotencyKeyReused(f"the Idempotency-Key {key!r} was used for another request (a different body or "
                                "route); use a new key for a new request", param="Idempotency-Key")
