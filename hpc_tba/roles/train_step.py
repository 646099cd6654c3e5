"""One learner update (`TrainStepMixin`, mixed into roles.learner.Learner): the step's batch in,
one guarded ZeRO-3 optimizer step and its metrics out.

`train_step` takes the mode=sync batch or (async) samples G prompts x K responses from the shard,
shares it with the replica's SP/TP peers (roles.parallel, roles.tensor_parallel), packs it
(roles.policy), computes the reference's and the policy's log-probs from logits / T and the
configured loss in micro-batches with gradient accumulation (roles.microbatch), and takes one
optimizer step unless the loss is NaN/inf on some rank (`_skip_if_nonfinite`; the
HPC_TBA_FAULT_NAN_STEPS test hook is `_fault`). Advantages are the stored ones (offline) or
R - group mean (online). The metrics include the learner-vs-engine log-prob mismatch on rows made
by the current weights (`_mismatch`).

The mixin holds no state of its own: it uses the Learner's engines (`engine`, `ref`, `pad_id`,
`device`), `cfg`, `loss_cfg`, `shard`, `peers`, `sp`, `sender`, `log`, `k`, `temperature`,
`micro`, `grad_ranks`, `step`, `version`, `samples`, the non-finite counters
(`nonfinite_skipped`, `_nonfinite_in_row`, `_nan_faults`) and its `_reduce` and
`_incoming_metrics`.
"""
from __future__ import annotations

import math
import sys
import time

import numpy as np
import torch

from hpc_tba.buffer import staleness_lags
from hpc_tba.comm.messages import SampledBatch
from hpc_tba.comm.metrics import reduce_metrics
from hpc_tba.losses import LossInputs, loss_units, needs
from hpc_tba.roles import microbatch, parallel
from hpc_tba.roles.policy import PackedBatch, pack, pad_per_token, response_logprobs

__all__ = ["TrainStepMixin"]


