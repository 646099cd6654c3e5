"""Benchmark: one learner step, ours against plain DeepSpeed doing the same work, and the planner's memory.

    DS_ACCELERATOR=cpu python tools/bench_learner.py [--sizes 10m 50m 100m] [--k 16] [--micro 8]
        [--algo tb grpo ...] [--objectives-size 10m] [--no-memory] [--checkpointing] [--steps 1]
        [--threads 2]

Llama-shaped models (built locally with random weights under ~/.cache/hpc_tba/bench_models; no
download), prompt 256 + response 512 tokens, one prompt group of K responses per step, on one
learner rank (DeepSpeed ZeRO-3 on its CPU accelerator, gloo). Every measurement runs in a fresh
process (`--child`), so one measurement's allocations never count in another's peak:

- ours:  `Learner.train_step` of the real Learner (built from the composed config, as a run builds
  it) on a fixed batch: micro-batches of `learner.micro_batch_size`, the loss (`--algo`, with its
  reference model when the loss needs one), gradient accumulation, one optimizer step;
- plain: plain DeepSpeed doing the same work (like for like): `deepspeed.initialize` on the same
  model with the same ZeRO-3 settings, the same micro-batches (hpc_tba.roles.microbatch.plan) and
  the same passes (`step_passes`): the reference model's no-grad forward when the loss needs it,
  the no-grad context pass when the loss is group-coupled and the group is split (over the
  micro-batches the learner's runs, `microbatch.context_passes`), then forward + backward per
  micro-batch, each forward's response logits through an fp32 log-softmax; the loss
  is the mean log-prob (an objective's own arithmetic is [B, T] elementwise work); DeepSpeed's
  own gradient accumulation. Objectives with the same passes share one plain measurement, so
  ours/plain is the learner's own overhead (packing, host syncs, collectives, metrics, the
  chunked log-prob head's recompute);
- plan:  `hpc_tba.plan.planner.make_plan` for the same config (its learner total per rank, without the
  weight-sync send slots that only a run with searchers allocates).

tokens/s: prompt + response tokens of the step / seconds of the timed steps (after one warm-up
step, which also allocates Adam's states). Peak memory per rank: the high-water mark of the
process's resident memory (VmHWM, reset through /proc/self/clear_refs once the model is built,
so the checkpoint's memory-mapped files do not count) minus the resident memory after imports
and process-group setup, before the model is built. The measured processes run with a fixed
glibc mmap threshold (`--mmap-threshold`, 1 MiB): with glibc's dynamic threshold, freed tensors
of up to 32 MiB stay in the heap and every micro-batch fragments it further, so resident memory
grew with the number of micro-batches while the live tensors did not (10m model, K=8: 1.76 GiB
resident with the default vs 1.14 GiB with the fixed threshold; K=64: 1.19 GiB fixed). The
fixed threshold costs page faults, and not alike: at 50M (TB, 2-core AMD EPYC, 2026-12-04) a
quarter of each side's CPU went to the kernel, 22-23% for ours against 28% for plain (its
full-vocabulary log-softmax allocates more), and ours/plain read 1.07-1.12 with it against 0.978
with glibc's own threshold (`--mmap-threshold 0`, kernel 11% / 14%), which is what runs use. Timings are ratios
measured in one run on a shared machine: only the ratios mean something. Each measured process
also reports its timed steps' CPU use (`usage`: CPU-seconds per wall second, near 2 with two
threads on a quiet 2-core machine, the kernel's share, page faults and preemptions per second):
a pair whose sides differ there was disturbed, not measured.

Last lines (3 significant digits): ours/plain tokens/s per objective (on --objectives-size,
default the largest of --sizes) and the lowest of them, measured/planned peak of the largest
model measured (first objective), and the peak of ours with K=64 over K=8 at the same micro
batch (smallest model).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT, RESPONSE = 256, 512
SIZES = {  # name: (vocab, hidden, layers, heads, kv heads, intermediate); head_dim 64
    "1m": (2048, 128, 2, 2, 2, 384),  # smoke runs only: the figures of a model this small are overheads
    "10m": (8192, 256, 6, 4, 4, 768),
    "50m": (16384, 512, 10, 8, 4, 1536),
    "100m": (16384, 768, 12, 12, 4, 2048),
    "400m": (32000, 1024, 24, 16, 8, 2816),
}
ROOT = os.path.expanduser("~/.cache/hpc_tba/bench_models")


def build_model(size: str) -> str:
    """A random-weight Llama of `size` in HF format with the embedded model's tokenizer (the token
    ids of the batch are random below the model's vocabulary; only the pad id is read)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_tba.config import ModelConfig, TaskConfig
    from hpc_tba.tasks.embedded import resolve_model_path

    path = os.path.join(ROOT, size)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    vocab, h, layers, heads, kv, inter = SIZES[size]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp, safe_serialization=True)
    tok = resolve_model_path(ModelConfig(), TaskConfig())
    for name in os.listdir(tok):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tok, name), tmp)
    os.replace(tmp, path)
    return path


