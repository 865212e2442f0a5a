"""`python -m oppo_lab control-plane`: does OPPO's driver keep up with a GPU cluster's token rate?

    python -m oppo_lab control-plane [--engines 8 --sequences 128 --tokens-per-s 40 --prompts 1024
        --samples 4 --chunk 256 32 --output runs/control-plane] [--profile] [--smoke]

Runs the real samples generator (`OppoSamplesGenerator` with its `EnginePool`,
`ScorerDispatcher`, `StepMeter` and scheduler core) in this process, against real Ray actors
whose engine is synthetic (`actors.SyntheticEngine`: `OppoRolloutActor`'s interface and outbox,
tokens emitted on a clock at `--tokens-per-s` per sequence, `--sequences` at once per engine,
long-tail lengths from `bench.synthetic.LengthModel`) and whose reward actors acknowledge every
chunk at once (or after `--scorer-us-per-token` per token). One OPPO step of B = `--prompts`
groups × `--samples` (Δ = 0) per chunk size C. Prints, per C: the driver process's CPU
(`time.process_time`: Ray's threads in it included) per 1,000 tokens and in cores, Ray
messages per second (the generator's actor calls and their replies), the tokens per second
received against the target emission rate, and every token's lag from its emission on an
engine to its chunk's arrival on a scorer. Writes `control_plane.json` (and with `--profile`,
cProfile's top functions of the driver per C) to `--output`. The target: the driver keeps up
(receives >= 95 % of what the engines emitted while they were full) using under half a core.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

from oppo_lab.synthetic import LengthModel

SMOKE = {"engines": 2, "sequences": 8, "tokens_per_s": 400.0, "prompts": 16, "samples": 2, "scorers": 2,
         "prompt_tokens": 16, "lengths": LengthModel(median_tokens=48, sigma=0.9, min_tokens=4, max_tokens=200)}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m oppo_lab control-plane", description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=8, help="synthetic rollout engines (Ray actors)")
    p.add_argument("--sequences", type=int, default=128, help="sequences each engine decodes at once")
    p.add_argument("--tokens-per-s", type=float, default=40.0, help="decode rate of one sequence (tokens/s)")
    p.add_argument("--prompts", type=int, default=1024, help="prompt groups of the step (B)")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (n)")
    p.add_argument("--chunk", type=int, nargs="+", default=[256, 32], help="chunk sizes C (tokens), one run each")
    p.add_argument("--scorers", type=int, default=4, help="streaming reward actors")
    p.add_argument("--scorer-us-per-token", type=float, default=0.0,
                   help="a chunk token's fixed cost on its reward actor (µs, slept); 0: acknowledged at once")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (tokens)")
    p.add_argument("--median-tokens", type=int, default=1000, help="median response length (log-normal)")
    p.add_argument("--max-tokens", type=int, default=16384, help="longest response (tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drain", choices=("all", "due"), default="all",
                   help="what an engine hands over when the driver wakes: all: every sample's new tokens (the "
                        "product's outbox); due: only samples with a chunk due or finished (an experiment)")
    p.add_argument("--profile", action="store_true", help="cProfile the driver (its CPU figures then include cProfile)")
    p.add_argument("--smoke", action="store_true",
                   help="a seconds-long run for tests: 2 engines x 8 sequences x 400 tokens/s, 16 prompts x 2, "
                        "responses of median 48 up to 200 tokens, 2 scorers (overrides those flags)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.add_argument("--output", default="runs/control-plane", help="directory for control_plane.json")
    return p.parse_args(argv)


def workload(args: argparse.Namespace):
    from oppo_lab.control_plane.driver import Workload

    w = Workload(engines=args.engines, sequences=args.sequences, tokens_per_s=args.tokens_per_s,
                 prompts=args.prompts, samples=args.samples, scorers=args.scorers,
                 scorer_us_per_token=args.scorer_us_per_token, prompt_tokens=args.prompt_tokens,
                 lengths=LengthModel(median_tokens=args.median_tokens, max_tokens=args.max_tokens), seed=args.seed,
                 drain=args.drain)
    return replace(w, **SMOKE) if args.smoke else w


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    w = workload(args)
    import ray

    from oppo_lab.control_plane.driver import run_step
    from oppo_lab.control_plane.figures import figures

    lengths = w.response_lengths()
    print(f"control plane: {w.engines} engines x {w.sequences} sequences x {w.tokens_per_s:g} tokens/s "
          f"(target {w.target_tokens_per_s:,.0f} tokens/s), {w.prompts} prompts x {w.samples} samples, "
          f"{sum(lengths.values()):,} response tokens (median {w.lengths.median_tokens}, up to "
          f"{max(lengths.values()):,}), {w.scorers} scorers at {w.scorer_us_per_token:g} µs/token, drain {w.drain}; "
          f"{os.cpu_count()} CPUs, load {_load()}", flush=True)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    ray.init(address="local", include_dashboard=False, logging_level="WARNING", configure_logging=False)
    try:
        for c in args.chunk:
            print(f"C = {c}: running", file=sys.stderr, flush=True)
            raw = run_step(w, c, progress=not args.no_progress, profile=args.profile)
            fig = figures(raw, w, c)
            if raw["profile"]:
                (out_dir / f"profile_C{c}.txt").write_text(raw["profile"])
                fig["profile_file"] = str(out_dir / f"profile_C{c}.txt")
            results.append(fig)
    finally:
        ray.shutdown()
    print_table(results)
    (out_dir / "control_plane.json").write_text(json.dumps(
        {"workload": asdict(w), "host": {"cpus": os.cpu_count(), "load_at_end": _load()}, "runs": results},
        indent=1))
    print(f"wrote {out_dir / 'control_plane.json'}")
    ok = all(r["checks"]["samples_exact"] == r["checks"]["samples"] and not r["checks"]["scorer_errors"]
             for r in results)
    if not ok:
        print("control plane: some sample's tokens did not reach its scorer exactly once and in order "
              "(see checks in the JSON)", file=sys.stderr)
    return 0 if ok else 1


def print_table(results: list[dict]) -> None:
    head = (f"{'C':>5} {'tok/s full':>11} {'target':>8} {'emitted':>8} {'received':>8} {'cores full':>10} "
            f"{'cores all':>9} {'CPU ms/1k tok':>13} {'Ray msg/s':>9} {'lag p50 ms':>10} {'p95 ms':>8} "
            f"{'max ms':>8} {'exact':>11} {'target met':>10}")
    print(head)
    for r in results:
        f, lag, ch = r["full"], r["lag_ms"], r["checks"]
        print(f"{r['chunk_tokens']:>5} {f['tokens_per_s']:>11,.0f} {r['target_tokens_per_s']:>8,.0f} "
              f"{f['emitted_tokens_per_s']:>8,.0f} {f['received_share']:>8.1%} {f['driver_cores']:>10.2f} "
              f"{r['driver_cores']:>9.2f} {r['driver_cpu_ms_per_1k_tokens']:>13.1f} {r['ray_messages_per_s']:>9,.0f} "
              f"{lag['p50']:>10.0f} {lag['p95']:>8.0f} {lag['max']:>8.0f} "
              f"{ch['samples_exact']:>5}/{ch['samples']:<5} {'yes' if r['target_met'] else 'NO':>10}")
    print("tok/s full: received by the driver while every engine was full; emitted: what the engines managed "
          "then; received: its share; cores: driver process CPU / wall (full window; whole streaming phase); "
          "CPU ms/1k tok and Ray msg/s: whole streaming phase; lag: engine emission -> chunk on its scorer, "
          "every token; exact: samples whose tokens reached the scorer once each, in order")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
