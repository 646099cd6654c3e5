"""Build the role this rank plays from the run configuration (the only place that does)."""
from __future__ import annotations

import dataclasses
import os

from hpc_tba.config import RunConfig
from hpc_tba.topology import Role, Topology


def transport_and_topology(cfg: RunConfig):
    """MPI, the placement-aware layout, and (under Slurm) the placement check and GPU pinning."""
    from hpc_tba.comm.transport import MPITransport
    from hpc_tba.launcher.slurm import SlurmEnv, check_placement, cuda_visible_devices

    transport = MPITransport()
    topo = topology_for(cfg, transport.size)
    env = SlurmEnv.from_environ()
    check_placement(topo, transport.rank, env)
    if env is not None and cfg.cluster.gpus_per_node:  # before anything initialises CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(topo, transport.rank)
    return transport, topo, topo.role(transport.rank)


def topology_for(cfg: RunConfig, world_size: int) -> Topology:
    """The layout for this config; an offline task trains from a file with no searcher."""
    from hpc_tba.topology import LayoutError

    offline = cfg.task.name == "offline"
    if offline and cfg.cluster.num_searchers:
        raise LayoutError("task=offline trains from a file: set cluster.num_searchers=0")
    topo = Topology.from_cluster(cfg.cluster, tp_size=cfg.searcher.tensor_parallel_size,
                                 needs_searchers=not offline)
    if topo.world_size != world_size:
        raise LayoutError(f"impossible layout: the job has {world_size} ranks but "
                          f"{cfg.cluster.num_learners} learners + {cfg.cluster.num_searchers} "
                          f"searchers need {topo.world_size}")
    return topo


def _pin_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))


def cores_for_rank(rank: int, topo: Topology, ncpu: int) -> set[int]:
    """CPU cores a rank may run on when several ranks share one machine.

    Learners get cores of their own first (training is the heavier, latency-critical work: a
    learner sharing its core with a searcher ran ~6x slower per step here); searchers share the
    remaining cores round-robin, or every core when none is left.
    """
    if topo.role(rank) is Role.LEARNER:
        return {rank % ncpu}
    free = list(range(topo.num_learners, ncpu)) or list(range(ncpu))
    return {free[topo.searcher_index(rank) % len(free)]}


def _pin_cores(rank: int, topo: Topology) -> None:
    cpus = sorted(os.sched_getaffinity(0))  # the cores this job may use, whatever their numbers
    if 1 < len(cpus) <= topo.world_size * 4:  # a small shared machine, not a cluster node
        os.sched_setaffinity(0, {cpus[i] for i in cores_for_rank(rank, topo, len(cpus))})


def role(cfg: RunConfig, transport, topo: Topology, role: Role):
    import signal

    from hpc_tba.comm.groups import setup_groups
    from hpc_tba.launcher.slurm import install_preemption_handler, preemption_signals
    from hpc_tba.models.tiny import resolve_model_path
    from hpc_tba.tasks import build_task

    # Every rank takes the signals (an unhandled SIGUSR1 would kill a searcher); learners act on
    # them at the next step boundary: checkpoint together, stop the searchers, exit.
    preemption = install_preemption_handler((*preemption_signals(), signal.SIGTERM))

    _pin_threads(cfg.cluster.threads_per_rank)
    if cfg.cluster.backend == "local" and cfg.cluster.pin_cores:
        _pin_cores(transport.rank, topo)
    model_path = resolve_model_path(cfg.model, cfg.task)
    groups = setup_groups(transport, topo, backend=cfg.cluster.dist_backend)
    if role is Role.LEARNER:
        return _learner(cfg, transport, topo, groups, model_path, preemption)
    device = "cuda" if groups.backend == "nccl" else "cpu"  # the searcher's engine device
    return _searcher(cfg, transport, topo, groups, model_path,
                     build_task(cfg.task, tokenizer=model_path, device=device))


def _learner(cfg: RunConfig, transport, topo: Topology, groups, model_path: str, preemption):
    from hpc_tba.buffer import BufferShard
    from hpc_tba.checkpoint import resolve_resume
    from hpc_tba.config import resolve_wire_dtype, to_yaml
    from hpc_tba.roles.learner import Learner

    lrank = topo.learner_ranks.index(transport.rank)
    learner_cfg = dataclasses.replace(cfg.learner, sync_wire_dtype=resolve_wire_dtype(cfg.learner, cfg.searcher))
    shard = BufferShard(cfg.buffer, shard_id=lrank, num_shards=topo.num_learners,
                        directory=os.path.join(cfg.run_dir, "buffer"), seed=cfg.learner.seed)
    learner = Learner(cfg=learner_cfg, loss=cfg.algo, shard=shard, k=cfg.searcher.k,
                      temperature=cfg.searcher.temperature, model_path=model_path,
                      transport=transport, topo=topo, sync_group=groups.sync_group,
                      run_dir=cfg.run_dir, preemption=preemption)
    learner.config_yaml = to_yaml(cfg)
    if cfg.task.name == "offline":
        _fill_offline(cfg, shard, model_path)
    resume_from = resolve_resume(cfg.run_dir, cfg.resume)
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


def _searcher(cfg: RunConfig, transport, topo: Topology, groups, model_path: str, task):
    from hpc_tba.comm.weight_sync import Manifest, WeightReceiver, resolve_staging
    from hpc_tba.engine.vllm_engine import VLLMEngine, configure_cpu_env
    from hpc_tba.roles.searcher import Searcher

    index = topo.searcher_index(transport.rank)
    device = "cuda" if groups.backend == "nccl" else "cpu"
    if device == "cpu":
        configure_cpu_env(core=None, kv_cache_mb=cfg.searcher.kv_cache_mb)
    warm_prompt = task.prompts("train")[0].text

    def engine_factory() -> VLLMEngine:
        engine = VLLMEngine(model_path, cfg.searcher, seed=cfg.searcher.seed + index, device=device)
        # The first generate call pays one-off set-up (~4 s on CPU): pay it here, not in round 1.
        engine.sample(engine.tokenize([warm_prompt]), n=1, temperature=1.0, max_tokens=1)
        return engine

    engine = engine_factory()
    setup = transport.bcast_json(None)
    manifest = Manifest.from_json(setup["manifest"])  # staging resolved once the engine holds its memory
    receiver = WeightReceiver(manifest, groups.sync_group, device=device,
                              staging=resolve_staging(cfg.searcher.staging, device, manifest))
    quota = None
    if cfg.learner.mode == "sync":  # one on-policy batch per version: G prompts for every shard
        quota = topo.on_policy_quota(index, cfg.learner.prompts_per_step)
    searcher = Searcher(cfg=cfg.searcher, task=task, engine=engine, receiver=receiver,
                        transport=transport, topo=topo, index=index, run_dir=cfg.run_dir,
                        engine_factory=engine_factory, on_policy_quota=quota)
    searcher.probe = setup["probe"]
    searcher.resumed = setup["resumed_step"] > 0
    return searcher