def run_config(path: str, *, k: int, micro: int, algo: str, checkpointing: bool, searchers: int = 0):
    from hpc_tba.assembly.compose import compose

    return compose([f"model.path={path}", f"algo={algo}", f"searcher.k={k}", "learner.prompts_per_step=1",
                    f"learner.micro_batch_size={micro}", f"learner.gradient_checkpointing={checkpointing}",
                    f"searcher.max_model_len={PROMPT + RESPONSE}", f"searcher.max_new_tokens={RESPONSE}",
                    "learner.dtype=fp32", "cluster.num_learners=1", f"cluster.num_searchers={searchers}"])


def make_batch(vocab: int, k: int, seed: int = 0, *, prompt_len: int = PROMPT, resp_len: int = RESPONSE):
    """One prompt group of K random responses, every one `prompt_len` + `resp_len` tokens."""
    import numpy as np

    from hpc_tba.comm.messages import SampledBatch

    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, vocab, prompt_len).astype(np.int32)
    return SampledBatch(
        prompt_ids=np.zeros(k, dtype=np.int64), group_ids=np.zeros(k, dtype=np.int64),
        prompt_tokens=[prompt] * k,
        response_tokens=[rng.integers(3, vocab, resp_len).astype(np.int32) for _ in range(k)],
        rewards=rng.random(k).astype(np.float32),
        logp_behavior=[-rng.random(resp_len).astype(np.float32) * 5 for _ in range(k)],
        policy_versions=np.zeros(k, dtype=np.int64))


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _ours(cfg, path: str, run_dir: str, batch, *, transport):
    from hpc_tba.buffer import BufferShard
    from hpc_tba.config import resolve_wire_dtype
    from hpc_tba.config.topology import Topology
    from hpc_tba.roles.learner import Learner

    shard = BufferShard(cfg.buffer, directory=os.path.join(run_dir, "buffer"))
    lr = dataclasses.replace(cfg.learner, sync_wire_dtype=resolve_wire_dtype(cfg.learner, cfg.searcher))
    learner = Learner(cfg=lr, loss=cfg.algo, shard=shard, k=cfg.searcher.k,
                      temperature=cfg.searcher.temperature, model_path=path, transport=transport,
                      topo=Topology.build(1, 1, 0, needs_searchers=False), sync_group=None, run_dir=run_dir)
    return learner.train_step


def step_passes(cfg, batch) -> dict:
    """The forwards the learner's step runs on `batch` (what the baseline must run too): its
    micro-batch plan (hpc_tba.roles.microbatch), whether the loss needs the reference model's
    forward, and the micro-batches of its no-grad context pass (indices into the plan's rows;
    none unless the loss is group-coupled and a group is split)."""
    import numpy as np

    from hpc_tba.losses import needs
    from hpc_tba.roles import microbatch

    micro = cfg.learner.micro_batch_size or cfg.searcher.k
    lengths = np.array([len(p) + len(r) for p, r in zip(batch.prompt_tokens, batch.response_tokens)])
    p = microbatch.plan(lengths, batch.group_ids, micro)
    return {"plan": p, "reference": needs(cfg.algo).reference, "context": microbatch.context_passes(cfg.algo, p)}


