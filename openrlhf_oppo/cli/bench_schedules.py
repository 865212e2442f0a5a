"""`openrlhf-oppo bench schedules`: OpenRLHF's own modes and OPPO's, same config, interleaved.

Runs `openrlhf-oppo train --schedule S` for every schedule, `--repeats` times, in the
order s1 s2 … s1 s2 … so that a shared machine's drift hits every schedule alike.
Each run is a real training run (the baselines are OpenRLHF's own code). With
`--same-samples` (default) every run gets `--train.full_determinism_enable`: seeded
requests and prompt order, so all schedules start from the same prompts and tokens.

Step latency is the wall-clock gap between consecutive steps' TensorBoard events
(the first step, which carries start-up and compilation, is left out); `wall` is the
whole run, process start-up included. Prints medians and ratios against the first
schedule (`sync` by default) and writes `summary.json`; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from openrlhf_oppo.integrations.schedules import SCHEDULES

STEP_TAG = "train/policy_loss"  # logged once per PPO step by every schedule
DEFAULT_SCHEDULES = ("sync", "async", "partial", "oversample", "oppo-intra", "oppo-inter", "oppo")


def tensorboard_scalars(tb_dir: Path) -> dict[str, list[tuple[float, int, float]]]:
    """tag -> [(wall_time, step, value)] from every event file under `tb_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[float, int, float]]] = {}
    for events in sorted(tb_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.wall_time, e.step, e.value) for e in acc.Scalars(tag))
    return {tag: sorted(v) for tag, v in out.items()}


def summarize_run(root: Path) -> dict:
    """Per-run figures from a run directory written by `openrlhf-oppo train`."""
    scalars = tensorboard_scalars(root / "tensorboard")
    steps = scalars.get(STEP_TAG, [])
    walls = [w for w, _, _ in steps]
    summary = {
        "steps": len(steps),
        "step_s": [b - a for a, b in zip(walls, walls[1:])],
        "reward": statistics.fmean(v for _, _, v in scalars["train/reward"]) if scalars.get("train/reward") else None,
    }
    metrics = root / "oppo_metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        for key in ("oppo/overlap_fraction", "oppo/scorer_idle_fraction", "oppo/deferred_fraction"):
            values = [r[key] for r in rows if key in r]
            summary[key] = statistics.median(values) if values else None
    return summary


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(results: dict[str, list[dict]]) -> list[dict]:
    """One row per schedule: pooled step-latency median, ratio to the first schedule's."""
    rows = []
    for schedule, runs in results.items():
        ok = [r for r in runs if r["returncode"] == 0]
        rows.append({
            "schedule": schedule,
            "runs_ok": f"{len(ok)}/{len(runs)}",
            "steps": _median([r["steps"] for r in ok]),
            "step_s": _median([s for r in ok for s in r["step_s"]]),
            "wall_s": _median([r["wall_s"] for r in ok]),
            "reward": _median([r["reward"] for r in ok if r["reward"] is not None]),
            **{k: _median([r[k] for r in ok if r.get(k) is not None])
               for k in ("oppo/overlap_fraction", "oppo/scorer_idle_fraction", "oppo/deferred_fraction")},
        })
    base = rows[0]["step_s"] if rows else None
    for row in rows:
        row["speedup"] = base / row["step_s"] if base and row["step_s"] else None
    return rows


def print_report(rows: list[dict]) -> None:
    base = rows[0]["schedule"]
    print(f"{'schedule':<11} {'runs':>5} {'steps':>5} {'step s':>7} {f'x vs {base}':>9} {'wall s':>7} "
          f"{'reward':>7} {'overlap':>7} {'idle':>5} {'deferred':>8}")
    for r in rows:
        print(f"{r['schedule']:<11} {r['runs_ok']:>5} {_fmt(r['steps'], '.0f'):>5} {_fmt(r['step_s'], '.2f'):>7} "
              f"{_fmt(r['speedup'], '.2f'):>9} {_fmt(r['wall_s'], '.0f'):>7} {_fmt(r['reward'], '.3f'):>7} "
              f"{_fmt(r['oppo/overlap_fraction'], '.2f'):>7} {_fmt(r['oppo/scorer_idle_fraction'], '.2f'):>5} "
              f"{_fmt(r['oppo/deferred_fraction'], '.2f'):>8}")
    print("step s: median wall-clock seconds between consecutive steps (first step left out); "
          f"x vs {base}: its step s / this one's (above 1 = faster)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="openrlhf-oppo bench schedules", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny-cpu.yaml", help="YAML run config")
    p.add_argument("--schedules", nargs="+", default=list(DEFAULT_SCHEDULES),
                   help="schedules to run; ratios are against the first")
    p.add_argument("--repeats", type=int, default=1, help="runs per schedule, interleaved")
    p.add_argument("--output", default="runs/bench-schedules", help="one run directory per schedule and repeat")
    p.add_argument("--same-samples", action=argparse.BooleanOptionalAction, default=True,
                   help="--train.full_determinism_enable for every run (seeded requests and prompt order)")
    p.add_argument("--timeout-s", type=float, default=900, help="per run")
    p.add_argument("extra", nargs="*", help="after `--`: extra OpenRLHF flags for every run")
    args = p.parse_args(argv)
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown:
        p.error(f"--schedules: unknown {', '.join(unknown)}; allowed: {', '.join(SCHEDULES)}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")

    from openrlhf_oppo.cli import train

    extra = [*args.extra, *(["--train.full_determinism_enable"] if args.same_samples else [])]
    out = Path(args.output)
    results: dict[str, list[dict]] = {s: [] for s in args.schedules}
    order = [(rep, schedule) for rep in range(args.repeats) for schedule in args.schedules]
    for i, (rep, schedule) in enumerate(order, 1):
        root = out / f"{schedule}-{rep}"
        print(f"[bench schedules] run {i}/{len(order)}: {schedule} -> {root}", flush=True)
        run = train.run(["--schedule", schedule, "--config", args.config, "--output", str(root),
                         "--timeout-s", str(args.timeout_s), *(["--", *extra] if extra else [])])
        summary = summarize_run(root) if run.returncode == 0 else {"steps": 0, "step_s": [], "reward": None}
        results[schedule].append({"returncode": run.returncode, "wall_s": run.wall_s, **summary})
    rows = report(results)
    print_report(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"rows": rows, "runs": results}, indent=1))
    print(f"summary: {out / 'summary.json'}")
    return 0 if all(r["returncode"] == 0 for runs in results.values() for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
