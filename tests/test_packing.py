"""Packed micro-batches (learner.micro_batch_tokens, issue 43): several sequences to a row (rows as
long as the micro-batch's longest sequence), each with its own position ids, attending only within
itself.

- log-probs of a packed row equal the padded rows' on every stand-in family (fp64), and a control
  with one running position count (sequences attending to each other) differs, so the check can fail;
- the token-budget plan: bins within the budget, whole groups when each fits, longest first,
  single sequences when a group does not fit, a sequence over the budget refused by name;
- the config refusals (a budget below searcher.max_model_len, packing under SP).
The gradient accumulated over packed bins equals the one-batch gradient for every loss in
tests/test_microbatch.py, and a 2-rank DeepSpeed step with the budget equals the padded one in
tests/test_packing_learner.py.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers

from hpc_tba.models.stand_ins import ARCHITECTURES, _config
from hpc_tba.roles import microbatch
from hpc_tba.roles.policy import pack, response_logprobs

TEMP = 0.7


def _sequences(seed: int = 0, n: int = 6, vocab: int = 60):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, rng.integers(2, 9)) for _ in range(n)]
    responses = [rng.integers(3, vocab, rng.integers(1, 24)) for _ in range(n)]
    return prompts, responses


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_packed_row_gives_the_padded_rows_log_probs(arch):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(arch, 60, tie=None)).double().eval()
    prompts, responses = _sequences()
    rows = torch.arange(len(prompts))
    padded = pack(prompts, responses, pad_id=0).select(rows)
    packed = pack(prompts, responses, pad_id=0, packing=True).select(rows)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    assert packed.input_ids.shape[1] == max(lengths) and packed.input_ids.shape[0] < len(lengths)
    assert packed.attention_mask is None and packed.position_ids[:, 0].eq(0).all()
    with torch.no_grad():
        want = response_logprobs(model, padded, temperature=TEMP, chunk_tokens=5)
        got = response_logprobs(model, packed, temperature=TEMP, chunk_tokens=5)
        assert int((got != 0).sum()) == sum(len(r) for r in responses)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        # control: positions counted through the whole row, so the sequences see each other
        one = dataclasses.replace(packed, position_ids=torch.arange(packed.input_ids.shape[1])[None])
        assert (response_logprobs(model, one, temperature=TEMP) - want).abs().max() > 1e-4


def test_a_packed_selection_keeps_each_sequence_and_its_targets():
    prompts, responses = _sequences(n=5)
    full = pack(prompts, responses, pad_id=0, packing=True)
    chosen = [3, 1, 4]
    sel = full.select(torch.tensor(chosen))
    lengths = [len(prompts[i]) + len(responses[i]) for i in chosen]
    assert sel.input_ids.shape[1] == max(lengths)  # rows as long as the longest sequence
    assert sel.input_ids.numel() - sum(lengths) < sel.input_ids.shape[1]  # padding: at most one row's
    for b, i in enumerate(chosen):  # each sequence whole in its row, positions from 0, targets right
        row, n, m = int(sel.hidden_row[b]), lengths[b], len(responses[i])
        first = int(sel.logit_index[b, 0]) + 1 - len(prompts[i])
        assert sel.position_ids[row, first:first + n].tolist() == list(range(n))
        assert sel.input_ids[row, first:first + n].tolist() == [*prompts[i].tolist(), *responses[i].tolist()]
        assert sel.input_ids[row, sel.logit_index[b, :m] + 1].tolist() == responses[i].tolist()


def test_token_plan_fills_bins_within_the_budget_whole_groups_longest_first():
    lengths = np.array([10, 12, 30, 5, 5, 40, 8, 8])
    groups = np.array([0, 0, 1, 2, 2, 3, 4, 4])
    p = microbatch.plan_tokens(lengths, groups, 50)
    assert not p.split
    assert sorted(np.concatenate(p.rows).tolist()) == list(range(8))
    assert all(int(lengths[r].sum()) <= 50 for r in p.rows)
    for g in set(groups.tolist()):  # every group inside one bin
        assert sum(bool(np.isin(np.flatnonzero(groups == g), r).any()) for r in p.rows) == 1
    # first fit, groups longest first (40, 30, 22, 16, 10), a bin's cost its packed rows x its longest:
    # 40 | 30 | 12+10 (2 rows of 12), then 8+8 joins them (4 rows of 12 = 48), 5+5 a bin of its own
    assert [r.tolist() for r in p.rows] == [[5], [2], [0, 1, 6, 7], [3, 4]]
    assert all(microbatch.packed_positions(lengths[r]) <= 50 for r in p.rows)


def test_token_plan_splits_groups_that_do_not_fit_and_refuses_a_sequence_over_the_budget():
    lengths = np.array([20, 20, 20, 7])
    groups = np.array([0, 0, 0, 1])
    p = microbatch.plan_tokens(lengths, groups, 45)
    assert p.split and all(int(lengths[r].sum()) <= 45 for r in p.rows)
    assert [r.tolist() for r in p.rows] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="a sequence of 46 tokens \\(row 1\\) exceeds learner.micro_batch_tokens=45"):
        microbatch.plan_tokens(np.array([3, 46]), np.array([0, 1]), 45)


def test_the_config_refuses_a_budget_below_a_sequence_and_packing_under_sp():
    from hpc_tba.assembly.compose import compose
    from hpc_tba.config import ConfigError

    assert compose(["learner.micro_batch_tokens=64"]).learner.micro_batch_tokens == 64
    with pytest.raises(ConfigError, match="learner.micro_batch_tokens=32 is below searcher.max_model_len=64"):
        compose(["learner.micro_batch_tokens=32"])
    with pytest.raises(ConfigError, match="packed micro-batches under sequence parallelism are not built yet"):
        compose(["learner.micro_batch_tokens=64", "learner.sequence_parallel_size=2", "cluster.num_learners=2"])