def _plain(cfg, path: str, run_dir: str, batch):
    """Plain DeepSpeed doing the learner's work on `batch`: the same ZeRO-3 settings, the same
    micro-batches (rows of hpc_tba.roles.microbatch.plan) and passes (`step_passes`: reference
    forward, no-grad context pass, then forward + backward), each a straightforward forward of
    the engine whose logits at the response positions (`logits_to_keep`) go through an fp32
    log-softmax at the sampling temperature; loss: minus the mean response log-prob; DeepSpeed's
    own gradient accumulation (one `step` per micro-batch, the last one updates)."""
    import deepspeed
    import numpy as np
    import torch

    from hpc_tba.models.loading import load_causal_lm
    from hpc_tba.roles.learner import deepspeed_config

    passes = step_passes(cfg, batch)
    rows = passes["plan"].rows
    micro = cfg.learner.micro_batch_size or cfg.searcher.k
    ds = deepspeed_config(cfg.learner, micro_batch=micro, train=True)
    model = load_causal_lm(path, dtype=torch.float32, zero3_config=ds, rank=0)
    if cfg.learner.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-6),
                                      config=dict(ds, gradient_accumulation_steps=len(rows)))
    ref = None
    if passes["reference"]:
        ref_model = load_causal_lm(path, dtype=torch.float32, zero3_config=ds, rank=0).eval()
        ref_model.requires_grad_(False)
        ref, *_ = deepspeed.initialize(model=ref_model,
                                       config=deepspeed_config(cfg.learner, micro_batch=micro, train=False))
    temperature = cfg.searcher.temperature

    def logp(model, ids, resp):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=resp.shape[1] + 1)
        logits = out.logits[:, :-1].float() / temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)

    def step(batch):
        seqs = torch.from_numpy(np.stack([np.concatenate([p, r]) for p, r in
                                          zip(batch.prompt_tokens, batch.response_tokens)]).astype(np.int64))
        resp = seqs[:, PROMPT:]  # every sequence is PROMPT + RESPONSE long: no padding
        with torch.no_grad():
            for r in rows if passes["reference"] else ():
                logp(ref, seqs[r], resp[r])
            for i in passes["context"]:
                logp(engine, seqs[rows[i]], resp[rows[i]])
        for r in rows:
            engine.backward(-logp(engine, seqs[r], resp[r]).mean())
            engine.step()
    return step


def child(args: dict) -> dict:
    """One measurement in this (fresh) process."""
    import torch

    torch.set_num_threads(args["threads"])
    import deepspeed

    from hpc_tba.comm.groups import free_ports

    port = free_ports(1)[0]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, rank=0, world_size=1,
                               init_method=f"tcp://127.0.0.1:{port}", verbose=False)
    cfg = run_config(args["path"], k=args["k"], micro=args["micro"], algo=args["algo"],
                     checkpointing=args["checkpointing"])
    batch = make_batch(SIZES[args["size"]][0], args["k"])
    # everything imported and MPI started before the baseline: only the step's memory is counted
    import transformers.models.llama.modeling_llama  # noqa: F401

    from hpc_tba.comm.transport import MPITransport
    from hpc_tba.models import loading  # noqa: F401
    from hpc_tba.roles import learner  # noqa: F401

    transport = MPITransport()
    base = _rss("VmRSS")
    # the learner is not closed: its logger may still write under run_dir while it is removed
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as run_dir:
        build = functools.partial(_ours, transport=transport) if args["mode"] == "ours" else _plain
        step = build(cfg, args["path"], run_dir, batch)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM: the load's mapped files are closed by now
        t0, u0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        step(batch)  # warm-up: Adam allocates its states
        dt = warm = time.perf_counter() - t0
        if args["steps"]:
            t0, u0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            for _ in range(args["steps"]):
                step(batch)
            dt = (time.perf_counter() - t0) / args["steps"]
        use = usage(u0, resource.getrusage(resource.RUSAGE_SELF), dt * max(args["steps"], 1))
    return {"tokens_per_s": args["k"] * (PROMPT + RESPONSE) / dt, "step_s": dt, "warmup_s": warm,
            "peak": _rss("VmHWM") - base, "threads": torch.get_num_threads(),
            "os_threads": len(os.listdir("/proc/self/task")), **use}


def usage(u0, u1, wall: float) -> dict:
    """What the timed steps cost the process: CPU-seconds per wall second (user + system; with
    --threads 2 on a quiet 2-core machine near 2: lower means other jobs took cores, or threads
    waited), the share of it spent in the kernel, and page faults (minor: fresh pages of
    mmap-threshold allocations; major: read from disk) and involuntary context switches
    (preemptions) per timed second."""
    cpu = (u1.ru_utime - u0.ru_utime) + (u1.ru_stime - u0.ru_stime)
    return {"cpu_per_wall": cpu / wall, "sys_frac": (u1.ru_stime - u0.ru_stime) / max(cpu, 1e-9),
            "minflt_per_s": (u1.ru_minflt - u0.ru_minflt) / wall, "majflt": u1.ru_majflt - u0.ru_majflt,
            "preempt_per_s": (u1.ru_nivcsw - u0.ru_nivcsw) / wall}


