"""Micro-batching is exact: for every loss, the gradient accumulated over micro-batches equals the
one-batch gradient (fp64, 1e-9), on one process and on 2 gloo ranks whose shards have different
numbers of micro-batches. Split groups (micro-batch smaller than a group) and whole-group packing
are both covered; a control shows that per-micro-batch group statistics (what a naive split
computes) give a different gradient, so the comparison can fail.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import gloo_group, spawn_ranks

from hpc_tba.comm.groups import free_ports
from hpc_tba.losses import LossInputs, compute_loss, loss_units, make_config
from hpc_tba.roles import microbatch
from hpc_tba.roles.policy import pack, response_logprobs

CASES = {
    "tb": {"name": "tb", "beta0": 0.05, "beta_final": 0.05},
    "topr": {"name": "topr"},
    "topr_tis": {"name": "topr", "topr_pos_min": 0.0, "topr_positive_threshold": 0.5, "topr_baseline": 0.5},
    "alol": {"name": "alol"},
    "alol_ref_free": {"name": "alol", "alol_variant": "ref_free"},
    "alol_seq": {"name": "alol", "alol_variant": "seq"},
    "alol_kl": {"name": "alol", "alol_variant": "kl", "alol_kl_beta": 0.1},
    "r_lol": {"name": "alol", "alol_variant": "r_lol"},
    "grpo": {"name": "grpo"},
    "grpo_kl": {"name": "grpo", "kl_coef": 0.04},
    "rloo": {"name": "rloo"},
    "rloo_kl": {"name": "rloo", "kl_coef": 0.1},
    "dpo": {"name": "dpo"},
    "dpo_all": {"name": "dpo", "dpo_pairing": "all"},
    "sft": {"name": "sft", "sft_min_reward": -1.0},
}
GROUP_SIZES = (3, 4, 2, 1, 4)
SHARDS = ((0, 3), (1, 2, 4))  # groups per rank: 4 and 10 rows, different micro-batch counts
V, TEMP = 17, 0.7


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).double()


def _data():
    rng = np.random.default_rng(3)
    gid = np.concatenate([np.full(n, g) for g, n in enumerate(GROUP_SIZES)])
    b = len(gid)
    prompts = {g: rng.integers(1, V, rng.integers(2, 6)) for g in range(len(GROUP_SIZES))}
    responses = [rng.integers(1, V, rng.integers(1, 9)) for _ in range(b)]
    responses[5] = responses[5][:0]  # an empty response: a padding row
    return {"gid": gid, "prompts": [prompts[g] for g in gid], "responses": responses,
            "rewards": rng.integers(0, 3, b).astype(np.float64) - 1.0, "adv": rng.normal(size=b),
            "ref": rng.normal(-2.5, 0.5, (b, 8)), "beh": rng.normal(-2.5, 0.5, (b, 8))}


def _inputs(d, rows, packed):
    t = packed.response_mask.shape[1]
    f64 = dict(dtype=torch.float64)
    return LossInputs(logp=torch.zeros(packed.response_mask.shape, **f64),
                      logp_ref=torch.tensor(d["ref"][rows, :t], **f64),
                      logp_behavior=torch.tensor(d["beh"][rows, :t], **f64), mask=packed.response_mask,
                      rewards=torch.tensor(d["rewards"][rows], **f64), group_ids=torch.as_tensor(d["gid"][rows]),
                      advantages=torch.tensor(d["adv"][rows], **f64))


def _grads(case: str, rows, *, micro: int | None, reduce_max=None, all_reduce=None, naive=False,
           tokens: int = 0):
    """Flat gradient on `rows` (one batch when micro is None, else accumulated micro-batches: of
    `micro` rows, or, with `tokens`, packed bins of at most that many tokens)."""
    d, model = _data(), _model()
    rows = np.asarray(rows)
    cfg = make_config(**CASES[case])
    packed = pack([d["prompts"][i] for i in rows], [d["responses"][i] for i in rows], pad_id=0,
                  packing=bool(tokens))
    x = _inputs(d, rows, packed)
    units = loss_units(cfg, x)
    if all_reduce is not None:
        all_reduce(units)
    norm = max(float(units), 1.0)

    def logp_fn(sel):
        return response_logprobs(model, packed.select(sel), temperature=TEMP, chunk_tokens=3).double()

    if micro is None:
        full = response_logprobs(model, packed, temperature=TEMP).double()
        loss, _ = compute_loss(cfg, LossInputs(**{**x.__dict__, "logp": full}), step=0, normalizer=norm)
        loss.backward()
    elif naive:  # each micro-batch on its own: group statistics of the micro-batch only
        p = microbatch.plan(packed.response_mask.sum(-1).numpy(), d["gid"][rows], micro)
        for sel in p.rows:
            sub = packed.select(torch.as_tensor(sel))
            xs = _inputs(d, rows[sel], sub)
            loss, _ = compute_loss(cfg, LossInputs(**{**xs.__dict__, "logp": logp_fn(torch.as_tensor(sel))}),
                                   step=0, normalizer=norm)
            loss.backward()
    else:
        if tokens:
            lengths = np.array([len(d["prompts"][i]) + len(d["responses"][i]) for i in rows])
            p = microbatch.plan_tokens(lengths, d["gid"][rows], tokens)
        else:
            p = microbatch.plan(packed.response_mask.sum(-1).numpy(), d["gid"][rows], micro)
        if reduce_max is not None:
            p = microbatch.agree(p, reduce_max)
        loss, _, _ = microbatch.accumulate(cfg, x, p, logp_fn=logp_fn,
                                           backward=lambda loss, last: loss.backward(), step=0, normalizer=norm)
    g = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    if all_reduce is not None:
        all_reduce(g)
    return g


ALL = list(range(sum(GROUP_SIZES)))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("micro", [2, 5, 100])
def test_accumulated_gradient_equals_one_batch(case, micro):
    ref = _grads(case, ALL, micro=None)
    got = _grads(case, ALL, micro=micro)
    assert ref.abs().max() > 0
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("tokens", [13, 40, 400])  # groups split; whole groups in bins; one bin
def test_packed_token_bins_accumulate_the_one_batch_gradient(case, tokens):
    ref = _grads(case, ALL, micro=None)
    got = _grads(case, ALL, micro=0, tokens=tokens)
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("case", ["tb", "grpo", "rloo_kl", "dpo"])
def test_naive_split_differs(case):
    """Control: group statistics from a micro-batch of 2 are not the group's, the gradient moves."""
    ref = _grads(case, ALL, micro=None)
    naive = _grads(case, ALL, micro=2, naive=True)
    assert (naive - ref).abs().max() > 1e-6


