"""What tools/bench_inflight.py prints: each mode's row, the step loop's split, the three figures,
and the windows behind them (bench_probe): the interleaved pairs of the headline, and the long
window's bare before and after side by side."""
from __future__ import annotations

import numpy as np
from bench_probe import print_pairs, print_windows


def report(args, rows: dict, bare: dict) -> None:
    print(f"model: embedded tiny Llama; {args.prompts} prompts x S={args.samples} (continuous: groups "
          f"running at once), {args.lengths} response lengths up to {args.max_new_tokens} tokens; learner: "
          f"{args.per_step} new responses and {args.train_s} s per step (demand {args.demand:g} of bare "
          f"vLLM's {bare['responses_per_s']:.1f} responses/s unless --per-step), a new version every step; "
          f"staging {args.staging}, bucket {args.bucket_kb:g} KiB; {args.seconds:g} s per mode")
    print("| update         | staging | versions | staleness mean/max | learner wait | samples | sync  "
          "| starved steps | tokens/s | tokens/CPU-s | updates | batch | paused in loads | re-prefill/token |")
    print("|----------------|---------|---------:|-------------------:|-------------:|--------:|------:"
          "|--------------:|---------:|-------------:|--------:|------:|----------------:|-----------------:|")
    for r in rows.values():
        batch = f"{r['batch']:.2f}" if r["batch"] is not None else "-"
        print(f"| {r['update']:14} | {r['staging']:7} | {r['versions']:8d} | "
              f"{r['staleness_mean']:9.2f} / {r['staleness_max']:<6.0f} | {r['wait_frac']:12.3f} | "
              f"{r['samples_wait_frac']:7.3f} | {r['sync_block_frac']:5.3f} | {r['starved_steps']:13d} | "
              f"{r['tokens_per_s']:8.0f} | {r['tokens_per_cpu_s']:12.0f} | {r['updates_in_flight']:7d} | "
              f"{batch:>5} | {r['apply_frac']:15.3f} | {r['reprefill_per_token']:16.3f} |")
    cont, base = rows["continuous"], rows["between_rounds"]
    same = cont["bare"]  # on the continuous mode's engine, before and after it
    for name, b in (("bare-vllm", bare), ("bare, before", same[0]), ("bare, after", same[1])):
        print(f"| {name:14} | {'':7} | {'':8} | {'':18} | {'':12} | {'':7} | {'':5} | {'':13} | "
              f"{b['tokens_per_s']:8.0f} | {b['tokens_per_cpu_s']:12.0f} | {'':7} | {'':5} | {'':15} | {'':16} |")
    for r in rows.values():
        print(f"searcher time ({r['update']}, {r['wall_s']:.0f} s): {r['searcher_s']}; admissions held back: "
              f"{r['held_back']}; dropped (version span): {r['dropped_span']}")
    for r in rows.values():
        if r["steps"]:
            f = r["steps"]
            print(f"step loop ({r['update']}): of the wall time, vLLM steps {f['decode']:.3f} (a step "
                  f"{f['step_ms']:.2f} ms), re-prefill after updates {f['reprefill']:.3f} (over a plain "
                  f"step), paused in loads {f['apply']:.3f}, the rest {f['rest']:.3f} (admissions, "
                  "bookkeeping, scoring and sending, the process's other threads)")
    streamed = [r["peak_per_bucket"] for r in rows.values() if r["staging"] == "stream"]
    peak = max(streamed or [r["peak_per_bucket"] for r in rows.values()])  # stream's bound: 3 buckets
    bare_tps = sum(b["tokens_per_s"] for b in same) / len(same)
    bare_cpu = sum(b["tokens_per_cpu_s"] for b in same) / len(same)
    print(f"sync staging peak/bucket = {peak:.2f}")
    print(f"in_flight/between_rounds learner wait = {cont['wait_frac'] / max(base['wait_frac'], 1e-9):.3f}")
    ratios, modes = print_pairs(cont["pairs"]), cont["pairs"]["modes"]
    print(f"in_flight/bare-vllm tokens/s = {np.median(ratios):.3f}")
    print(f"(the median over {len(ratios)} pairs, {min(ratios):.3f}-{max(ratios):.3f}; updates per second: "
          f"{sum(m['updates'] for m in modes) / sum(m['wall_s'] for m in modes):.2f} in the pairs' continuous "
          f"windows, {cont['updates_in_flight'] / cont['wall_s']:.2f} in the long one. The long window against "
          f"the mean of bare before and after ({same[0]['tokens_per_s']:.0f} and {same[1]['tokens_per_s']:.0f} "
          f"tokens/s), drift included: {cont['tokens_per_s'] / bare_tps:.3f}; per CPU-second of the process: "
          f"{cont['tokens_per_cpu_s'] / bare_cpu:.3f}; against bare vLLM in its own process: "
          f"{cont['tokens_per_s'] / bare['tokens_per_s']:.3f})")
    util = [b["tokens_per_s"] / b["tokens_per_cpu_s"] for b in (cont, *same)]
    print(f"(CPU-seconds per wall second of the process: continuous {util[0]:.2f}, bare before "
          f"{util[1]:.2f}, after {util[2]:.2f}; the tokens/s ratio holds only where all are near 1: "
          "below, other jobs took the CPU from that window)")
    print_windows(cont, same)
