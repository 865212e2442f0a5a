"""`python -m oppo_lab convergence`: does OPPO learn what sync PPO learns, per step and per second?

The command line: runs (or reuses, or only reads) every run (`runs`), reads and summarizes
them (`read`, `summary`), the learn task's final evaluation (`final_eval`), then the table,
`convergence.json` and the PNGs (`report`). See `oppo_lab.convergence`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from openrlhf_oppo.tasks import learn
from openrlhf_oppo.tasks.learn.rollouts import Baseline, load_baseline, load_tokenizer
from oppo_lab.convergence import final_eval
from oppo_lab.convergence.numbers import THRESHOLD_FRACTION, WINDOW_STEPS
from oppo_lab.convergence.read import read_run
from oppo_lab.convergence.report import plot, print_report
from oppo_lab.convergence.runs import (
    DEFAULT_SCHEDULES,
    VARIANTS,
    default_tokenizer,
    resolve,
    run_all,
    task_root,
)
from oppo_lab.convergence.summary import summarize


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m oppo_lab convergence", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/learn-cpu.yaml", help="YAML run config")
    p.add_argument("--seeds", type=int, default=3,
                   help="seeds per schedule (--train.seed first-seed, first-seed+1, ...)")
    p.add_argument("--first-seed", type=int, default=0, help="the first --train.seed")
    p.add_argument("--schedules", nargs="+", default=list(DEFAULT_SCHEDULES),
                   help=f"schedules (and {', '.join(VARIANTS)}); the first is the reference")
    p.add_argument("--output", default="runs/bench-convergence", help="one run directory per schedule and seed")
    p.add_argument("--threshold", type=float, default=None,
                   help=f"reward of time-to-reward (default: {THRESHOLD_FRACTION * 100:.0f}%% of the way from the "
                        "first schedule's first moving average of the reward to its best, median over seeds)")
    p.add_argument("--window", type=int, default=WINDOW_STEPS,
                   help="steps of the moving average of the curves, of time-to-reward and of the final figures")
    p.add_argument("--tokenizer", default=None, help="decodes responses (default: the config's task assets/tokenizer)")
    p.add_argument("--same-samples", action=argparse.BooleanOptionalAction, default=True,
                   help="--train.full_determinism_enable for every run (seeded requests and prompt order)")
    p.add_argument("--timeout-s", type=float, default=None, help="per run (default: none)")
    p.add_argument("--final-eval", action=argparse.BooleanOptionalAction, default=True,
                   help="learn task: the SFT policy and every run's final actor on held-out prompts")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: summarize the runs already under --output (<schedule>-s<seed>)")
    p.add_argument("--keep-done", action="store_true",
                   help="reuse the runs under --output that finished (result.json with exit 0) instead of running "
                        "them again; run the rest (a bench cut short, or a schedule added to an earlier one)")
    p.add_argument("extra", nargs="*", help="after `--`: extra OpenRLHF flags for every run")
    return p


def _sft_baseline(config: str) -> Baseline | None:
    """The SFT policy's per-prompt baseline of a learn-task config (None for another task,
    or where the assets predate it: said)."""
    variant, assets_root = task_root(config)
    if variant not in learn.VARIANTS:
        return None
    baseline_path = learn.LearnAssets(assets_root).sft_baseline
    baseline = load_baseline(baseline_path)
    if baseline is None:
        print(f"[bench convergence] no {baseline_path} (assets built before it existed: openrlhf-oppo prepare "
              f"--variant {variant} --force): no reward gain over the SFT policy", flush=True)
    return baseline


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    try:
        variants = {name: resolve(name) for name in args.schedules}
    except ValueError as e:
        p.error(str(e))
    if args.seeds < 1:
        p.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.window < 1:
        p.error(f"--window must be >= 1, got {args.window}")
    if any(a == "--train.seed" or a.startswith("--train.seed=") for a in args.extra):
        p.error("--train.seed after `--`: the bench sets it per run (--seeds, --first-seed)")

    out = Path(args.output)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    extra = [*args.extra, *(["--train.full_determinism_enable"] if args.same_samples else [])]
    results, stopped_code = run_all(args.config, out, args.schedules, seeds, variants, extra, args.timeout_s,
                                    args.keep_done, args.report_only)
    if stopped_code is not None:
        return stopped_code

    tokenizer = Path(args.tokenizer).expanduser() if args.tokenizer else default_tokenizer(args.config)
    text = load_tokenizer(tokenizer) if tokenizer.is_dir() else None
    if text is None:
        print(f"[bench convergence] no tokenizer at {tokenizer}: no response lengths, exact match or KS", flush=True)
    baseline = _sft_baseline(args.config)
    for name, by_seed in results.items():
        for seed, result in by_seed.items():
            if result["returncode"] == 0:
                result.update(read_run(out / f"{name}-s{seed}", text, baseline))
            else:
                result["steps"] = 0
    summary = summarize(results, args.threshold, args.window)
    print_report(summary)
    final = final_eval.evaluate(args.config, out, results) if args.final_eval else None
    if final:
        final_eval.print_table(final)
    out.mkdir(parents=True, exist_ok=True)
    (out / "convergence.json").write_text(json.dumps(
        {"config": args.config, "seeds": seeds, "schedules": args.schedules,
         "variants": {n: {"schedule": v.schedule, "flags": list(v.flags)} for n, v in variants.items()},
         "tokenizer": str(tokenizer) if text else None, "summary": summary, "final_eval": final,
         "runs": {n: {str(seed): r for seed, r in by_seed.items()} for n, by_seed in results.items()}}, indent=1))
    for path in plot(summary, results, out):
        print(f"wrote {path}")
    print(f"summary: {out / 'convergence.json'}")
    return 0 if all(r["returncode"] == 0 for by_seed in results.values() for r in by_seed.values()) else 1
