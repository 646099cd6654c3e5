"""Write an offline data set (JSONL: prompt, response, reward) sampled from a policy.

    python tools/make_offline_data.py OUT.jsonl [--samples 4] [--temperature 1.0] [overrides...]

Samples the starting policy (the embedded model unless model.path=...) on the task's train
prompts, scores every response with the task's reward, and writes the rows in the format
hpc_tba.tasks.offline reads. TOPR and A-LoL then train on the file with no searcher:
`hpc-tba preprocess task=offline task.path=OUT.jsonl` and
`hpc-tba train algo=topr task=offline task.path=OUT.jsonl cluster.num_searchers=0`.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_tba.assembly.compose import compose
    from hpc_tba.tasks import build_task
    from hpc_tba.tasks.embedded import resolve_model_path
    from hpc_tba.tasks.offline import OfflineExample, write_offline

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-prompts", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    args, overrides = ap.parse_known_args(argv)
    cfg = compose(overrides)
    task = build_task(cfg.task)
    path = resolve_model_path(cfg.model, cfg.task)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = task.prompts("train")[: args.max_prompts or None]
    torch.manual_seed(args.seed)
    rows = []
    for i in range(0, len(prompts), 128):
        chunk = prompts[i:i + 128]
        enc = tok([p.text for p in chunk], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=args.temperature, top_k=0,
                                 num_return_sequences=args.samples,
                                 max_new_tokens=cfg.searcher.max_new_tokens,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        flat = [p for p in chunk for _ in range(args.samples)]
        rewards, _ = task.rewards(flat, texts)
        rows += [OfflineExample(p.text, t, float(r)) for p, t, r in zip(flat, texts, rewards)]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_offline(args.out, rows)
    pos = sum(r.reward > 0 for r in rows) / max(len(rows), 1)
    print(f"wrote {len(rows)} rows ({100 * pos:.1f}% positive) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
