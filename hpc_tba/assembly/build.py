"""Build the role a rank plays from the run configuration (the only place that does).

`build_role(cfg, rank)` takes the set-up rank (assembly/rank.py) and returns its Learner or
Searcher: the process groups, the model path, the task, the buffer shard (learner), the engine,
its factory for restarts and the weight receiver (searcher).
"""
from __future__ import annotations

import dataclasses
import os

from hpc_tba.assembly.rank import RankSetup
from hpc_tba.config import RunConfig
from hpc_tba.config.topology import Role, Topology


def build_role(cfg: RunConfig, rank: RankSetup):
    """The Learner or Searcher of this rank, built and ready to `run()`."""
    from hpc_tba.assembly.engines import engine_device
    from hpc_tba.comm.groups import setup_groups
    from hpc_tba.tasks import build_task
    from hpc_tba.tasks.embedded import resolve_model_path

    transport, topo = rank.transport, rank.topology
    model_path = resolve_model_path(cfg.model, cfg.task)
    groups = setup_groups(transport, topo, backend=cfg.cluster.dist_backend)
    if rank.role is Role.LEARNER:
        return build_learner(cfg, transport, topo, groups, model_path, rank.preemption)
    task = build_task(cfg.task, tokenizer=model_path, device=engine_device(cfg))
    return build_searcher(cfg, transport, topo, groups, model_path, task)


def build_learner(cfg: RunConfig, transport, topo: Topology, groups, model_path: str, preemption):
    """The learner of this rank: its buffer shard, DeepSpeed engine, resumed state, the set-up
    broadcast to the searchers (manifest, probe, resumed step)."""
    from hpc_tba.buffer import BufferShard
    from hpc_tba.checkpoint.staging import staging_dir
    from hpc_tba.checkpoint.store import resolve_resume
    from hpc_tba.config import resolve_wire_dtype, to_yaml
    from hpc_tba.roles.learner import Learner

    learner_cfg = dataclasses.replace(cfg.learner, sync_wire_dtype=resolve_wire_dtype(cfg.learner, cfg.searcher))
    # Shards follow the data-parallel replica; an SP follower's stays empty and unlogged (its
    # leader hands it every step's batch, roles/parallel.py).
    owner = topo.sp_rank(transport.rank) == 0
    shard = BufferShard(cfg.buffer, shard_id=topo.dp_rank(transport.rank), num_shards=topo.dp_size,
                        directory=os.path.join(cfg.run_dir, "buffer") if owner else None,
                        seed=cfg.learner.seed)
    resume_from = resolve_resume(cfg.run_dir, cfg.resume)
    learner = Learner(cfg=learner_cfg, loss=cfg.algo, shard=shard, k=cfg.searcher.k,
                      temperature=cfg.searcher.temperature, model_path=model_path,
                      transport=transport, topo=topo, sync_group=groups.sync_group,
                      run_dir=cfg.run_dir, preemption=preemption, resume_from=resume_from)
    learner.config_yaml = to_yaml(cfg)
    if cfg.cluster.checkpoint_staging_dir:
        learner.staging_dir = staging_dir(cfg.cluster.checkpoint_staging_dir, cfg.run_dir)
    if cfg.task.name == "offline" and owner:
        _fill_offline(cfg, shard, model_path)
    if resume_from is not None:
        learner.resume(resume_from)
    probe = _probe(cfg, model_path) if cfg.learner.sync_check else None
    learner.probe = probe
    transport.bcast_json({"manifest": learner.manifest.to_json(), "probe": probe,
                          "resumed_step": learner.step} if transport.rank == 0 else None)
    return learner


def _fill_offline(cfg: RunConfig, shard, model_path: str) -> None:
    from transformers import AutoTokenizer

    from hpc_tba.roles.offline import fill_shard, required_fields
    from hpc_tba.tasks import build_task

    fill_shard(shard, build_task(cfg.task, tokenizer=model_path), AutoTokenizer.from_pretrained(model_path),
               needs=required_fields(cfg.algo), temperature=cfg.searcher.temperature)


def _probe(cfg: RunConfig, model_path: str) -> tuple[list[int], list[int]]:
    """A fixed (prompt, response) whose log-probs both sides compute after each sync."""
    from transformers import AutoTokenizer

    from hpc_tba.tasks import build_task

    tok = AutoTokenizer.from_pretrained(model_path)
    p = build_task(cfg.task, tokenizer=tok).prompts("train")[0]
    response = tok(p.answer or p.text, add_special_tokens=False)["input_ids"]
    return tok(p.text)["input_ids"], response + [tok.eos_token_id]


def build_searcher(cfg: RunConfig, transport, topo: Topology, groups, model_path: str, task):
    """The searcher of this rank: its engine (and factory for restarts), receiver and slice."""
    from hpc_tba.assembly.engines import build_engine, engine_device
    from hpc_tba.comm.weight_sync import Manifest, WeightReceiver, resolve_staging
    from hpc_tba.roles.searcher import Searcher

    index = topo.searcher_index(transport.rank)
    device = engine_device(cfg)
    warm_prompt = task.prompts("train")[0].text

    def engine_factory():
        return build_engine(cfg, model_path, seed=cfg.searcher.seed + index, device=device,
                            warm_prompt=warm_prompt)

    engine = engine_factory()
    setup = transport.bcast_json(None)
    manifest = Manifest.from_json(setup["manifest"])  # staging resolved once the engine holds its memory
    receiver = WeightReceiver(manifest, groups.sync_group, device=device,
                              staging=resolve_staging(cfg.searcher.staging, device, manifest,
                                                       update=cfg.searcher.update))
    quota = None
    if cfg.learner.mode == "sync":  # one on-policy batch per version: G prompts for every shard
        quota = topo.on_policy_quota(index, cfg.learner.prompts_per_step)
    searcher = Searcher(cfg=cfg.searcher, task=task, engine=engine, receiver=receiver,
                        transport=transport, topo=topo, index=index, run_dir=cfg.run_dir,
                        engine_factory=engine_factory, on_policy_quota=quota)
    searcher.probe = setup["probe"]
    searcher.resumed = setup["resumed_step"] > 0
    return searcher
