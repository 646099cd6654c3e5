"""Offline training (TOPR, A-LoL): no searchers; every learner shard is filled from a data file.

`hpc-tba preprocess task=offline task.path=...` computes, once, whatever the objective needs and
the file lacks, under the starting policy (which is both the behaviour policy μ of data the model
generated itself and the reference π_ref): sequence log-probs at the temperature the learner will
score at (searcher.temperature, recorded on each row as `logp_temperature`; training refuses rows
under another temperature, by name) and A-LoL's
advantage A = R − V(x), with V a small head on the frozen reference's prompt hidden states
(hpc_tba.losses.value). Departure from A-LoL: V is fitted to the file's own rewards, not to rewards
of fresh π_ref samples on a validation split (there is no scorer for an offline file).

Prompts are formatted by the task (chat template, tasks/chat.py) in both passes, so the log-probs
are of exactly the token ids the learner trains on. Training then reads
`<name>.preprocessed.jsonl` if it exists (else the file itself), groups rows by prompt, and adds
each prompt's rows to the shard that owns it. Sequence-level log-probs go on the
first response token (zeros elsewhere), so the losses' per-token sums see exactly the stored value.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from hpc_tba.comm.messages import TrajectoryBatch
from hpc_tba.roles.policy import pack, response_logprobs


def encode(tok, prompt: str, response: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids as the learner trains on them: the (formatted) prompt as `tok` encodes it (BOS
    per tokenizer), response then EOS."""
    p = tok(prompt)["input_ids"]
    r = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return np.asarray(p, np.int32), np.asarray(r, np.int32)


def sequence_logprobs(model, tok, prompts: Sequence[str], responses: Sequence[str], *,
                      temperature: float = 1.0) -> list[float]:
    """log π(y|x) summed over response tokens (EOS included), from logits / temperature."""
    pairs = [encode(tok, p, r) for p, r in zip(prompts, responses)]
    # Right padding under an attention mask: the pad id never reaches a real position.
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    packed = pack([p for p, _ in pairs], [r for _, r in pairs], pad_id=pad)
    with torch.no_grad():
        logp = response_logprobs(model, packed, temperature=temperature)
    return logp.sum(-1).tolist()


def prompt_hidden(model, tok, prompts: Sequence[str]) -> torch.Tensor:
    """[N, H] last-layer hidden state at each prompt's last token (the value head's input)."""
    from hpc_tba.losses.value import pool_prompt_hidden

    enc = [tok(p)["input_ids"] for p in prompts]
    width = max(len(e) for e in enc)
    ids = torch.zeros((len(enc), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, : len(e)], mask[i, : len(e)] = torch.tensor(e), 1
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return pool_prompt_hidden(out.hidden_states[-1], mask, mode="last")


def preprocess_file(path: str, model_path: str, *, temperature: float, task_cfg=None,
                    batch_size: int = 64) -> str:
    """Write `<name>.preprocessed.jsonl` with logp_behavior, logp_ref (under logits /
    temperature, recorded as logp_temperature) and advantage filled in. `task_cfg` formats the
    prompts as training will (its chat template); None: prompts as written."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_tba.losses.value import fit_value_head
    from hpc_tba.models.construction import building
    from hpc_tba.tasks import build_task
    from hpc_tba.tasks.offline import preprocess, read_offline

    tok = AutoTokenizer.from_pretrained(model_path)
    with building():  # hpc_tba.models.construction: one model built at a time per process
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    fmt = _formatter(build_task(task_cfg, tokenizer=tok)) if task_cfg is not None else (lambda t: t)
    columns = task_cfg.columns if task_cfg is not None else {}
    rows = read_offline(path, columns)
    prompts = list(dict.fromkeys(r.prompt for r in rows))
    hidden = torch.cat([prompt_hidden(model, tok, [fmt(p) for p in prompts[i:i + batch_size]])
                        for i in range(0, len(prompts), batch_size)])
    index = {p: i for i, p in enumerate(prompts)}
    head, _ = fit_value_head(hidden[[index[r.prompt] for r in rows]],
                          torch.tensor([r.reward for r in rows], dtype=torch.float32))

    def value_fn(ps: Sequence[str]) -> list[float]:
        with torch.no_grad():
            return head(hidden[[index[p] for p in ps]]).tolist()

    def logp_fn(ps: Sequence[str], rs: Sequence[str]) -> list[float]:
        return sequence_logprobs(model, tok, [fmt(p) for p in ps], rs, temperature=temperature)

    return str(preprocess(path, behavior_fn=logp_fn, ref_fn=logp_fn, value_fn=value_fn,
                          batch_size=batch_size, temperature=temperature, columns=columns))


def _formatter(task):
    return task.formatter if task.formatter is not None else (lambda t: t)


def required_fields(algo) -> list[str]:
    """Fields every row of an offline file must carry for this objective, as its registration
    declares (hpc_tba.losses.registry): `logp_behavior` when its loss reads log μ (the learner
    cannot recompute the behaviour policy of someone else's data), `advantage` when it needs
    precomputed advantages. π_ref's log-probs the learner computes itself."""
    from hpc_tba.losses.registry import needs

    n = needs(algo)
    return ["logp_behavior"] * n.behavior_logp + ["advantage"] * n.advantages


def fill_shard(shard, task, tok, *, needs: Sequence[str], temperature: float) -> int:
    """Add the offline rows this shard owns; returns the number of responses accepted.

    Refuses (DataError, by file, line and field) rows whose stored log-probs are under another
    temperature than the learner's and rewards outside a declared task.reward_range."""
    from hpc_tba.tasks.offline import (
        check_reward_range,
        check_temperature,
        preprocessed_path,
        read_offline,
        require_fields,
    )

    source = task.cfg.path
    pre = preprocessed_path(source) if os.path.isfile(source) else None
    examples = (read_offline(pre, task.cfg.columns) if pre is not None and pre.exists()
                else task.examples("train"))
    require_fields(examples, *needs)
    # The learner uses the file's log μ only (it scores π_ref itself, at its own temperature).
    check_temperature(examples, temperature, fields=("logp_behavior",))
    if task.cfg.reward_range:
        check_reward_range(examples, *(float(v) for v in task.cfg.reward_range))
    fmt = _formatter(task)
    by_prompt: dict[str, list] = {}
    for ex in examples:
        by_prompt.setdefault(ex.prompt, []).append(ex)
    added = 0
    for pid, (prompt, rows) in enumerate(by_prompt.items()):
        if pid % shard.num_shards != shard.shard_id:
            continue
        enc = [encode(tok, fmt(prompt), r.response) for r in rows]
        lengths = np.array([len(r) for _, r in enc], np.int32)
        batch = TrajectoryBatch(
            prompt_id=pid, prompt_tokens=enc[0][0], response_tokens=np.concatenate([r for _, r in enc]),
            lengths=lengths, rewards=np.array([r.reward for r in rows], np.float32),
            logp_behavior=_at_first_token([r.logp_behavior for r in rows], lengths),
            policy_version=0, searcher_id=-1, timestamp=0.0)
        adv = None if any(r.advantage is None for r in rows) else np.array(
            [r.advantage for r in rows], np.float32)
        added += shard.add(batch, advantages=adv)
    return added


def _at_first_token(values: list[float | None], lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(int(lengths.sum()), np.float32)
    starts = np.cumsum(lengths) - lengths
    out[starts] = [0.0 if v is None else v for v in values]
    return out
