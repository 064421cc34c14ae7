"""learner/batch.py: the packed layout, truncation and per-token value alignment."""

from __future__ import annotations

import math

import pytest
import torch

from learner.batch import pack, pad_values, truncate

pytestmark = pytest.mark.unit


def test_prompts_are_left_padded_and_completions_right_padded():
    b = pack([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_id=0, max_len=64)
    assert b.prompt_width == 3 and b.completion_width == 3
    assert b.input_ids.tolist() == [[5, 6, 7, 1, 2, 0], [0, 0, 8, 3, 4, 9]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    # positions count real tokens only: row 1's prompt token is at position 0
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert b.completion_ids.tolist() == [[1, 2, 0], [3, 4, 9]]
    assert b.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert b.n_tokens == 5 and b.size == 2
    sub = b.rows(slice(1, 2))
    assert sub.input_ids.tolist() == [[0, 0, 8, 3, 4, 9]] and sub.prompt_width == 3


def test_truncation_drops_prompt_tokens_from_the_left_and_keeps_one():
    assert truncate([1, 2, 3, 4], [5, 6], max_len=4) == ([3, 4], [5, 6])
    assert truncate([1, 2, 3, 4], [5, 6, 7, 8, 9], max_len=4) == ([4], [5, 6, 7])
    with pytest.raises(ValueError, match="max_len must be at least 2"):
        truncate([1], [2], max_len=1)
    with pytest.raises(ValueError, match="at least one token"):
        truncate([], [2], max_len=8)


def test_empty_completion_gives_an_all_zero_mask_row():
    b = pack([[1, 2], [3]], [[], [4]], pad_id=0, max_len=16)
    assert b.completion_mask.tolist() == [[0], [1]]


def test_pack_checks_its_inputs():
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        pack([[1], [2]], [[3]], pad_id=0, max_len=8)
    with pytest.raises(ValueError, match="empty batch"):
        pack([], [], pad_id=0, max_len=8)


def test_rows_that_share_a_prompt_are_grouped_and_rows_that_do_not_are_not():
    # rows 0, 2 and 3 share [5, 6]; row 1's [6] is a different prompt, and so is row 4's [0, 6]: the same
    # token ids once padded ([0, 6]) but a real token 0 where row 1 has padding
    b = pack([[5, 6], [6], [5, 6], [5, 6], [0, 6]], [[1], [2, 3], [4], [], [7]], pad_id=0, max_len=16)
    first, inverse = b.prompt_groups()
    assert first.shape == (3,)
    assert [int(first[inverse[r]]) for r in range(b.size)] == [0, 1, 0, 0, 4]
    assert pack([[1], [2]], [[3], [3]], pad_id=0, max_len=8).prompt_groups() is None


def test_pad_values_aligns_with_completions_and_fills_gaps():
    v = pad_values([[-0.5, -1.0], None, [-2.0, -3.0, -4.0, -5.0]], width=3)
    assert v[0, :2].tolist() == [-0.5, -1.0] and math.isnan(v[0, 2])
    assert torch.isnan(v[1]).all()
    assert v[2].tolist() == [-2.0, -3.0, -4.0]  # cut at the batch width
