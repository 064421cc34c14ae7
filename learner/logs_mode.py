"""`logs` mode: off-policy learning from production trajectories (what apps actually asked and got).

A step takes the tenant's oldest untrained trajectories (storage.cursors): batch_size of them, or up to
`learner.catch_up` batches' worth when that many are waiting, trained in micro-batches of batch_size. With
one batch a step, a learner behind its traffic published a version per batch_size rows however far behind it
was, so its backlog aged past max_staleness before its turn and was dropped, and steps on the one or two
fresh rows left published versions just as fast: it never caught up. A step then:
  1. drops stale ones (below);
  2. turns each row into an Example: prompt tokens from `prompt_token_ids` when the row has them (a
     prompt sent to serving as token ids: its decoded text may re-tokenize to other ids, which the model
     never saw), else from the stored rendered `prompt` text (or, when a row has none, the chat template
     applied to `messages_json`); completion tokens from
     `completion_token_ids` when present, else the tokenized `completion` text with the end-of-sequence
     token appended (unless its metadata says it was cut at the length limit: retokenised_completion);
     behaviour log-probs from `completion_logprobs` when they are present, finite and as many as the
     completion tokens (or as the text's tokens, the appended stop token's then unknown), else none;
     except for a row clora's serving tier drew otherwise than at temperature 1 with nothing cut: it logs
     vLLM's raw log-probs (temperature 1), not those of the distribution the token was drawn from, so the
     step recomputes them from the drawing version's logits under the row's recorded temperature, top-k,
     top-p, min-p, logit_bias, penalties and min_tokens (sampled_with, behaviour_logprobs; for the
     current adapter's and the base model's rows from the update's first and reference passes,
     pg_update's behaviour_from_logits and behaviour_from_base_logits); at
     temperature 0 they are 0;
     and leaves out a row whose reward is beyond +-`learner.gate_max_abs_reward` (within_reward_range),
     so the rest of the batch trains rather than the gate rejecting it whole;
  3. advantages: reward minus baseline, where the baseline is the mean reward of the other completions
     of the same prompt in the batch when there are some, else the mean reward of the rest of the batch
     (the tenant's running mean only in a batch of one; maths.baseline_advantages), then divided by the
     std of the batch's rewards when `learner.scale_advantages` is on (the default): production rewards
     are often small and sparse (a digit fraction of 0.002, one thumbs-up in twenty), and unscaled they
     barely move the adapter; a batch whose rewards are all equal is left unscaled;
  4. one importance-weighted policy-gradient update (update.py), each token weighed by
     min(pi / pi_behaviour, `learner.behaviour_weight_cap`) (weight 1 where the behaviour log-probs are
     missing), and the optional KL penalty to the base model (`learner.kl_coef`).

Staleness: the serving tier records which adapter version made each completion (`adapter_version`,
"<tenant>@<n>", null for the base model = version 0). A trajectory made by a version more than
`learner.max_staleness` versions behind the learner's current one is dropped: the policy that made it is
so far from the current one that importance weights are mostly cut or tiny, and learning from it would
pull towards an old policy. "Behind" counts the versions the tenant has served since (published, or
published and since retired; loop.py keeps each tenant's list), not version numbers: rejected candidates
take numbers too, and after a run of rejections a sample of the current adapter's parent would otherwise
look several versions old. Completions made by another tenant's adapter are dropped as foreign. Null means
the base model only in a row clora's serving tier logged (its metadata holds every one of SERVING_KEYS,
`served_by` among them; an app's metadata may have one of those names): a row without a version that an app produced to Kafka itself was made by the app's
own model, which no published version replaces, and it never ages (select_fresh). What decides is the row,
not the config: an app's tenant that ingest created and the operator later added to the config still
learns from its app's rows. Dropped rows (stale, foreign, unusable, or with a reward out of range) are
still committed with the step (so they are never looked at again) and counted as `n_dropped`, in the
version's metrics and in the step's `train_steps` row.

Flat batches: a batch of two or more trajectories whose rewards are all equal (twenty answers without a
single digit, when the user wants digits) tells better from worse nowhere: centred on the batch, its
advantages are all 0. With `learner.skip_flat_batches` (the default) such a batch trains nothing: only the
tenant's running mean reward takes it in, its ids are committed, and no version is made (decision
"skipped"), rather than publishing a version identical to its parent.

Deliberately not here: which rows are untrained (storage.cursors), when the result is published (gate.py,
loop.py), the update maths (maths.py, update.py).
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import re
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import pyarrow as pa
import torch

from ingest.events import render_messages, template_messages
from learner import maths
from learner.batch import TokenBatch, pack, pad_values, truncate
from learner.policy import Policy, PolicyError
from learner.types import Example, SampledWith
from learner.update import UpdateResult, pg_update

_VERSION = re.compile(r"^(?P<tenant>.+)@(?P<number>[0-9]{1,18})$")  # past 18 digits: no version clora made
# Metadata keys clora's serving tier has set on every interaction it logs since its first version
# (serving/api.py): all of them together tell its rows from an app's own, whose metadata may well have one.
SERVING_KEYS = ("served_by", "endpoint", "latency_ms", "usage", "sampling")

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------
# Staleness


def version_number(adapter_version: str | None, tenant: str) -> int | None:
    """"acme@3" -> 3 for tenant acme; None (the base model) -> 0; another tenant's or a malformed name -> None."""
    if adapter_version is None or adapter_version == "":
        return 0
    m = _VERSION.match(adapter_version)
    if not m or m["tenant"] != tenant:
        return None
    return int(m["number"])


