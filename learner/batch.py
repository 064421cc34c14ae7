"""Token batches: prompts and completions packed into the tensors one forward pass takes.

Layout: every row is `[left padding | prompt | completion | right padding]`, prompts left-padded to a common
width P and completions right-padded to a common width C. All completions then start at column P, so the
log-probs of every completion token come from the last C + 1 positions of the logits
(`logits_to_keep=C + 1`), and the model never materialises logits over the prompt, which is where most
of the memory would go for long prompts and large vocabularies. Position ids count real tokens only, so a
left-padded row sees the same positions as it would alone. Rows with the same prompt (a GRPO group) have the
same prompt columns, so `prompt_groups` finds them and the policy runs each prompt once (policy.py).

Truncation: a row longer than `max_len` loses prompt tokens from the left (the end of the prompt, next to
the completion, matters most), keeping at least one prompt token; a completion that alone does not fit is
cut at the end.

Pure: lists of ints in, tensors out. Tokenizing is the caller's business (logs_mode.py, rollouts.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenBatch:
    input_ids: Tensor  # [B, P + C] long
    attention_mask: Tensor  # [B, P + C] long, 1 on real tokens
    position_ids: Tensor  # [B, P + C] long
    completion_ids: Tensor  # [B, C] long: input_ids[:, P:]
    completion_mask: Tensor  # [B, C] float, 1 on real completion tokens
    prompt_width: int  # P

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def completion_width(self) -> int:
        return int(self.completion_ids.shape[1])

    @property
    def n_tokens(self) -> int:
        """Real completion tokens (what the loss is taken over)."""
        return int(self.completion_mask.sum())

    def prompt_groups(self) -> tuple[Tensor, Tensor] | None:
        """Rows that share their prompt (the same tokens in the same padded columns, as a GRPO group's
        completions do): `(first, inverse)`, where `first[u]` is the first row holding the u-th distinct
        prompt and `inverse[r]` the distinct prompt of row r, so a forward pass can run each prompt once
        and hand its keys and values to every row of its group. None when no two rows share a prompt."""
        width = self.prompt_width
        key = torch.cat([self.input_ids[:, :width], self.attention_mask[:, :width]], dim=1)
        distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
        if distinct.shape[0] == self.size:
            return None
        rows = torch.arange(self.size, device=inverse.device)
        first = torch.full((distinct.shape[0],), self.size, dtype=torch.long, device=inverse.device)
        first = first.scatter_reduce(0, inverse, rows, reduce="amin")
        return first, inverse

    def rows(self, index: slice) -> TokenBatch:
        """A contiguous slice of rows (for micro-batches); widths stay the same."""
        return TokenBatch(
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            position_ids=self.position_ids[index],
            completion_ids=self.completion_ids[index],
            completion_mask=self.completion_mask[index],
            prompt_width=self.prompt_width,
        )

    def chunks(self, rows: int | None) -> Iterator[tuple[slice, TokenBatch]]:
        """Consecutive slices of at most `rows` rows (None: the whole batch) and each slice's batch: the
        micro-batches of an update, and of the passes that must not hold every row's logits at once."""
        step = rows or self.size
        for start in range(0, self.size, step):
            index = slice(start, min(start + step, self.size))
            yield index, self.rows(index)

    def to(self, device) -> TokenBatch:
        return TokenBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            position_ids=self.position_ids.to(device),
            completion_ids=self.completion_ids.to(device),
            completion_mask=self.completion_mask.to(device),
            prompt_width=self.prompt_width,
        )


def truncate(prompt: Sequence[int], completion: Sequence[int], max_len: int) -> tuple[list[int], list[int]]:
    """Fits one row into `max_len` tokens (see the module note); needs max_len >= 2."""
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2 (one prompt and one completion token), got {max_len}")
    if not prompt:
        raise ValueError("a prompt needs at least one token (the completion's first token is predicted from it)")
    completion = list(completion[: max_len - 1])
    keep = max_len - len(completion)
    return list(prompt[-keep:]), completion


def pack(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *, pad_id: int, max_len: int
) -> TokenBatch:
    """Packs prompt/completion token lists into a TokenBatch (see the module note for the layout)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if not prompts:
        raise ValueError("cannot pack an empty batch")
    rows = [truncate(p, c, max_len) for p, c in zip(prompts, completions)]
    width_p = max(len(p) for p, _ in rows)
    width_c = max(1, max(len(c) for _, c in rows))
    n = len(rows)
    input_ids = torch.full((n, width_p + width_c), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width_p + width_c), dtype=torch.long)
    completion_mask = torch.zeros((n, width_c), dtype=torch.float32)
    for i, (p, c) in enumerate(rows):
        input_ids[i, width_p - len(p) : width_p] = torch.tensor(p, dtype=torch.long)
        attention[i, width_p - len(p) : width_p] = 1
        if c:
            input_ids[i, width_p : width_p + len(c)] = torch.tensor(c, dtype=torch.long)
            attention[i, width_p : width_p + len(c)] = 1
            completion_mask[i, : len(c)] = 1.0
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return TokenBatch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=position_ids,
        completion_ids=input_ids[:, width_p:].clone(),
        completion_mask=completion_mask,
        prompt_width=width_p,
    )


def pad_values(values: Sequence[Sequence[float] | None], width: int, *, fill: float = float("nan")) -> Tensor:
    """Per-token values (say behaviour log-probs) as a [B, width] float tensor aligned with a TokenBatch's
    completions; rows that have none, and positions past a row's end, hold `fill`."""
    out = torch.full((len(values), width), fill, dtype=torch.float32)
    for i, v in enumerate(values):
        if v is not None and len(v):
            v = list(v)[:width]
            out[i, : len(v)] = torch.tensor(v, dtype=torch.float32)
    return out
