"""Build the role this rank plays from the run configuration (the only place that does)."""
from __future__ import annotations

import os

from hpc_tba.config import RunConfig
from hpc_tba.topology import Role, Topology


def transport_and_topology(cfg: RunConfig):
    from hpc_tba.comm.transport import MPITransport

    transport = MPITransport()
    topo = Topology.build(transport.size, cfg.cluster.num_learners, cfg.cluster.num_searchers)
    return transport, topo, topo.role(transport.rank)


def _pin_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))


def role(cfg: RunConfig, transport, topo: Topology, role: Role):
    from hpc_tba.comm.groups import setup_groups
    from hpc_tba.models.tiny import resolve_model_path
    from hpc_tba.tasks import build_task

    _pin_threads(cfg.cluster.threads_per_rank)
    model_path = resolve_model_path(cfg.model, cfg.task)
    groups = setup_groups(transport, topo, backend=cfg.cluster.dist_backend)
    if role is Role.LEARNER:
        return _learner(cfg, transport, topo, groups, model_path)
    return _searcher(cfg, transport, topo, groups, model_path, build_task(cfg.task))


def _learner(cfg: RunConfig, transport, topo: Topology, groups, model_path: str):
    from hpc_tba.buffer import BufferShard
    from hpc_tba.roles.learner import Learner

    lrank = topo.learner_ranks.index(transport.rank)
    shard = BufferShard(cfg.buffer, shard_id=lrank, num_shards=topo.num_learners,
                        directory=os.path.join(cfg.run_dir, "buffer"), seed=cfg.learner.seed)
    learner = Learner(cfg=cfg.learner, loss=cfg.algo, shard=shard, k=cfg.searcher.k,
                      temperature=cfg.searcher.temperature, model_path=model_path,
                      transport=transport, topo=topo, sync_group=groups.sync_group,
                      run_dir=cfg.run_dir)
    transport.bcast_json(learner.manifest.to_json() if transport.rank == 0 else None)
    return learner


def _searcher(cfg: RunConfig, transport, topo: Topology, groups, model_path: str, task):
    from hpc_tba.comm.weight_sync import Manifest, WeightReceiver
    from hpc_tba.engine.vllm_engine import VLLMEngine, configure_cpu_env
    from hpc_tba.roles.searcher import Searcher

    index = topo.searcher_index(transport.rank)
    device = "cuda" if groups.backend == "nccl" else "cpu"
    if device == "cpu":
        configure_cpu_env(core=None, kv_cache_mb=cfg.searcher.kv_cache_mb)
    engine = VLLMEngine(model_path, cfg.searcher, seed=cfg.searcher.seed + index, device=device)
    manifest = Manifest.from_json(transport.bcast_json(None))
    receiver = WeightReceiver(manifest, groups.sync_group, device=device)
    return Searcher(cfg=cfg.searcher, task=task, engine=engine, receiver=receiver,
                    transport=transport, topo=topo, index=index, run_dir=cfg.run_dir)
