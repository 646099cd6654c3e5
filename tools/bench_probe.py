"""What a timed window of a benchmark cost, so that a figure can be judged on a shared machine:
the process's CPU-seconds per wall second, the cores the machine's *other* processes used
meanwhile (from /proc/stat: the whole machine's busy time minus this process's), chosen threads'
CPU, and the engine steps that ran in it (tools/bench_inflight.py records every `LLMEngine.step`,
in our step loop and in vLLM's own `LLM.generate`).

A VM's host is not seen here: on this project's 2-core VM the same bare-vLLM work in one process
on an otherwise idle guest ran at a median step of 2.4 ms in one window and 4.6 ms a minute
later (others' cores 0.01-0.02 in both), so step times are printed beside every tokens/s.
"""
from __future__ import annotations

import os
import time

import numpy as np

_TICK = os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine so far (every core; steal counts as busy)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v) - v[3] - v[4], sum(v)


def thread_cpu_s(tid: int) -> float:
    """CPU-seconds (user + system) of thread `tid` of this process so far (0 once it has ended)."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


class Window:
    """A timed window: `start()`, then `stop()` -> its costs (see the module docstring).
    `threads` names native thread ids whose CPU is reported per wall second; `steps` is a list
    of (start, seconds) the engine appends to, whose steps inside the window are summarised."""

    def __init__(self, steps: list | None = None) -> None:
        self.steps = steps if steps is not None else []
        self.threads: dict[str, int] = {}

    def start(self) -> Window:
        self.t0, self.c0, self.m0 = time.perf_counter(), time.process_time(), machine_ticks()
        self.th0 = {name: thread_cpu_s(tid) for name, tid in self.threads.items()}
        return self

    def stop(self) -> dict:
        wall, cpu = time.perf_counter() - self.t0, time.process_time() - self.c0
        m1 = machine_ticks()
        cores = os.cpu_count() or 1
        busy = cores * (m1[0] - self.m0[0]) / max(m1[1] - self.m0[1], 1)  # cores busy, machine-wide
        steps = np.array([d for t, d in self.steps if self.t0 <= t < self.t0 + wall]) * 1e3
        return {"wall_s": wall, "cpu_per_wall": cpu / wall, "others_cores": max(busy - cpu / wall, 0.0),
                "threads": {n: (thread_cpu_s(tid) - self.th0[n]) / wall for n, tid in self.threads.items()},
                "steps": int(steps.size), "step_ms": float(np.median(steps)) if steps.size else None}


def timed_steps(llm_engine, record: list) -> None:
    """Record (start, seconds) of every `step()` of vLLM's `llm_engine` into `record` (one
    perf_counter pair a step: ~1 us against steps of milliseconds)."""
    step = llm_engine.step

    def timed():
        t0 = time.perf_counter()
        out = step()
        record.append((t0, time.perf_counter() - t0))
        return out

    llm_engine.step = timed


def print_windows(cont: dict, same: list[dict]) -> None:
    """Print bench_inflight's three windows side by side: the same bare work's vLLM step moves
    with the machine, which a tokens/s ratio of windows seconds apart cannot tell from our loop's
    cost; tokens per step-time rescales each window by its own median step."""
    w = cont["window"]
    rows = [("bare before", same[0]), ("continuous", cont), ("bare after", same[1])]
    print("(windows: " + "; ".join(
        f"{name} {r['tokens_per_s']:.0f} tokens/s, median vLLM step {r['window']['step_ms'] or 0:.2f} ms, "
        f"other processes {r['window']['others_cores']:.2f} cores" for name, r in rows)
        + f"; in the continuous window the learner stand-in's thread took {w['threads']['learner']:.3f} "
        f"CPU-s/s, the weight receiver's {w['threads']['receiver']:.3f})")
    if all(r["window"]["step_ms"] for _, r in rows):
        per_step = [r["tokens_per_s"] * r["window"]["step_ms"] for _, r in rows]
        print(f"(continuous / bare tokens per median step-time, which rescales each window by its own "
              f"machine speed, charges our loop, its loads and re-prefills but not a slower decode step: "
              f"{per_step[1] / ((per_step[0] + per_step[2]) / 2):.3f})")



def step_split(st: dict, wall: float) -> dict | None:
    """Where a step loop's wall time went, from its `StepStats` deltas `st`: vLLM's steps (decode),
    the extra cost of the steps that re-prefilled after an update (over a plain step's mean), the
    engine paused in weight loads, and the rest (admissions, the loop's bookkeeping, scoring and
    sending, the process's other threads), as shares of the wall time."""
    if not st["steps"]:
        return None
    plain = (st["step_s"] - st["reprefill_step_s"]) / max(st["steps"] - st["reprefill_steps"], 1)
    extra = st["reprefill_step_s"] - st["reprefill_steps"] * plain
    return {"step_ms": 1e3 * plain, "decode": (st["step_s"] - extra) / wall, "reprefill": extra / wall,
            "apply": st["apply_s"] / wall, "rest": 1 - (st["step_s"] + st["apply_s"]) / wall}


def pair_ratios(modes: list[float], bares: list[float]) -> list[float]:
    """Interleaved windows bare, mode, bare, ..., mode, bare: each mode window's tokens/s over the
    mean of the two bare windows on its sides (a machine speed that drifts linearly across the
    three cancels)."""
    if len(bares) != len(modes) + 1:
        raise ValueError(f"{len(modes)} mode windows need {len(modes) + 1} bare windows, not {len(bares)}")
    return [m / ((a + b) / 2) for m, a, b in zip(modes, bares, bares[1:])]


def print_pairs(pairs: dict) -> list[float]:
    """Print bench_inflight's interleaved windows, one line per continuous window with its two bare
    neighbours (tokens/s and median vLLM step of each), and return the ratios (pair_ratios)."""
    modes, bares = pairs["modes"], pairs["bare"]
    ratios = pair_ratios([m["tokens_per_s"] for m in modes], [b["tokens_per_s"] for b in bares])
    for k, (m, r) in enumerate(zip(modes, ratios)):
        a, b = bares[k], bares[k + 1]
        print(f"pair {k + 1}: bare {a['tokens_per_s']:.0f} / continuous {m['tokens_per_s']:.0f} / bare "
              f"{b['tokens_per_s']:.0f} tokens/s (median vLLM step {a['window']['step_ms'] or 0:.2f} / "
              f"{m['window']['step_ms'] or 0:.2f} / {b['window']['step_ms'] or 0:.2f} ms; windows "
              f"{a['wall_s']:.1f} / {m['wall_s']:.1f} / {b['wall_s']:.1f} s; {m['updates']} updates, "
              f"{m['groups']} groups): continuous / mean of its bare neighbours = {r:.3f}")
    return ratios