def measure(mode: str, path: str, size: str, a, *, k: int, algo: str) -> dict:
    spec = dict(mode=mode, path=path, size=size, k=k, micro=a.micro, algo=algo,
                checkpointing=a.checkpointing, steps=a.steps, threads=a.threads)
    path_env = os.pathsep.join(filter(None, [sys.path[0], os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(a.threads), TOKENIZERS_PARALLELISM="false",
               HPC_TBA_NO_PROGRESS="1", PYTHONPATH=path_env)
    if a.mmap_threshold:  # module docstring: resident memory then follows the live tensors
        env["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                         capture_output=True, text=True, env=env, timeout=a.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} {algo} {size} K={k} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def planned(path: str, a, *, k: int, algo: str) -> float:
    """The planner's learner total per rank for the measured step, in bytes.

    The planner plans runs, and a run has searchers (it refuses a layout without one), so the
    plan is made with one searcher and its weight-sync send slots (a term only a run with
    searchers allocates; the measured learner has none) are taken off."""
    from hpc_tba.plan.planner import PlanOptions, make_plan

    plan = make_plan(run_config(path, k=k, micro=a.micro, algo=algo, checkpointing=a.checkpointing, searchers=1),
                     PlanOptions(deepspeed=False))
    if plan.problems or not plan.learner_gib:
        raise RuntimeError("the planner made no learner plan for the measured config: " + "; ".join(plan.problems))
    return plan.learner_gib * 2**30 - plan.terms.get("send_slots", 0.0)


def fmt(x: float) -> str:
    return f"{x:.3g}"


def cpu_note(m: dict) -> str:
    """A measured process's CPU use in its timed steps (`usage`), for the tables' lines."""
    return (f"[{m['step_s']:.1f} s/step, warm-up {m['warmup_s']:.1f} s, CPU {m['cpu_per_wall']:.2f}/s, "
            f"sys {100 * m['sys_frac']:.0f}%, {m['minflt_per_s'] / 1e3:.0f}k faults/s, "
            f"{m['preempt_per_s']:.0f} preempt/s, {m['threads']} threads]")


def objectives() -> list[str]:
    """Every built-in objective of the loss registry."""
    from hpc_tba.losses.registry import BUILTIN

    return list(BUILTIN)


def passes_of(path: str, a, algo: str) -> tuple[bool, int]:
    """(reference forward, context-pass micro-batches) of the measured step for `algo`: the plain
    baseline's work depends on these only, so objectives that agree share one baseline measurement."""
    cfg = run_config(path, k=a.k, micro=a.micro, algo=algo, checkpointing=a.checkpointing)
    p = step_passes(cfg, make_batch(SIZES["10m"][0], a.k))
    return p["reference"], len(p["context"])


def memory_table(a) -> dict:
    """ours and plain (tokens/s, peak) and the planned peak for each size, `a.algo[0]`."""
    algo, rows = a.algo[0], {}
    for size in a.sizes:
        path = build_model(size)
        ours, plain = (measure(m, path, size, a, k=a.k, algo=algo) for m in ("ours", "plain"))
        plan = planned(path, a, k=a.k, algo=algo)
        rows[size] = (ours, plain, plan)
        print(f"  {size:>5} {algo}: ours {ours['tokens_per_s']:8.1f} tok/s peak {ours['peak'] / 2**30:6.2f} GiB | "
              f"plain {plain['tokens_per_s']:8.1f} tok/s peak {plain['peak'] / 2**30:6.2f} GiB | "
              f"planned {plan / 2**30:6.2f} GiB\n        ours {cpu_note(ours)}\n       plain {cpu_note(plain)}",
              flush=True)
    return rows


def objective_ratios(a, size: str, first: tuple[dict, dict] | None) -> dict[str, float]:
    """ours/plain tokens/s of every objective of `a.algo` on `size`; `first` = the (ours, plain)
    already measured for `a.algo[0]`. Each ours is paired with a plain measured right after it
    (on a loaded machine only adjacent measurements compare); `--share-plain` measures one plain
    per set of passes instead (fewer processes, noisier ratios)."""
    path = build_model(size)
    plains: dict[tuple[bool, int], dict] = {}
    out = {}
    for i, algo in enumerate(a.algo):
        sig = passes_of(path, a, algo)
        if i == 0 and first is not None:
            ours, plains[sig] = first
        else:
            ours = measure("ours", path, size, a, k=a.k, algo=algo)
            if sig not in plains or not a.share_plain:
                plains[sig] = measure("plain", path, size, a, k=a.k, algo=algo)
        out[algo] = ours["tokens_per_s"] / plains[sig]["tokens_per_s"]
        print(f"  {size:>5} {algo:>5} (reference {sig[0]}, context-pass micro-batches {sig[1]}): ours "
              f"{ours['tokens_per_s']:8.1f} tok/s, plain {plains[sig]['tokens_per_s']:8.1f} tok/s", flush=True)
        if not (i == 0 and first is not None):  # the first pair's CPU use is printed with the memory table
            print(f"        ours {cpu_note(ours)}\n       plain {cpu_note(plains[sig])}", flush=True)
    return out


def add_measure_options(ap: argparse.ArgumentParser) -> None:
    """The options of how a measured process runs (bench_learner's and bench_sp's)."""
    ap.add_argument("--checkpointing", action="store_true", help="learner.gradient_checkpointing")
    ap.add_argument("--steps", type=int, default=1, help="timed steps after one warm-up step (0: time the warm-up)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--mmap-threshold", type=int, default=2**20,
                    help="glibc M_MMAP_THRESHOLD of the measured processes (0: glibc's dynamic default)")
    ap.add_argument("--child", help=argparse.SUPPRESS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["10m", "50m"], choices=list(SIZES))
    ap.add_argument("--k", type=int, default=16, help="responses in the step (one prompt group)")
    ap.add_argument("--micro", type=int, default=8, help="learner.micro_batch_size")
    ap.add_argument("--algo", nargs="+", default=None,
                    help="objectives (default: every built-in one; the first also gets the memory table)")
    ap.add_argument("--objectives-size", default=None, choices=list(SIZES),
                    help="model of the per-objective ratios (default: the largest of --sizes)")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory figures (K=64/K=8, planned)")
    ap.add_argument("--share-plain", action="store_true",
                    help="one plain measurement per set of passes, shared by the objectives that have it")
    ap.add_argument("--threads", type=int, default=2)
    add_measure_options(ap)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))), flush=True)
        return 0
    a.algo = a.algo or objectives()
    osize = a.objectives_size or a.sizes[-1]
    print(f"bench_learner: prompt {PROMPT} + response {RESPONSE} tokens, K={a.k}, micro batch {a.micro}, "
          f"objectives {' '.join(a.algo)}, checkpointing {a.checkpointing}, 1 rank, {a.threads} threads, "
          f"mmap threshold {a.mmap_threshold or 'glibc default'}", flush=True)
    rows = memory_table(a)
    ratios = objective_ratios(a, osize, rows[osize][:2] if osize in rows else None)
    if not a.no_memory:
        small = build_model(a.sizes[0])
        mem_only = argparse.Namespace(**{**vars(a), "steps": 0})  # the peak needs one step, not a timing
        k8, k64 = (measure("ours", small, a.sizes[0], mem_only, k=k, algo=a.algo[0]) for k in (8, 64))
        print(f"  {a.sizes[0]:>5}: ours K=8 peak {k8['peak'] / 2**30:.2f} GiB, K=64 peak {k64['peak'] / 2**30:.2f} "
              f"GiB (micro batch {a.micro}; planned {planned(small, a, k=8, algo=a.algo[0]) / 2**30:.2f} / "
              f"{planned(small, a, k=64, algo=a.algo[0]) / 2**30:.2f} GiB)", flush=True)
    not_run = [s for s in SIZES if s not in a.sizes]
    if not_run:
        print(f"  not run: {', '.join(not_run)} (--sizes; 2 cores: minutes per step beyond 100m)")
    ours, plain, plan = rows[a.sizes[-1]]
    print(f"headline figures: {osize} model (tokens/s by objective), {a.sizes[-1]} model (peak), "
          f"{a.sizes[0]} model (K64/K8)")
    for algo, r in ratios.items():
        print(f"learner/plain-deepspeed tokens/s ({algo}) = {fmt(r)}")
    worst = min(ratios, key=ratios.get)
    print(f"learner/plain-deepspeed tokens/s = {fmt(ratios[worst])} (lowest: {worst})")
    print(f"peak measured/planned = {fmt(ours['peak'] / plan)}")
    if not a.no_memory:
        print(f"peak K64/K8 = {fmt(k64['peak'] / k8['peak'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