def test_plan_packs_whole_groups_longest_first():
    lengths = np.array([5, 9, 3, 3, 7, 7, 2])
    gid = np.array([0, 0, 1, 1, 2, 2, 3])
    p = microbatch.plan(lengths, gid, 4)
    assert not p.split
    assert [r.tolist() for r in p.rows] == [[0, 1, 4, 5], [2, 3, 6]]
    s = microbatch.plan(lengths, gid, 1)
    assert s.split and [r.tolist() for r in s.rows] == [[1], [4], [5], [0], [2], [3], [6]]
    with pytest.raises(ValueError, match="micro-batch size"):
        microbatch.plan(lengths, gid, 0)


def _agree_on_ranks(plans: list[microbatch.MicroPlan]) -> list[microbatch.MicroPlan]:
    """`agree` on each plan at once, one thread per rank, the max taken over the ranks' dicts."""
    import threading

    barrier, seen, out = threading.Barrier(len(plans)), {}, [None] * len(plans)

    def rank(i):
        def reduce_max(m):
            seen[i] = dict(m)
            barrier.wait()
            g = {k: max(d[k] for d in seen.values()) for k in m}
            barrier.wait()  # everyone read this round before the next one writes
            return g

        out[i] = microbatch.agree(plans[i], reduce_max)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_agreed_plans_run_the_same_forwards_on_every_rank():
    """Rank 0 packs two whole groups into one micro-batch, rank 1 has two: rank 0 splits its batch
    (cutting a group), so it needs the context pass of a group-coupled loss (TB vargrad), and
    rank 1 must run it too, or their ZeRO-3 forwards no longer pair up (a hang on a cluster)."""
    a = microbatch.plan(np.array([4, 3, 5, 2]), np.array([0, 0, 1, 1]), 4)
    b = microbatch.plan(np.array([4, 3, 5, 2]), np.array([0, 0, 1, 1]), 2)
    assert not a.split and not b.split and (len(a.rows), len(b.rows)) == (1, 2)
    tb = make_config(**CASES["tb"])
    agreed = _agree_on_ranks([a, b])
    forwards = [len(p.rows) + len(microbatch.context_passes(tb, p)) for p in agreed]
    assert forwards[0] == forwards[1] == 3, forwards  # 2 micro-batches, the second with a context pass
    same = _agree_on_ranks([b, b])  # equal counts, whole groups: no context pass anywhere
    assert [microbatch.needs_context(tb, p) for p in same] == [False, False]


def _rank_main(rank: int, port: int) -> dict | None:
    with gloo_group(rank, 2, port):
        gid = _data()["gid"]
        rows = [i for i in ALL if gid[i] in SHARDS[rank]]

        def reduce_max(m):
            keys = sorted(m)
            t = torch.tensor([m[k] for k in keys], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return dict(zip(keys, t.tolist()))

        def all_reduce(t):
            dist.all_reduce(t)

        out = {}
        for case in sorted(CASES):
            for micro in (2, 5):
                out[(case, micro)] = _grads(case, rows, micro=micro, reduce_max=reduce_max,
                                            all_reduce=all_reduce).numpy()  # no shared-memory fds
    return out if rank == 0 else None


def test_two_ranks_accumulated_gradient_equals_one_process():
    got = spawn_ranks(_rank_main, 2, (free_ports(1)[0],), timeout_s=360)[0]
    for (case, micro), g in got.items():
        torch.testing.assert_close(torch.from_numpy(g), _grads(case, ALL, micro=None), rtol=1e-9, atol=1e-9,
                                   msg=lambda m, c=case, mb=micro: f"{c} micro={mb}: {m}")