def versions_behind(number: int, current: int, served: Sequence[int] | None) -> int:
    """How many versions `current` is ahead of version `number`: the tenant's served versions (ascending
    numbers) in (number, current]; without that list (or one that lacks `current`), the difference of the
    numbers, an upper bound. A version newer than `current` (the learner followed a rollback, or a retire of
    the version it served) is as many versions away the other way: counted 0, its samples passed for fresh
    and were trained at once on the adapter the operator had just pulled, whatever max_staleness said."""
    if number > current:
        return versions_behind(current, number, served)
    if served is None or (current > 0 and not _contains(served, current)):
        return max(0, current - number)
    return max(0, bisect.bisect_right(served, current) - bisect.bisect_right(served, number))


def _contains(ascending: Sequence[int], x: int) -> bool:
    i = bisect.bisect_left(ascending, x)
    return i < len(ascending) and ascending[i] == x


def row_metadata(metadata_json: str | None) -> dict:
    """A trajectory row's metadata object; {} for none, or for JSON that is not an object."""
    if not metadata_json:
        return {}
    try:
        meta = json.loads(metadata_json)
    except (ValueError, RecursionError):  # nested past the parser's depth here: unreadable as any other
        return {}
    return meta if isinstance(meta, dict) else {}


def served_by_clora(metadata_json: str | None) -> bool:
    """Whether a trajectory row was logged by clora's serving tier (its metadata has every SERVING_KEYS key)."""
    meta = row_metadata(metadata_json)
    return all(key in meta for key in SERVING_KEYS)


def stale_reason(adapter_version: str | None, tenant: str, current: int, max_staleness: int,
                 served: Sequence[int] | None = None, *, unversioned_fresh: bool = False,
                 withdrawn: Collection[int] = ()) -> str | None:
    """Why a trajectory made by `adapter_version` must not be trained at learner version `current`, or None.
    `served`: the numbers of the tenant's published (or retired) versions, ascending. `unversioned_fresh`:
    a row naming no version was not made by the base model as one of this tenant's versions (an app's own
    model made it: see select_fresh), so it is never stale. `withdrawn`: versions an operator retired, whose
    samples are never trained, however recent."""
    if unversioned_fresh and not adapter_version:
        return None
    number = version_number(adapter_version, tenant)
    if number is None:
        return f"foreign adapter {adapter_version!r}"
    if number in withdrawn:
        return f"withdrawn: made by version {number}, which an operator retired"
    if number > current:
        # The learner followed an operator's retire of the version it served back to `current`: the pulled
        # version's samples would pull the adapter back towards what was withdrawn, whatever max_staleness says.
        return f"withdrawn: made by version {number}, newer than {current}, retired since"
    behind = versions_behind(number, current, served)
    if behind > max_staleness:
        return f"stale: made by version {number}, {behind} behind {current} (max_staleness {max_staleness})"
    return None


@dataclass(frozen=True)
class Selection:
    kept: pa.Table
    dropped: dict[str, str]  # trajectory id -> why it was dropped


