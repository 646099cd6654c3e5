"""Look inside a run's replay buffer without touching it: counts, histograms, one prompt.

    python tools/inspect_buffer.py runs/default/buffer                  # counts per shard
    python tools/inspect_buffer.py runs/default/buffer --png out/       # + reward/staleness PNGs
    python tools/inspect_buffer.py runs/default/buffer --prompt 17      # one prompt's responses

Reads the newest shard layout's segments into memory (BufferShard.snapshot): no file is written,
truncated or re-sharded, so it is safe on a run that is still writing. Staleness is measured
against --learner-version (default: the newest policy version stored).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hpc_tba.buffer import BufferShard
from hpc_tba.config import BufferConfig


def summary(shards: list[BufferShard], info: dict) -> list[str]:
    lines = [(f"generation {info['generation']}: {len(shards)} shard(s), "
              f"torn bytes dropped on read {info['torn_bytes']}")]
    if info["incomplete"]:
        lines.append(f"shards still importing (partial view): {info['incomplete']}")
    for i, s in enumerate(shards):
        m = s.metrics()
        lines.append(f"shard {i}: responses {int(m['buffer/size'])}  prompts {int(m['buffer/prompts'])}"
                     f"  added {int(m['buffer/added'])}  duplicates {int(m['buffer/duplicates'])}"
                     f"  evicted {int(m['buffer/evicted'])}  reward mean {m['buffer/reward_mean']:.3f}"
                     f"  sync version {s.sync_version}")
    return lines


def columns(shards: list[BufferShard]) -> dict[str, np.ndarray]:
    """Reward, version and length of every stored response, all shards together."""
    cols: dict[str, list[np.ndarray]] = {"reward": [], "version": [], "len": []}
    for s in shards:
        live = s.store.live_slots()
        for k, parts in cols.items():
            parts.append(s.store.s[k][live])
    return {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}


def plot(shards: list[BufferShard], out: str, learner_version: int) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    c = columns(shards)
    per_prompt = np.concatenate([[e.slots.size for e in s.store.prompts.values()] for s in shards])
    figures = {"reward": (c["reward"], "reward", 50),
               "staleness": (learner_version - c["version"], f"lag behind version {learner_version}",
                             None),
               "length": (c["len"], "response tokens", 50),
               "per_prompt": (per_prompt, "responses stored per prompt", 50)}
    paths = []
    for name, (values, xlabel, bins) in figures.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        if bins is None:  # integer lags: one bar per lag
            bins = np.arange(values.min(), values.max() + 2) - 0.5 if values.size else 10
        ax.hist(values, bins=bins)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("count")
        ax.set_title(f"buffer {name} ({values.size} values)")
        path = os.path.join(out, f"buffer_{name}.png")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def prompt_view(shards: list[BufferShard], prompt_id: int, max_tokens: int = 12) -> list[str]:
    shard = shards[prompt_id % len(shards)]
    entry = shard.store.prompts.get(prompt_id)
    if entry is None:
        return [f"prompt {prompt_id}: not in the buffer"]
    st = shard.store
    lines = [(f"prompt {prompt_id} (shard {prompt_id % len(shards)}): {entry.slots.size} "
              f"responses, oldest first; prompt tokens {entry.tokens[:max_tokens].tolist()}")]
    for slot in entry.slots.tolist():
        o, n = int(st.s["off"][slot]), int(st.s["len"][slot])
        lines.append(f"  v{int(st.s['version'][slot]):<5d} reward {float(st.s['reward'][slot]):+.3f}  "
                     f"len {n:<4d} searcher {int(st.s['searcher'][slot])}  "
                     f"tokens {st.tok[o:o + min(n, max_tokens)].tolist()}{' ...' if n > max_tokens else ''}")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("directory", help="the run's buffer directory (holds gXXXX-nXXXX/)")
    p.add_argument("--png", metavar="DIR", help="write reward/staleness/length histograms here")
    p.add_argument("--prompt", type=int, action="append", default=[], help="show one prompt")
    p.add_argument("--learner-version", type=int, help="staleness reference (default: newest)")
    args = p.parse_args(argv)
    shards, info = BufferShard.snapshot(args.directory, BufferConfig())  # run's config from manifest
    print("\n".join(summary(shards, info)))
    for pid in args.prompt:
        print("\n".join(prompt_view(shards, pid)))
    if args.png:
        versions = columns(shards)["version"]
        v = args.learner_version if args.learner_version is not None else int(versions.max(initial=0))
        for path in plot(shards, args.png, v):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
