"""`python -m oppo_lab core`: CPU cost of the scheduler itself at cluster scale.

One step = 1,024 prompt groups x n=4 samples with long-tail lengths up to 16k
tokens, decoded round by round, one `on_tokens` event per sample per chunk of C
tokens (a fresh ``array("i")`` each, as the rollout actors send vLLM's deltas),
every chunk acknowledged by two scorers. Only the scheduler calls are timed (engine
bookkeeping is excluded). Each C runs ``--repeats`` times, interleaved with the
other C values so that a shared machine's load drifts over all of them alike;
medians pool the steps of every repeat. Prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time

from openrlhf_oppo.config import ChunkConfig, DeltaConfig, OppoConfig, StreamingConfig
from openrlhf_oppo.core import OverlapScheduler, StepStats
from oppo_lab.synthetic import LengthModel, SyntheticRollout, feed_round


class _GcClock:
    """CPU time spent in the cyclic garbage collector (its pauses land inside timed calls or not)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self.in_calls_s = 0.0  # the part that paused a timed scheduler call
        self.timing = False  # set while a scheduler call is timed
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.process_time()
        else:
            spent = time.process_time() - self._start
            self.total_s += spent
            if self.timing:
                self.in_calls_s += spent


def _one_run(groups: int, n: int, chunk: int, delta: int, steps: int, max_len: int, seed: int) -> dict:
    cfg = OppoConfig(
        delta=DeltaConfig(init=delta, min=0, max=max(delta, 1), adaptive=False),
        chunk=ChunkConfig(size_tokens=chunk),
        streaming=StreamingConfig(reward=True, reference=True),
    )
    sched = OverlapScheduler(cfg, batch_groups=groups, samples_per_group=n)
    engine = SyntheticRollout(LengthModel(max_tokens=max_len), random.Random(seed))
    per_step_s, gc_in_calls_s, events, tokens = [], [], 0, 0
    gc_clock = _GcClock()
    gc.callbacks.append(gc_clock)
    for step in range(steps):
        spent, gc_before = 0.0, gc_clock.in_calls_s
        gc_clock.timing = True
        t = time.process_time()
        plan = sched.begin_step(step)
        spent += time.process_time() - t
        gc_clock.timing = False
        engine.admit(plan)
        batch, rounds, generated = None, 0, 0
        while batch is None:
            evs = engine.round(chunk)
            gc_clock.timing = True
            t = time.process_time()
            feed_round(sched, evs, step)
            batch = sched.take_batch()
            spent += time.process_time() - t
            gc_clock.timing = False
            events += len(evs)
            generated += sum(len(x[1]) for x in evs)
            rounds += 1
        gc_clock.timing = True
        t = time.process_time()
        sched.end_step(StepStats(0.0, generated, float(rounds)))
        spent += time.process_time() - t
        gc_clock.timing = False
        per_step_s.append(spent)
        gc_in_calls_s.append(gc_clock.in_calls_s - gc_before)
        tokens += generated
    gc.callbacks.remove(gc_clock)
    return {
        "ms_per_step": [s * 1e3 for s in per_step_s],
        "gc_in_calls_ms_per_step": [s * 1e3 for s in gc_in_calls_s],
        "gc_ms_per_step": gc_clock.total_s * 1e3 / steps,  # includes pauses outside the timed calls
        "events": events,
        "tokens": tokens,
        "cpu_s": sum(per_step_s),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oppo_lab core", description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=1024, help="prompt groups per step (B)")
    p.add_argument("--n", type=int, default=4, help="samples per group")
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[512, 256, 128], help="C values (tokens) to run")
    p.add_argument("--delta", type=int, default=64, help="overcommit Δ (groups)")
    p.add_argument("--steps", type=int, default=12, help="steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per C, interleaved across the C values")
    p.add_argument("--max-len", type=int, default=16384, help="longest response (tokens)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    print(
        f"scheduler core: {args.groups} groups x n={args.n}, Δ={args.delta}, lengths log-normal "
        f"(median 1000) clipped to {args.max_len}, 2 streaming scorers, {args.steps} steps x {args.repeats} runs per C"
    )
    print(
        "ms/step: process CPU inside scheduler calls, Python's cyclic GC pauses included (gc in calls: that part); "
        "gc total: all GC time in the step, outside the calls too"
    )
    print(f"load average at start: {_load()}")
    runs: dict[int, list[dict]] = {c: [] for c in args.chunk_sizes}
    for _ in range(args.repeats):
        for c in args.chunk_sizes:
            runs[c].append(_one_run(args.groups, args.n, c, args.delta, args.steps, args.max_len, args.seed))
    print(
        f"{'C':>6} {'ms/step median':>15} {'ms/step max':>12} {'run medians':>20} {'gc in calls':>12} "
        f"{'gc total':>9} {'events/s':>10} {'tokens/step':>12}"
    )
    results = {}
    for c, rs in runs.items():
        ms = [x for r in rs for x in r["ms_per_step"]]
        med = statistics.median(ms)
        results[c] = med
        run_medians = " ".join(f"{statistics.median(r['ms_per_step']):.0f}" for r in rs)
        gc_in_calls = statistics.median([x for r in rs for x in r["gc_in_calls_ms_per_step"]])
        gc_total = statistics.mean(r["gc_ms_per_step"] for r in rs)
        events_per_s = sum(r["events"] for r in rs) / sum(r["cpu_s"] for r in rs)
        tokens = rs[0]["tokens"] // args.steps
        print(
            f"{c:>6} {med:>15.1f} {max(ms):>12.1f} {run_medians:>20} {gc_in_calls:>12.1f} {gc_total:>9.1f} "
            f"{events_per_s:>10,.0f} {tokens:>12,}"
        )
    print(f"load average at end: {_load()}")
    for c, med in results.items():
        print(f"C={c}: {med:.1f} ms/step vs target 50 ms -> ratio {med / 50:.2f} ({'met' if med < 50 else 'NOT met'})")
    return 0


def _load() -> str:
    """1, 5 and 15 minute load averages: on a shared machine, CPU times grow with them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


if __name__ == "__main__":
    raise SystemExit(main())