def select_fresh(rows: pa.Table, tenant: str, current: int, max_staleness: int,
                 served: Sequence[int] | None = None, withdrawn: Collection[int] = ()) -> Selection:
    """The rows fresh enough to train, and why each other one was dropped. A row without an adapter version
    that clora's serving tier did not log (an app producing to Kafka itself) was made by the app's own
    model, which no published version replaces: counting it as the base model's (version 0) would drop
    every such row after `max_staleness` published versions, and the tenant would stop learning. It is
    kept, a fixed behaviour policy (the importance weights against its recorded log-probs are truncated as
    for any other row)."""
    ids = rows.column("id").to_pylist()
    versions = rows.column("adapter_version").to_pylist()
    metadata = rows.column("metadata_json").to_pylist()
    keep, dropped = [], {}
    for i, (tid, version, meta) in enumerate(zip(ids, versions, metadata)):
        apps_own = not version and not served_by_clora(meta)
        reason = stale_reason(version, tenant, current, max_staleness, served, unversioned_fresh=apps_own,
                              withdrawn=withdrawn)
        if reason is None:
            keep.append(i)
        else:
            dropped[tid] = reason
    return Selection(kept=rows.take(pa.array(keep, type=pa.int64())), dropped=dropped)  # typed: [] may be empty


# ---------------------------------------------------------------------------------------------------------
# Rows -> examples


