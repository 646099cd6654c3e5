"""The learner role: DeepSpeed ZeRO-3 training on samples from this rank's replay-buffer shard.

Loop (one screen, `run`): take whatever trajectories have arrived (never waiting for a given
searcher), sample G prompts x K responses from the local shard, compute log-probs of the current
policy and the frozen reference from logits / T, the configured loss, and one ZeRO-3 step; every
k steps gather the weights bucket by bucket and broadcast them to the searchers (version = the
learner step). Learner rank 0 also collects the searchers' held-out evaluations and ends the run
with a STOP / DONE handshake that drains every trajectory still in flight.

`learner.mode=sync` is the on-policy baseline on the same machinery: instead of sampling the
buffer, each step waits for the G prompts the searchers generated with the current weights and
trains on exactly those (K responses each, as generated), then syncs; the searchers generate the
next batch only once those weights arrive. Everything else (loss, sync, logging) is shared, so
sync vs async differs in scheduling only. With sequence or tensor parallelism a replica's peers
(roles.parallel, roles.tensor_parallel) train on their leader's batch in lockstep; the engines are
built in roles.engines, the update itself (`train_step`: sample, loss, one guarded optimizer step)
in roles.train_step. Every step logs where the time went (`util/train`, `util/sync`, `util/wait`,
`util/receive`, `util/checkpoint`; roles.logging.Timers).
"""
from __future__ import annotations

import math
import os
import time

import numpy as np
import torch

from hpc_tba.buffer import BufferShard
from hpc_tba.checkpoint import store as checkpoint
from hpc_tba.checkpoint.staging import Checkpointer
from hpc_tba.comm.messages import Done, EvalReport, ProbeReport, SampledBatch, Stop, TrajectoryBatch
from hpc_tba.comm.metrics import reduce_metrics
from hpc_tba.comm.transport import Transport
from hpc_tba.comm.weight_sync import FLAG_EVAL, GROUP_TIMEOUT_S, Manifest, WeightSender
from hpc_tba.config import AlgoConfig, LearnerConfig
from hpc_tba.config.topology import Topology
from hpc_tba.roles import parallel, tensor_parallel
from hpc_tba.roles.ds_config import deepspeed_config
from hpc_tba.roles.engines import build_engines
from hpc_tba.roles.fresh import FreshRewards
from hpc_tba.roles.logging import RunLogger, Timers, device_used_gib, peak_memory_gib
from hpc_tba.roles.policy import pack, response_logprobs
from hpc_tba.roles.train_step import TrainStepMixin

__all__ = ["Learner", "deepspeed_config", "role_device"]  # deepspeed_config: its old home, still imported

POLL_S = 0.02


def role_device(engine) -> torch.device:
    """The device DeepSpeed's accelerator gave this rank (cuda:<local rank>, or cpu): the one
    place the learner asks; every tensor it makes is created there."""
    return torch.device(engine.device)