class TrainStepMixin:
    """The Learner's update step and its helpers (see the module docstring for what it uses)."""
    def train_step(self, batch: SampledBatch | None = None) -> dict[str, float]:
        """One update on `batch`, or (async) on G x K samples drawn from the buffer shard.

        The step's sequences go through the model in micro-batches of at most
        `learner.micro_batch_size` sequences (0: K), sorted by length, or of at most
        `learner.micro_batch_tokens` tokens packed into one row each, with gradient
        accumulation and one optimizer step; the update equals the one-batch update for every
        loss (hpc_tba.roles.microbatch states the rule for group statistics).
        """
        t0 = time.time()
        dev = self.device
        if batch is None and self.peers.is_leader:
            batch = self.shard.sample(self.cfg.prompts_per_step, self.k, learner_version=self.step)
        batch = self.peers.share_batch(batch, dev)  # SP/TP peers train on their leader's batch
        budget = self.cfg.micro_batch_tokens  # 0: rows of micro_batch_size; else packed bins
        packed = pack(batch.prompt_tokens, batch.response_tokens, pad_id=self.pad_id, device=dev,
                      packing=bool(budget))
        lengths = np.array([len(p) + len(r) for p, r in zip(batch.prompt_tokens, batch.response_tokens)])
        plan = microbatch.plan_tokens(lengths, batch.group_ids, budget) if budget else \
            microbatch.plan(lengths, batch.group_ids, self.micro)
        plan = microbatch.agree(plan, lambda m: self._reduce(m, op="max"))
        rewards = torch.as_tensor(batch.rewards, device=dev)
        groups = torch.as_tensor(batch.group_ids, device=dev)
        zeros = torch.zeros(packed.response_mask.shape, dtype=torch.float32, device=dev)
        inputs = LossInputs(
            logp=zeros, logp_ref=None if self.ref is None else microbatch.no_grad_logprobs(
                lambda b: self._logprobs(self.ref, b), packed, plan),
            logp_behavior=pad_per_token(batch.logp_behavior, packed.response_ids),
            mask=packed.response_mask, rewards=rewards, group_ids=groups,
            advantages=self._advantages(batch, rewards, groups))
        # DeepSpeed averages gradients over ranks: normaliser = global units / those ranks (all L;
        # L / TP under TP), the units counted once per data-parallel replica (SP or TP peers share
        # one batch: roles.parallel, roles.tensor_parallel).
        units = self.peers.dp_units(self._reduce({"units": float(loss_units(self.loss_cfg, inputs))},
                                                 op="sum")["units"])
        losses: list[torch.Tensor] = []  # checked once after the last backward: one reduce a step
        loss, lm, logp = microbatch.accumulate(
            self.loss_cfg, inputs, plan, step=self.step,
            normalizer=max(units, 1.0) / self.grad_ranks,
            logp_fn=lambda rows: self._logprobs(self.engine, packed.select(rows)),
            backward=self._backward, check=lambda x: losses.append(self._fault(x).detach()) is None)
        if self._skip_if_nonfinite(torch.stack(losses).sum()):  # non-finite somewhere: no update on any rank
            self.engine.optimizer.zero_grad()  # drop what the micro-batches accumulated
            lm = {}
        else:
            self.sender.before_update()  # engines' feeds may still read the parameters in place
            self.engine.step()
        dt = time.time() - t0
        names = list(lm)  # one device-to-host copy for every loss metric, not one each
        out = dict(zip(names, torch.stack([lm[k].double() for k in names]).tolist())) if names else {}
        out["train/nonfinite_skipped"] = float(self.nonfinite_skipped)
        out["train/micro_batches"] = float(len(plan.rows))
        out.update(self.shard.staleness(batch, self.step))
        out.update(self.shard.metrics())
        out.update(self._mismatch(batch, logp, inputs.logp_behavior, packed.response_mask))
        out.update(self._incoming_metrics())
        out["reward/sampled_mean"] = float(batch.rewards.mean())
        self.samples["trained"] += batch.size
        out.update({f"samples/{k}": float(v) for k, v in self.samples.items()})
        out["perf/step_s"] = dt
        out["perf/train_tokens_per_s"] = sum(len(r) for r in batch.response_tokens) / max(dt, 1e-9)
        out["train/lr"] = float(self.engine.get_lr()[0])
        if self.is_main:
            self.log.histogram(self.step, "buffer/staleness", staleness_lags(batch, self.step))
        return parallel.step_metrics(self.peers, out, dev)

    def _logprobs(self, model, packed: PackedBatch) -> torch.Tensor:
        """Chosen-token log-probs of `model` (the policy engine or the reference), chunked."""
        return response_logprobs(model, packed, temperature=self.temperature,
                                 chunk_tokens=self.cfg.logprob_chunk_tokens, sp=self.sp)

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        # Gradients accumulate over the step's micro-batches; the last one is the boundary.
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss)

    def _fault(self, loss: torch.Tensor) -> torch.Tensor:
        if self.step + 1 in self._nan_faults:  # test hook: HPC_TBA_FAULT_NAN_STEPS="5,6"
            return loss * float("nan")
        return loss

    def _skip_if_nonfinite(self, loss: torch.Tensor) -> bool:
        """Skip the update (on every learner rank together) when the loss is NaN/inf anywhere;
        give up after `learner.max_nonfinite_steps` in a row rather than train on garbage."""
        bad = reduce_metrics({"bad": float(not torch.isfinite(loss.detach()))}, op="sum",
                             device=loss.device)["bad"] > 0  # the loss is on the role's device
        if not bad:
            self._nonfinite_in_row = 0
            return False
        self.nonfinite_skipped += 1
        self._nonfinite_in_row += 1
        if self._nonfinite_in_row > self.cfg.max_nonfinite_steps:
            raise FloatingPointError(
                f"loss was NaN/inf for {self._nonfinite_in_row} steps in a row (up to step "
                f"{self.step + 1}); stopping. Lower learner.lr, check the rewards, or resume "
                "from the last checkpoint")
        print(f"hpc-tba: step {self.step + 1}: non-finite loss, update skipped", file=sys.stderr,
              flush=True)
        return True

    def _advantages(self, batch, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor | None:
        """Stored advantages (offline A-LoL), else, online, A = R − mean R of the prompt's group.

        Online there is no fitted value head: the group mean of the K sampled rewards stands in
        for V(x) (the same baseline GRPO/RLOO use); offline data carries A = R − V(x) from
        hpc_tba.losses.value computed once by the preprocessing pass.
        """
        if batch.advantages is not None:
            return torch.as_tensor(batch.advantages, device=self.device)
        if not needs(self.loss_cfg).advantages:
            return None
        # the group count from the host batch: no device-to-host sync in the step
        return microbatch.group_advantages(rewards, groups, num_groups=int(batch.group_ids.max()) + 1)


    def _mismatch(self, batch, logp, logp_behavior, mask) -> dict[str, float]:
        """Learner vs engine log-prob of sampled tokens, on rows made by the current weights
        (NaN when there is none: the key set is the same on every rank, comm.metrics)."""
        rows = torch.as_tensor(batch.policy_versions == self.version, device=self.device)
        m = mask & rows[:, None]
        if not bool(m.any()):
            return {"sync/logprob_mismatch_mean": math.nan, "sync/logprob_mismatch_max": math.nan}
        gap = (logp - logp_behavior).abs()[m]
        return {"sync/logprob_mismatch_mean": float(gap.mean()),
                "sync/logprob_mismatch_max": float(gap.max())}