def prompt_text(row: dict, tokenizer) -> str | None:
    """The prompt of a trajectory row as the model sees it: the stored text, else the chat template on its
    messages; None when there is neither, or the template refuses the messages.

    For an event that came with `messages` only (an app producing to Kafka itself), ingest stores as `prompt`
    the messages' "role: content" lines, for scorers and queries to read; the model never saw that text. The
    serving tier sends both, the template's text as `prompt`. So a stored prompt that is exactly those lines
    means "no prompt": the template is applied to the messages, as serving would have."""
    messages = None
    if row.get("messages_json"):
        try:
            messages = json.loads(row["messages_json"])
        except (ValueError, RecursionError):
            messages = None
    prompt = row.get("prompt")
    if prompt:
        try:
            # rows stored before ingest wrote an assistant's calls into these lines have them without
            derived = messages is not None and (prompt == render_messages(messages) or (
                any(m.get("tool_calls") for m in messages) and prompt == render_messages(messages, False)))
        except (KeyError, TypeError, RecursionError):  # not the shape ingest renders: the stored prompt is the app's own
            derived = False
        if not derived:
            return prompt
    if messages:
        try:
            return tokenizer.apply_chat_template(template_messages(messages), tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template with rules of its own (roles that must alternate, ...): unusable
            logger.debug("chat template refused the messages of %s: %s", row.get("id"), e)
            return None
    return prompt or None


LIST_COLUMNS = ("prompt_token_ids", "completion_token_ids", "completion_logprobs")
CHARS_PER_TOKEN = 16  # at most, in the vocabularies clora serves (serving's bound on a prompt's text)


def fits(tokenizer, text: str, tokens: int) -> bool:
    """Whether `text` is at most `tokens` tokens (without special tokens, as the learner sends and decodes
    prompts); text longer than that many tokens could span is not tokenized."""
    return tokens > 0 and len(text) <= tokens * CHARS_PER_TOKEN and \
        len(tokenizer(text, add_special_tokens=False).input_ids) <= tokens
MAX_LOGPROB = 1e-3  # a logged log-prob above it is none (float error may put a certain token's a hair above 0)


def to_examples(rows: pa.Table, tokenizer, vocab_size: int | None = None,
                max_len: int | None = None) -> tuple[list[Example], dict[str, str]]:
    """Examples for every usable row, and id -> reason for the rows that cannot be trained on (among them
    prompt or completion token ids outside the model's `vocab_size` rows: an app's own ids, or rows logged
    for another base model, would otherwise fail every step of the tenant).

    With `max_len`, each example holds what training keeps of it (batch.truncate), and a completion logged as
    text is cut to what those tokens can span before it is tokenized (a row of a megabyte is otherwise held
    whole until the step's pack cuts it). A row drawn with a sampling record keeps its whole prompt, which
    its repetition penalty's recompute reads (`_history`)

    A row with `prompt_token_ids` trains on those ids, and its `group` is their decoded text: a function of
    the ids alone, so rows with the same prompt ids are one group whatever text they stored, and still a
    text (the loop hands groups to the gate as probe prompts)."""
    examples, unusable, positive = [], {}, []
    for row in rows.to_pylist():
        holes = [name for name in LIST_COLUMNS if None in (row.get(name) or ())]
        if holes:  # ingest writes none; another writer of the dataset might
            unusable[row["id"]] = f"{holes[0]} holds a null"
            continue
        stored_ids = row.get("prompt_token_ids")
        if stored_ids:
            prompt_ids = [int(t) for t in stored_ids]
            if vocab_size is not None and not all(0 <= t < vocab_size for t in prompt_ids):
                unusable[row["id"]] = f"prompt token ids outside the model's vocabulary of {vocab_size}"
                continue
            try:
                prompt = tokenizer.decode(prompt_ids)
            except Exception as e:  # ids this tokenizer does not have (no vocab_size given to catch them)
                unusable[row["id"]] = f"prompt token ids the tokenizer cannot decode: {type(e).__name__}"
                continue
        else:
            prompt = prompt_text(row, tokenizer)
            if not prompt:
                unusable[row["id"]] = "no prompt text or messages"
                continue
            prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        eos_appended = False
        if row.get("completion_token_ids"):
            completion_ids = [int(t) for t in row["completion_token_ids"]]
        else:
            text, logged = row.get("completion") or "", row
            cut = max_len is not None and len(text) > max_len * CHARS_PER_TOKEN  # past what training keeps of it
            if cut:
                logged = {**row, "completion": text[: max_len * CHARS_PER_TOKEN],
                          "metadata_json": json.dumps({"finish_reason": "length"})}  # cut: no end token after it
            # a prompt the chat template made of the row's messages: its turn ends as the template ends one
            chat = not stored_ids and prompt != row.get("prompt")
            completion_ids, eos_appended = retokenised_completion(logged, tokenizer, chat=chat)
        if not prompt_ids or not completion_ids:
            unusable[row["id"]] = "empty prompt or completion"
            continue
        if vocab_size is not None and not all(0 <= t < vocab_size for t in completion_ids):
            unusable[row["id"]] = f"completion token ids outside the model's vocabulary of {vocab_size}"
            continue
        behaviour = row.get("completion_logprobs")
        drawn = sampled_with(row)
        if behaviour and any(x > MAX_LOGPROB for x in behaviour):  # no log-prob: probabilities, or their negation
            positive.append(row["id"])
            behaviour = None
        if drawn is not None or not behaviour or not all(math.isfinite(x) for x in behaviour):
            behaviour = None  # recomputed (SampledWith), unknown (a reason) or none logged
        elif eos_appended and len(behaviour) == len(completion_ids) - 1:
            behaviour = [*behaviour, math.nan]  # the text's tokens': the appended stop token's is unknown (w = 1)
        elif not row.get("completion_token_ids") and cut and len(behaviour) >= len(completion_ids):
            behaviour = behaviour[: len(completion_ids)]  # the cut text's tokens: the first ones, far from the cut
        elif len(behaviour) != len(completion_ids):
            behaviour = None
        if max_len is not None:
            kept_prompt, completion_ids = truncate(prompt_ids, completion_ids, max_len)
            behaviour = None if behaviour is None else behaviour[: len(completion_ids)]
            if not isinstance(drawn, SampledWith):
                prompt_ids = kept_prompt
        examples.append(
            Example(
                id=row["id"],
                group=prompt,
                prompt_ids=tuple(prompt_ids),
                completion_ids=tuple(completion_ids),
                reward=float(row["reward"]),
                behaviour_logprobs=None if behaviour is None else tuple(known_logprob(x) for x in behaviour),
                sampled_with=drawn if isinstance(drawn, SampledWith) else None,
            )
        )
    if positive:
        logger.warning("%d rows (the first %s) logged completion_logprobs above 0, which no log-probability is "
                       "(probabilities, or negative log-likelihoods?): trained with weight 1, as without them",
                       len(positive), positive[0])
    return examples, unusable


def sampled_with(row: dict) -> SampledWith | str | None:
    """How the serving engine drew a row's completion, when its logged log-probs are not the behaviour
    policy's: serving logs vLLM's raw log-probs (temperature 1, before any cut), and records the request's
    sampling in `metadata.sampling`. None when they are the behaviour's: a draw at temperature 1 with
    nothing cut, or a row clora's serving tier did not log (an app's own log-probs are taken as its
    behaviour's). A SampledWith (the drawing version and its temperature, top-k, top-p, min-p,
    logit_bias, penalties, min_tokens and stop_token_ids) to recompute them from. A reason (str) when they
    cannot be recomputed here (another tenant's version, a draw under a structured-output grammar at another
    temperature or with a cut, an unreadable record: values serving never writes, as a negative temperature
    or token id or a fractional top_k): the row then trains with weight 1, as one without log-probs."""
    meta = row_metadata(row.get("metadata_json"))
    if not all(key in meta for key in SERVING_KEYS):
        return None
    sampling = meta.get("sampling")
    version = version_number(row.get("adapter_version"), row["tenant"])
    if version is None:
        return "made by another tenant's adapter"
    structured = isinstance(sampling, dict) and sampling.get("structured") is not None
    try:
        if not isinstance(sampling, dict):
            raise TypeError("not an object")
        drawn = SampledWith(
            version=version,
            temperature=_number(sampling.get("temperature", 1.0), low=0.0),
            top_k=_whole(sampling.get("top_k", 0)),
            top_p=_number(sampling.get("top_p", 1.0), low=0.0, high=1.0),
            min_p=_number(sampling.get("min_p", 0.0), low=0.0, high=1.0),
            logit_bias=tuple(sorted((_whole(int(t), low=0), _number(b)) for t, b in (sampling.get("logit_bias") or {}).items())),
            presence_penalty=_number(sampling.get("presence_penalty", 0.0), low=-2.0, high=2.0),
            frequency_penalty=_number(sampling.get("frequency_penalty", 0.0), low=-2.0, high=2.0),
            repetition_penalty=_number(sampling.get("repetition_penalty", 1.0), low=0.0),
            min_tokens=_whole(sampling.get("min_tokens", 0), low=0),
            stop_token_ids=tuple(_whole(t, low=0) for t in sampling.get("stop_token_ids") or ()),
        )
        if drawn.repetition_penalty == 0:
            raise ValueError("repetition_penalty 0 (it must be above 0)")
    except (TypeError, ValueError, AttributeError) as e:
        return f"unreadable sampling record: {e}"
    plain = drawn.temperature == 1.0 and drawn.top_p >= 1.0 and drawn.top_k <= 0 and drawn.min_p <= 0.0
    plain = plain and not drawn.logit_bias and not drawn.has_history
    if structured:
        # The engine masked every token that would leave the response_format's grammar before it drew (and
        # before it took the log-probs it logs): at temperature 1 with nothing else applied, the logged ones are
        # the behaviour's. Otherwise they would be recomputed from the logits without the grammar's mask,
        # which the learner cannot rebuild. A greedy draw needs none: each token had probability 1.
        if plain:
            return None
        if drawn.temperature == 0:
            return drawn
        return "drawn under a structured-output grammar with other sampling (response_format or a forced tool call)"
    return None if plain else drawn


def _number(value, *, low: float = -math.inf, high: float = math.inf) -> float:
    """A sampling record's number: not a bool, finite as a float, within [low, high]."""
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer past a float's range (10**400): JSON holds any
        number = math.nan
    if not math.isfinite(number) or not low <= number <= high:
        raise ValueError(f"{str(value)[:40]} is not a number in [{low:g}, {high:g}]")
    return number


MAX_WHOLE = 2**31 - 1  # the largest top_k, token id or count a sampling record may hold (a tensor's int64 is wider)


def _whole(value, *, low: int = -1) -> int:
    """A sampling record's whole number (top_k, a token id), in [low, MAX_WHOLE]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_WHOLE:
        raise ValueError(f"{str(value)[:40]} is not a whole number in [{low}, {MAX_WHOLE}]")
    return value


# What a serving tier answers for a log-prob it has no number for (-inf: a token the logits ruled out; NaN),
# as vLLM's own server does (serving/engine.py LOWEST_LOGPROB). Taken for a log-prob, it made that token's
# behaviour weight the cap's; it is unknown (NaN: the token gets weight 1).
NO_LOGPROB = -9999.0


def known_logprob(value: float) -> float:
    """`value` as a behaviour log-prob: NaN (unknown) for a non-finite one or the placeholder NO_LOGPROB."""
    return float(value) if math.isfinite(value) and value > NO_LOGPROB else math.nan


def behaviour_logprobs(policy: Policy, tenant: str, examples: Sequence[Example], batch: TokenBatch, *,
                       current_version: int, version_files: Callable[[int], Path | None] | None,
                       rows_per_pass: int | None = None) -> Behaviour:
    """The batch's behaviour log-probs [B, C], NaN where unknown (weight 1): among them the rows whose
    version's adapter files are gone (retention pruned them), which cannot be recomputed. And, for rows
    drawn otherwise than at temperature 1 by the tenant's current adapter or by the base model, the
    functions that make theirs from that model's logits, which pg_update calls with the logits of passes
    it runs anyway (`behaviour_from_logits`: its first pass; `behaviour_from_base_logits`: its base model
    reference pass): no pass of their own. Those rows are NaN in the tensor.

    A row's logged ones where it has them; for a row drawn otherwise than at temperature 1 (`sampled_with`),
    the log-prob of each sampled token under the distribution the engine drew it from
    (maths.processed_logprobs), from the logits of the version that drew it: the tenant's current adapter
    or the base model (version 0) (the functions above), or an earlier version's files
    (`version_files(number)`, one no-grad pass per version). A greedy row's are 0 (probability 1), with no
    pass."""
    old = pad_values([None if e.sampled_with else e.behaviour_logprobs for e in examples], batch.completion_width)
    by_version: dict[int, list[int]] = {}
    for i, e in enumerate(examples):
        drawn = e.sampled_with
        if drawn is None:
            continue
        if drawn.temperature == 0:
            old[i, : len(e.completion_ids)] = 0.0
        else:
            by_version.setdefault(drawn.version, []).append(i)
    behaviour = Behaviour(old)
    for number, rows in sorted(by_version.items()):
        drawn = [examples[i].sampled_with for i in rows]
        settings = [torch.tensor([getattr(d, name) for d in drawn]) for name in ("temperature", "top_k", "top_p", "min_p")]
        bias = None
        if any(d.logit_bias for d in drawn):
            bias = torch.zeros(len(rows), policy.vocab_size)
            for j, d in enumerate(drawn):
                for token, value in d.logit_bias:
                    if token < policy.vocab_size:
                        bias[j, token] += value

        history = None
        if any(d.has_history for d in drawn):
            history = _history([examples[i] for i in rows], policy.stop_token_ids, policy.vocab_size)

        def process(logits, part, at, settings=settings, bias=bias, history=history):
            return maths.processed_logprobs(logits, part.completion_ids, *(t[at].to(logits.device) for t in settings),
                                            None if bias is None else bias[at].to(logits.device),
                                            mask=part.completion_mask,
                                            history=None if history is None else _rows_of(history, at, logits.device))

        if number == 0:  # the base model's, also while it is the tenant's current version
            behaviour.from_base = BehaviourFromLogits(rows, process)
            continue
        if number == current_version:
            behaviour.from_adapter = BehaviourFromLogits(rows, process)
            continue
        part = batch.rows(torch.tensor(rows))
        directory = None if version_files is None else version_files(number)
        if directory is None:
            logger.info("tenant %s: version %d's adapter files are gone: %d rows it drew train with weight 1",
                        tenant, number, len(rows))
            continue
        try:
            with policy.weights_of_version(tenant, directory):
                logps = policy.processed_logprobs(part, tenant, process, rows_per_pass=rows_per_pass)
        except PolicyError as e:  # a damaged file: raised, the same rows would fail every step of the tenant
            logger.warning("tenant %s: version %d's adapter files cannot be read (%s): %d rows it drew train "
                           "with weight 1", tenant, number, e, len(rows))
            continue
        old[rows] = logps
    return behaviour


@dataclass
class Behaviour:
    """What `behaviour_logprobs` gives pg_update: `old` (its `old_logprobs`), and the functions that make
    the rest from the logits of passes it runs anyway (None when no row needs them)."""

    old: torch.Tensor
    from_adapter: BehaviourFromLogits | None = None  # pg_update's behaviour_from_logits
    from_base: BehaviourFromLogits | None = None  # pg_update's behaviour_from_base_logits


class BehaviourFromLogits:
    """The behaviour log-probs of the batch rows `rows`, all drawn by one version, from that version's logits:
    called as `(logits [b, C, V], part, span)` for `part`, the batch's rows `span` (a slice), it returns
    [b, C] on the logits' device, NaN in the rows that are not its own. `process(logits, part, at)` computes
    them for a part of its own rows, `at` indexing `rows`."""

    def __init__(self, rows: Sequence[int], process: Callable[[torch.Tensor, TokenBatch, torch.Tensor], torch.Tensor]):
        self.position = {row: j for j, row in enumerate(rows)}
        self.process = process

    def __call__(self, logits: torch.Tensor, part: TokenBatch, span: slice) -> torch.Tensor:
        out = torch.full(part.completion_ids.shape, math.nan, dtype=torch.float32, device=logits.device)
        batch_rows = range(span.start, span.stop)
        mine = [k for k, row in enumerate(batch_rows) if row in self.position]
        if not mine:
            return out
        own = torch.tensor([self.position[batch_rows[m]] for m in mine])
        if len(mine) == len(batch_rows):  # every row its own: the logits as they are, not a copy of them
            out[:] = self.process(logits, part.to(logits.device), own)
        else:
            k = torch.tensor(mine)
            out[k.to(logits.device)] = self.process(logits[k.to(logits.device)], part.rows(k).to(logits.device), own)
        return out


def retokenised_completion(row: dict, tokenizer, *, chat: bool = False) -> tuple[list[int], bool]:
    """(token ids, whether the end-of-sequence token was appended) of a row without `completion_token_ids`
    (an app producing to Kafka itself; serving's rows carry the ids it sampled): the completion's text
    tokenized, and the tokenizer's end-of-sequence token appended; for a `chat` prompt (the chat template's),
    the token the template closes an assistant's turn with (`turn_end_id`: Gemma's `<end_of_turn>`, Phi-3's
    `<|end|>`, where the tokenizer's end-of-sequence token is another, which the model never writes there). An app's logged answer is a whole answer,
    which ended there; without the token the policy learns every token of a good answer but never to stop
    after it, which serving's rows (their sampled ids end with it) and rollouts (`rollouts.completion_tokens`,
    for a sample that finished) do teach. Not appended to an empty text (still no completion to train), to
    text whose tokens already end with it, or when the row's metadata says the answer was cut at its length
    limit (`finish_reason` "length", the OpenAI name, which serving logs too).

    Log-probs logged without ids (`to_examples`) are the app's per token: one per token of the text (the
    appended token's is then unknown: NaN, weight 1 there) or one more (the app logged its stop token's
    too, as vLLM's `token_logprobs` have it)."""
    ids = list(tokenizer(row.get("completion") or "", add_special_tokens=False).input_ids)
    eos = turn_end_id(tokenizer) if chat else tokenizer.eos_token_id
    cut = row_metadata(row.get("metadata_json")).get("finish_reason") == "length"
    if not ids or eos is None or ids[-1] == eos or cut:
        return ids, False
    return ids + [eos], True