class Learner(TrainStepMixin):  # train_step and its helpers: roles.train_step
    staging_dir: str | None = None  # node-local dir of staged saves (set by assembly.build)
    checkpointer: Checkpointer | None = None

    def __init__(self, *, cfg: LearnerConfig, loss: AlgoConfig, shard: BufferShard, k: int,
                 temperature: float, model_path: str, transport: Transport, topo: Topology,
                 sync_group, run_dir: str, preemption=None, resume_from: str | None = None):
        self.cfg, self.loss_cfg, self.shard = cfg, loss, shard
        self.k, self.temperature = k, temperature
        self.transport, self.topo = transport, topo
        self.is_main = transport.rank == 0
        self.lrank = topo.learner_ranks.index(transport.rank)
        self.run_dir, self.model_path = run_dir, model_path
        self.preemption = preemption  # a flag set by SIGUSR1/SIGTERM (launcher.slurm)
        self.resume_from = resume_from  # the checkpoint `resume` loads next (assembly.build)
        self.preempted = False
        self._last_ckpt = (0, time.time())
        self.nonfinite_skipped, self._nonfinite_in_row = 0, 0
        self._nan_faults = {int(x) for x in os.environ.get("HPC_TBA_FAULT_NAN_STEPS", "").split(",") if x}
        self.step = 0
        self.version = 0
        torch.manual_seed(cfg.seed)
        self.micro = cfg.micro_batch_size or k
        self.sp = parallel.build(cfg.sequence_parallel_size, topo.num_learners, self.lrank,
                                 timeout_s=GROUP_TIMEOUT_S)  # before the models: they use its group
        self.tp = tensor_parallel.build(cfg.tensor_parallel_size, topo.num_learners, self.lrank,
                                        timeout_s=GROUP_TIMEOUT_S)
        self.peers = self.tp if self.tp.enabled else self.sp  # the replica's ranks: one batch, lockstep
        # ranks DeepSpeed averages gradients over, as the loss sees them (roles.tensor_parallel)
        self.grad_ranks = tensor_parallel.grad_ranks(topo.num_learners, self.tp.size)
        self.engine, self.ref, self.pad_id = build_engines(
            cfg, loss, model_path, micro=self.micro, lrank=self.lrank, sp=self.sp, tp=self.tp,
            resume_from=resume_from)
        self.device = role_device(self.engine)
        self.config_yaml = ""
        self.manifest = Manifest.build(  # whole shapes: a TP learner sends what a TP=1 one does
            [(n, tensor_parallel.full_shape(p)) for n, p in self.engine.module.named_parameters()],
            bucket_bytes=int(cfg.sync_bucket_mb * 2**20), wire_dtype=cfg.sync_wire_dtype)
        sender = tensor_parallel.TPWeightSender if self.tp.enabled else WeightSender
        self.sender = sender(self.engine.module, self.manifest, sync_group, device=self.device,
                             versions_held=cfg.sync_versions_held)
        self.log = RunLogger(run_dir, "learner", enabled=self.is_main, total=cfg.total_steps)
        self.received: dict[int, int] = {}  # searcher rank -> trajectories received
        self.done: dict[int, int] = {}  # searcher rank -> trajectories it says it sent here
        self.evals: dict[int, list[float]] = {}  # version -> [correct, total, reports]
        self.pass_at_1: dict[int, float] = {}
        self.probe: tuple[list[int], list[int]] | None = None  # (prompt, response) token ids
        self._probe_logp: dict[int, np.ndarray] = {}
        self.sync_gaps: dict[int, dict[int, float]] = {}  # searcher rank -> version -> max gap
        self.samples = {"received": 0, "trained": 0}  # cumulative responses, this rank
        self._incoming = {"rewards": [], "received": 0, "t": time.time()}  # since the last step
        self.fresh = FreshRewards()  # reward of received samples per generating version
        self.on_policy: list[TrajectoryBatch] = []  # mode=sync: batches of the current version
        self.timers = Timers()
        self.version_time: dict[int, float] = {}  # version -> seconds into training it was sent

    # ------------------------------------------------------------------ loop
    def run(self) -> dict:
        self.transport.barrier()  # every rank has built its role: all clocks start together
        self.timers = Timers()
        t = self.timers
        self.version_time.setdefault(self.version, 0.0)
        if self.step > 0:  # resumed: the engines start from the model files, send them ours
            with t("sync"):
                self.sync(evaluate=False)
        if self.cfg.mode == "async":
            with t("wait"):
                self.wait_for_warm_start()
        while self.step < self.cfg.total_steps:
            if self.cfg.mode == "sync":
                with t("wait"):
                    batch = self.wait_on_policy()
            else:
                with t("receive"):
                    self.receive()
                batch = None
            with t("train"):
                metrics = self.train_step(batch)
            self.step += 1
            last = self.step == self.cfg.total_steps
            if self.step % self.cfg.sync_every == 0 or last:
                with t("sync"):
                    metrics.update(self.sync(evaluate=last or self._eval_due()))
            if self.step % self.cfg.log_every == 0 or last:
                metrics.update(t.metrics())
                metrics.update(self.fresh.closing(self.version, self.cfg.sync_every))
                metrics["samples/fresh_late"] = float(self.fresh.late)
                reduced = self._reduce(metrics, sum_prefix=("loss/", "samples/", "fresh/"))
                reduced |= self._reduce({"memory/peak_gib": peak_memory_gib(self.device),
                                         "memory/device_used_gib": device_used_gib(self.device)}, op="max")
                self.log.scalars(self.step, self._log_fresh(reduced))
                self.log.progress(self.step, self._postfix(metrics))
            self.preempted, due = self._step_flags()
            if self.preempted or last or due:
                with t("checkpoint"):
                    self.save_checkpoint()
            if self.preempted:
                break
        return self.finish()

    # ------------------------------------------------------------------ checkpoints
    def _step_flags(self) -> tuple[bool, bool]:
        """(a preemption signal reached some learner rank, a checkpoint is due on some rank),
        agreed by every learner rank in one all-reduce, since all must checkpoint together; the
        same all-reduce says whether a staged save's copy is done on every rank, then commits it."""
        every, interval = self.cfg.checkpoint_every, self.cfg.checkpoint_interval_s
        due = (every > 0 and self.step % every == 0) or (
            interval > 0 and time.time() - self._last_ckpt[1] >= interval)
        signal = self.preemption is not None and self.preemption.is_set()
        ckpt = self._checkpointer()
        flags = self._reduce({"signal": float(signal), "due": float(due), "copying": float(ckpt.copying())},
                             op="sum")
        ckpt.agreed(copying_anywhere=flags["copying"] > 0)
        return flags["signal"] > 0, flags["due"] > 0

    def save_checkpoint(self) -> str:
        """Checkpoint now; staged (checkpoint_staging) when `staging_dir` is set, except the run's
        final save (USR1, the last step), which is written directly."""
        t0 = time.time()
        self.shard.flush()
        state = {"step": self.step, "version": self.version, "config": self.config_yaml,
                 "pass@1": {str(k): v for k, v in self.pass_at_1.items()}}
        path = self._checkpointer().save(step=self.step, shard_state=self.shard.state_dict(),
                                         learner_state=state,
                                         final=self.preempted or self.step >= self.cfg.total_steps)
        self._last_ckpt = (self.step, time.time())
        self.log.scalars(self.step, {"checkpoint/time_s": time.time() - t0})
        return path

    def _checkpointer(self) -> Checkpointer:
        self.checkpointer = self.checkpointer or Checkpointer(
            self.engine, run_dir=self.run_dir, learner_rank=self.lrank, keep_last=self.cfg.keep_last,
            staging=self.staging_dir, on_commit=lambda step, wait_s: self.log.scalars(
                self.step, {"checkpoint/committed_step": step, "checkpoint/commit_wait_s": wait_s}))
        return self.checkpointer

    def resume(self, path: str) -> None:
        """Continue from a checkpoint: weights, optimizer, scheduler, RNG, step, buffer RNG."""
        self.sender.before_update()
        learner_state, shard_state = checkpoint.load(self.engine, path, learner_rank=self.lrank)
        self.shard.load_state_dict(shard_state)
        self.step = self.version = int(learner_state["step"])
        self.pass_at_1 = {int(k): v for k, v in learner_state.get("pass@1", {}).items()}
        self._last_ckpt = (self.step, time.time())
        self.log.scalars(self.step, {"checkpoint/resumed_step": self.step})

    def wait_for_warm_start(self) -> None:
        """Fill every shard to the warm-start threshold before the first step (ALGORITHMS.md §1)."""
        t0 = time.time()
        if self.topo.num_searchers == 0 and self.peers.is_leader and not self.shard.ready():
            raise RuntimeError(f"offline data gave shard {self.lrank} only {len(self.shard)} "
                               f"responses, below buffer.warm_start={self.shard.cfg.warm_start}")
        while True:
            self.receive()
            ready = self._reduce({"ready": float(self.shard.ready() or not self.peers.is_leader)}, op="min")["ready"]
            if ready:
                break
            time.sleep(POLL_S)
        self.log.scalars(0, {"perf/warm_start_s": time.time() - t0, **self.shard.metrics()})

    def receive(self) -> int:
        """Take every trajectory that has arrived into the shard; never blocks."""
        n = 0
        for src, batch in self.transport.receive(TrajectoryBatch):
            self.shard.add(batch)
            if self.cfg.mode == "sync" and batch.policy_version == self.version:
                self.on_policy.append(batch)
            self.received[src] = self.received.get(src, 0) + 1
            self._incoming["rewards"].append(float(batch.rewards.mean()))
            self.fresh.add(batch)
            self.samples["received"] += batch.num_responses
            n += 1
        for src, done in self.transport.receive(Done):
            self.done[src] = done.sent
        if self.is_main:
            for _, report in self.transport.receive(EvalReport):
                self._on_eval(report)
            for src, probe in self.transport.receive(ProbeReport):
                self._on_probe(src, probe)
        return n

    def wait_on_policy(self) -> SampledBatch | None:
        """mode=sync: wait until every shard holds G prompts generated by the current weights;
        return this shard's G prompts, K responses each, exactly as generated (None on an SP
        follower: its leader shares the batch in train_step; the same for a TP follower)."""
        g = self.cfg.prompts_per_step
        while True:
            self.receive()
            ready = len(self.on_policy) >= g or not self.peers.is_leader
            if self._reduce({"ready": float(ready)}, op="min")["ready"]:
                break
            time.sleep(POLL_S)
        batches, self.on_policy = self.on_policy[:g], []
        return SampledBatch.from_trajectories(batches, self.k) if self.peers.is_leader else None

    def _reduce(self, metrics: dict[str, float], **kw) -> dict[str, float]:
        """reduce_metrics over the learners, the tensor on this rank's device."""
        return reduce_metrics(metrics, device=self.device, **kw)

    def sync(self, *, evaluate: bool) -> dict[str, float]:
        t0 = time.time()
        self.version = self.step
        if self.topo.num_searchers == 0:  # offline: nobody to send weights to
            return {}
        if self.probe is not None:
            self._probe_logp[self.version] = self.probe_logprobs()
        sent = self.sender.send(self.version, flags=FLAG_EVAL if evaluate else 0)
        self.version_time[self.version] = self.timers.elapsed()
        self.shard.mark_sync(self.version)
        dt = time.time() - t0
        feeds = self.sender.feed_metrics()  # rank 0 only: out-of-process engines' own transfers
        if feeds:
            self.log.scalars(self.step, feeds)
        return {"sync/time_s": dt, "sync/bytes": float(sent), "sync/version": float(self.version)}

    def probe_logprobs(self) -> np.ndarray:
        """Per-token log-probs (T = 1) of the probe response under the current weights.

        A ZeRO-3 forward: every learner rank runs it (the parameters are gathered collectively).
        """
        prompt, response = self.probe
        packed = pack([np.asarray(prompt)], [np.asarray(response)], pad_id=self.pad_id, device=self.device)
        with torch.no_grad():
            logp = response_logprobs(self.engine, packed, temperature=1.0,
                                     chunk_tokens=self.cfg.logprob_chunk_tokens, sp=self.sp)
        return logp[0, : len(response)].double().cpu().numpy()

    def _on_probe(self, src: int, probe: ProbeReport) -> None:
        version, engine_logp = probe.policy_version, probe.logp
        mine = self._probe_logp.get(version)
        if mine is None:
            return
        gap = float(np.abs(mine - engine_logp).max())
        self.sync_gaps.setdefault(src, {})[version] = gap
        self.log.scalars(version, {f"sync/logprob_gap_searcher{src}": gap, "sync/logprob_gap": gap})

    def _eval_due(self) -> bool:
        e = self.cfg.eval_every
        return e > 0 and self.step % e < self.cfg.sync_every

    # ------------------------------------------------------------------ metrics
    def _incoming_metrics(self) -> dict[str, float]:
        inc, now, received = self._incoming, time.time(), self.samples["received"]
        out = {"perf/gen_samples_per_s": (received - inc["received"]) / max(now - inc["t"], 1e-9)}
        out["reward/incoming_mean"] = float(np.mean(inc["rewards"])) if inc["rewards"] else math.nan
        self._incoming = {"rewards": [], "received": received, "t": now}
        return out

    def _log_fresh(self, reduced: dict[str, float]) -> dict[str, float]:
        """Log each closed version's `reward/fresh_by_version` at step v (hpc_tba.roles.fresh);
        returns the other metrics."""
        by_version, rest = self.fresh.split(reduced)
        for v, m in by_version.items():
            self.log.scalars(v, m)
        return rest

    def _on_eval(self, report: EvalReport) -> None:
        version, correct, total = report.policy_version, float(report.correct), float(report.total)
        acc = self.evals.setdefault(version, [0.0, 0.0, 0])
        acc[0] += correct
        acc[1] += total
        acc[2] += 1
        if acc[2] == self.topo.num_searchers:
            self.pass_at_1[version] = acc[0] / max(acc[1], 1.0)
            self.log.scalars(version, {"test/pass@1": self.pass_at_1[version],
                                       "test/at_time_s": self.version_time.get(version, 0.0)})

    def _postfix(self, m: dict[str, float]) -> dict[str, str]:
        # (an SP follower's buffer/size is NaN: it holds no shard)
        out = {"reward": f"{m.get('reward/sampled_mean', 0):.2f}", "buf": f"{m.get('buffer/size', 0):.0f}"}
        if self.pass_at_1:
            out["pass@1"] = f"{self.pass_at_1[max(self.pass_at_1)]:.2f}"
        return out

    # ------------------------------------------------------------------ end
    def finish(self, *, eval_timeout_s: float = 900.0) -> dict:
        """Wait for the final evaluation, stop the searchers, drain what they sent, report."""
        if self.is_main and self.topo.num_searchers:
            deadline = time.time() + (0 if self.preempted else eval_timeout_s)
            while self.version not in self.pass_at_1 and time.time() < deadline:
                self.receive()
                time.sleep(POLL_S)
            for r in self.topo.searcher_ranks:
                self.transport.send(r, Stop(self.version))
        searchers = set(self.topo.searcher_ranks)
        while set(self.done) != searchers or any(self.received.get(r, 0) < self.done[r] for r in searchers):
            self.receive()
            time.sleep(POLL_S)
        self._log_fresh(self._reduce(self.fresh.closing(self.version, self.cfg.sync_every, final=True), op="sum"))
        self.sender.stop()
        self.shard.flush()
        if self.cfg.export_final and not self.preempted and self.model_path is not None:
            checkpoint.export_hf(self.engine, f"{self.run_dir}/final_model",
                                 tokenizer_src=self.model_path, learner_rank=self.lrank)
        return self.summary()

    def summary(self) -> dict:
        """The run's summary; every learner rank calls it (one reduce makes the run totals)."""
        versions = sorted(self.pass_at_1)
        totals = reduce_metrics({"rx": float(sum(self.received.values())), "buf": float(len(self.shard))}, op="sum")
        signum = getattr(self.preemption, "signum", None) if self.preempted else None
        s = {"steps": self.step, "final_version": self.version, "preempted": self.preempted,
             "nonfinite_skipped": self.nonfinite_skipped,
             "signal": signum,
             "trajectories_received": {str(r): n for r, n in sorted(self.received.items())},
             "buffer_size": len(self.shard),  # this shard; the run's totals below
             "trajectories_received_total": int(totals["rx"]), "buffer_size_total": int(totals["buf"]),
             "pass@1": {str(v): self.pass_at_1[v] for v in versions},
             "pass@1_before": self.pass_at_1.get(0), "pass@1_after": self.pass_at_1.get(self.version),
             "pass@1_time_s": {str(v): self.version_time[v] for v in versions if v in self.version_time},
             "mode": self.cfg.mode, "time": self.timers.metrics(),
             "sync_logprob_gap": {str(r): {str(v): g for v, g in sorted(d.items())}
                                  for r, d in sorted(self.sync_gaps.items())}}
        if self.is_main:
            self.log.write_json("summary.json", s)
        return s

    def close(self) -> None:
        self.log.close()
        self.shard.close()