TURN_MARK = "Zq7clora-turn-mark"  # an assistant's content no template changes, found again in its rendering


def turn_end_id(tokenizer) -> int | None:
    """The token the tokenizer's chat template closes an assistant's turn with: the first token after an
    assistant message's content in a rendered conversation, when it is a special token (an added one);
    otherwise, or without a template, the tokenizer's end-of-sequence token. Worked out once per tokenizer
    and template."""
    template = str(getattr(tokenizer, "chat_template", None))
    cached = _turn_ends.get(tokenizer)
    if cached is not None and cached[0] == template:
        return cached[1]
    end = tokenizer.eos_token_id
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": TURN_MARK}],
                                             tokenize=False)
    except Exception as e:  # no template, or one with rules of its own: the end-of-sequence token
        logger.debug("the chat template did not render a conversation (%s); turns end with eos", e)
        text = ""
    if TURN_MARK in text:
        after = tokenizer(text.split(TURN_MARK, 1)[1], add_special_tokens=False).input_ids
        special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
        if after and after[0] in special:
            end = after[0]
    _turn_ends[tokenizer] = (template, end)
    return end


_turn_ends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (its template, the token)


def within_reward_range(examples: Sequence[Example], max_abs: float) -> tuple[list[Example], dict[str, str]]:
    """The examples whose reward is within +-`max_abs` (`learner.gate_max_abs_reward`), and id -> reason for
    the others. Ingest takes any finite inline reward, and the gate rejects a batch holding one beyond the
    limit: left in, one such row cost the whole batch a training pass and then the batch itself (a rejected
    step's rows are committed as trained). Left out here, the rest of the batch trains. A non-finite reward
    is no value ingest lets in (only a damaged or hand-written file holds one): it stays, for the gate to
    reject the batch as poisoned."""
    kept, dropped = [], {}
    for e in examples:
        if abs(e.reward) > max_abs:
            dropped[e.id] = f"reward {e.reward:g} beyond +-{max_abs:g} (learner.gate_max_abs_reward)"
        else:
            kept.append(e)
    return kept, dropped


# ---------------------------------------------------------------------------------------------------------
# The step


# ---------------------------------------------------------------------------------------------------------
# Flat batches

FLAT_TOLERANCE = 1e-12


def is_flat(rewards: Sequence[float]) -> bool:
    """Whether a batch of two or more rewards holds no contrast: every reward equal (and finite)."""
    return len(rewards) >= 2 and all(math.isfinite(r) for r in rewards) and max(rewards) - min(rewards) <= FLAT_TOLERANCE


def flat_within_prompts(examples: Sequence[Example]) -> bool:
    """Whether every prompt of the batch came two or more times and each one's answers scored alike (an
    app answering the same questions greedily): every leave-one-out advantage is then 0 (up to rounding),
    and a zero gradient is no zero step, Adam moving the adapter on its momentum from earlier batches."""
    by_prompt: dict[str, list[float]] = {}
    for e in examples:
        by_prompt.setdefault(e.group, []).append(e.reward)
    return bool(by_prompt) and all(len(r) >= 2 and is_flat(r) for r in by_prompt.values())


def baseline_after(baseline: float | None, rewards: Sequence[float]) -> float:
    """The tenant's running mean reward after a batch with `rewards` (maths.running_mean)."""
    return maths.running_mean(baseline, torch.tensor(list(rewards), dtype=torch.float64))


@dataclass(frozen=True)
class LogsStep:
    update: UpdateResult
    reward_mean: float
    baseline: float  # the running mean after this batch


def _history(examples: Sequence[Example], model_stops: Sequence[int], vocab_size: int) -> maths.History:
    """The penalties and min_tokens of examples drawn with them, as maths.processed_logprobs takes them: each
    row's whole prompt (before any truncation to max_len, as the engine saw it) and its stop tokens, the
    request's stop_token_ids with the model's `model_stops` (its EOS and generation config's, which vLLM's
    min_tokens cuts whether or not the request ignored EOS). Ids beyond the vocabulary are left out, as
    logit_bias's are: no logit to act on."""
    drawn = [e.sampled_with for e in examples]
    stops = [dict.fromkeys([*model_stops, *d.stop_token_ids]) for d in drawn]
    return maths.History(
        prompt_ids=_padded([e.prompt_ids for e in examples], vocab_size),
        stops=_padded(stops, vocab_size),
        min_tokens=torch.tensor([d.min_tokens for d in drawn]),
        presence=torch.tensor([d.presence_penalty for d in drawn]),
        frequency=torch.tensor([d.frequency_penalty for d in drawn]),
        repetition=torch.tensor([d.repetition_penalty for d in drawn]),
    )


def _padded(ids: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """Token id lists as one [n, longest] tensor, -1 after each list's end; ids >= vocab_size left out."""
    kept = [[t for t in x if t < vocab_size] for x in ids]
    out = torch.full((len(kept), max(1, max(len(x) for x in kept))), -1, dtype=torch.long)
    for i, x in enumerate(kept):
        out[i, : len(x)] = torch.tensor(x, dtype=torch.long)
    return out


def _rows_of(history: maths.History, at: torch.Tensor, device: torch.device) -> maths.History:
    """The History of the rows `at` of `history`, on `device` (the logits')."""
    return maths.History(*(getattr(history, f.name)[at].to(device) for f in fields(history)))


def train_step(
    policy: Policy,
    tenant: str,
    examples: list[Example],
    *,
    baseline: float | None,
    scale_advantages: bool = True,
    clip_eps: float,
    behaviour_weight_cap: float = maths.BEHAVIOUR_WEIGHT_CAP,
    epochs: int = 1,
    kl_coef: float,
    entropy_coef: float = 0.0,
    max_grad_norm: float,
    max_len: int,
    micro_batch_size: int | None = None,
    current_version: int,
    version_files: Callable[[int], Path | None] | None = None,
) -> LogsStep:
    """One off-policy update on `examples` (see the module note); `baseline` is the tenant's running mean
    reward so far (None before its first step). `micro_batch_size` bounds the examples in one forward pass
    (the gradient is the whole batch's either way), so a catch-up step of several batches needs one batch's
    memory. `current_version` (the version the tenant's adapter holds) and `version_files(number)` (an
    earlier version's PEFT files, None once pruned) recompute the behaviour log-probs of rows the engine
    drew otherwise than at temperature 1 (behaviour_logprobs)."""
    rewards = torch.tensor([e.reward for e in examples], dtype=torch.float64)
    start = maths.running_mean(None, rewards) if baseline is None else baseline
    advantages = maths.baseline_advantages(rewards, maths.group_ids([e.group for e in examples]), start)
    if scale_advantages:
        advantages = maths.scale_by_std(advantages, rewards)
    batch = pack(
        [e.prompt_ids for e in examples], [e.completion_ids for e in examples], pad_id=policy.pad_token_id, max_len=max_len
    )
    behaviour = behaviour_logprobs(policy, tenant, examples, batch, current_version=current_version,
                                   version_files=version_files, rows_per_pass=micro_batch_size)
    result = pg_update(
        policy,
        tenant,
        batch,
        advantages.float(),
        old_logprobs=behaviour.old,
        clip_eps=clip_eps,
        behaviour_weight_cap=behaviour_weight_cap,
        epochs=epochs,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        max_grad_norm=max_grad_norm,
        micro_batch_size=micro_batch_size,
        behaviour_from_logits=behaviour.from_adapter,
        behaviour_from_base_logits=behaviour.from_base,
    )
    return LogsStep(update=result, reward_mean=float(rewards.mean()), baseline=maths.running_mean(baseline, rewards))
