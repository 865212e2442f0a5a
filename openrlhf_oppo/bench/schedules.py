"""`openrlhf-oppo bench schedules`: OpenRLHF's own modes and OPPO's, same config, interleaved.

Runs `openrlhf-oppo train --schedule S` for every schedule, `--repeats` times, in the
order s1 s2 … s1 s2 … so that a shared machine's drift hits every schedule alike.
Each run is a real training run (the baselines are OpenRLHF's own code). With
`--same-samples` (default) every run gets `--train.full_determinism_enable`: seeded
requests and prompt order, so all schedules start from the same prompts and tokens.

Per run: step latency is the median wall-clock gap between consecutive steps'
TensorBoard events after the first `--warmup-steps` (start-up, vLLM's and DeepSpeed's
first-call compilation: OpenRLHF's sync schedule spends seconds in its second
generation, once per run); tokens/s is response tokens decoded per second over those steps (timeline);
`wall` is the whole run, process start-up included. Per schedule every figure is the
median over repeats with its spread (min–max over repeats); ratios are against the
first schedule (`sync`) and against the best of OpenRLHF's own modes, with the spread
of the same ratio taken repeat by repeat. The `oracle` row is the lower bound of the
OPPO runs' own samples (see `oracle_step_s`). Writes `summary.json`; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
from pathlib import Path

from openrlhf_oppo import timeline
from openrlhf_oppo.bench.table import Spread, fmt, spread, table_line
from openrlhf_oppo.integrations.launch.schedules import SCHEDULES

STEP_TAG = "train/policy_loss"  # logged once per PPO step by every schedule
DEFAULT_SCHEDULES = ("sync", "async", "partial", "oversample", "oppo-intra", "oppo-inter", "oppo-fixed", "oppo")
OPPO_KEYS = ("oppo/overlap_fraction", "oppo/scorer_idle_fraction", "oppo/deferred_fraction")
FIGURES = ("step_s", "mean_step_s", "tokens_per_s", "wall_s", "reward", *OPPO_KEYS, "oracle_s")


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


def oracle_step_s(rows: list[dict], trace: list[dict], step_walls: list[float]) -> list[float]:
    """Lower bound of each OPPO step (after the first) for the samples it trained:
    decoding of its trained groups from the step's start (the slowest of them: a group
    carried in finished earlier and costs nothing) + the reward actors' last scoring
    call before the batch + the actor's training. Everything else a step spends
    (driver round trips, experience making, pause/resume, weight sync) is overhead."""
    finish = {r["sample"]: r["t1"] for r in rows if r["kind"] == "sample" and "sample" in r}
    generates = timeline.stage_spans(rows, "driver", "generate")
    starts, ends = [r["t0"] for r in generates], [r["t1"] for r in generates]
    trains = timeline.stage_spans(rows, "actor", "train")
    scores = timeline.stage_spans(rows, "reward", "score")
    out = []
    for k, row in enumerate(trace[:len(starts)]):
        if k == 0 or (step_walls and ends[k] < step_walls[0]):
            continue  # warm-up
        s0, s1 = starts[k], ends[k]
        sample_ids = [s["sample_id"] for g in row["trained"] for s in g["samples"]]
        if any(sid not in finish for sid in sample_ids):
            continue  # a response of this batch has no span (killed run): no bound
        decode = max(0.0, max(finish[sid] for sid in sample_ids) - s0)
        last_score = max((r for r in scores if r["t1"] <= s1 + 1e-3), key=lambda r: r["t1"], default=None)
        score = last_score["t1"] - last_score["t0"] if last_score and last_score["t1"] >= s0 else 0.0
        train = next((r["t1"] - r["t0"] for r in trains if r["t0"] >= s1), 0.0)
        out.append(decode + score + train)
    return out


def summarize_run(root: Path, warmup_steps: int = 2) -> dict:
    """Per-run figures from a run directory written by `openrlhf-oppo train`; the first
    `warmup_steps` steps are left out of the step latency and tokens/s."""
    scalars = tensorboard_scalars(root / "tensorboard")
    walls = [w for w, _, _ in scalars.get(STEP_TAG, [])][max(0, warmup_steps - 1):]
    step_s = [b - a for a, b in zip(walls, walls[1:], strict=False)]
    rows = timeline.read(root / "timeline") if (root / "timeline").is_dir() else []
    tokens = sum(r["tokens"] for r in rows
                 if r["kind"] == "sample" and len(walls) > 1 and walls[0] <= r["t1"] <= walls[-1])
    summary = {
        "steps": len(scalars.get(STEP_TAG, [])),
        "step_s": step_s,
        "median_step_s": statistics.median(step_s) if step_s else None,
        "mean_step_s": statistics.fmean(step_s) if step_s else None,  # = time per step: what time-to-reward sees
        "tokens_per_s": tokens / (walls[-1] - walls[0]) if len(walls) > 1 and rows else None,
        "reward": statistics.fmean(v for _, _, v in scalars["train/reward"]) if scalars.get("train/reward") else None,
    }
    metrics = root / "oppo_metrics.jsonl"
    if metrics.exists():
        lines = [json.loads(line) for line in metrics.read_text().splitlines()]
        for key in OPPO_KEYS:
            values = [r[key] for r in lines if key in r]
            summary[key] = statistics.median(values) if values else None
    trace = root / "oppo_trace.jsonl"
    if trace.exists() and rows:
        bounds = oracle_step_s(rows, [json.loads(line) for line in trace.read_text().splitlines()], walls)
        summary["oracle_s"] = statistics.median(bounds) if bounds else None
    return summary


def _figure(runs: list[dict], key: str) -> Spread:
    per_run = "median_step_s" if key == "step_s" else key
    return spread([r[per_run] for r in runs if r.get(per_run) is not None])


def _ratio(base: list[dict], runs: list[dict], key: str = "median_step_s") -> Spread:
    """base `key` / this schedule's, repeat by repeat (a repeat missing either is left out)."""
    pairs = [(b.get(key), r.get(key)) for b, r in zip(base, runs, strict=False)]
    return spread([b / r for b, r in pairs if b and r])


def report(results: dict[str, list[dict]]) -> list[dict]:
    """One row per schedule (+ `oracle`): every figure as (median, min, max) over repeats."""
    ok = {s: [r if r["returncode"] == 0 else {} for r in runs] for s, runs in results.items()}
    rows = []
    for schedule, runs in ok.items():
        good = [r for r in runs if r]
        row = {"schedule": schedule, "runs_ok": f"{len(good)}/{len(runs)}"}
        row.update({key: _figure(good, key) for key in FIGURES})
        rows.append(row)
    first = next(iter(ok), None)
    # the best of OpenRLHF's own modes by time per step (mean): a mode that trains two
    # batches per generation (over-sampling) has a bimodal step latency, whose median misleads
    baselines = [s for s in ok if not SCHEDULES[s].entry_module.startswith("openrlhf_oppo")]
    best = min(baselines, key=lambda s: _figure([r for r in ok[s] if r], "mean_step_s")[0] or float("inf"),
               default=None)
    for row in rows:
        row["x_first"] = _ratio(ok[first], ok[row["schedule"]])
        row["x_best"] = _ratio(ok[best], ok[row["schedule"]], "mean_step_s") if best else (None, None, None)
    # repeat by repeat, a failed oppo run leaving a gap ({}) so that repeats stay paired
    oracle = [{"median_step_s": r["oracle_s"], "mean_step_s": r["oracle_s"]} if r.get("oracle_s") else {}
              for r in ok.get("oppo", [])]
    if any(oracle):
        rows.append({"schedule": "oracle", "runs_ok": "-", "step_s": _figure([o for o in oracle if o], "step_s"),
                     "x_first": _ratio(ok[first], oracle),
                     "x_best": _ratio(ok[best], oracle, "mean_step_s") if best else (None,) * 3,
                     **{k: (None,) * 3 for k in FIGURES if k != "step_s"}})
    return [dict(row, first=first, best=best) for row in rows]


def print_report(rows: list[dict]) -> None:
    first, best = rows[0]["first"], rows[0]["best"]
    cols = [("schedule", 11), ("runs", 5), ("step s", 18), (f"x {first}", 18), ("mean step s", 18), (f"x {best}", 18),
            ("tok/s", 16), ("wall s", 12), ("reward", 8), ("overlap", 8), ("idle", 6), ("deferred", 8)]
    widths = [w for _, w in cols]
    print(table_line([name for name, _ in cols], widths))
    for r in rows:
        cells = [r["schedule"], r["runs_ok"], fmt(r["step_s"], ".2f"), fmt(r["x_first"], ".2f"),
                 fmt(r["mean_step_s"], ".2f"), fmt(r["x_best"], ".2f"), fmt(r["tokens_per_s"], ".0f"),
                 fmt(r["wall_s"], ".0f"),
                 fmt(r["reward"], ".3f", False), fmt(r["oppo/overlap_fraction"], ".2f", False),
                 fmt(r["oppo/scorer_idle_fraction"], ".2f", False), fmt(r["oppo/deferred_fraction"], ".2f", False)]
        print(table_line(cells, widths))
    print(f"step s: median over repeats of each run's median wall-clock seconds between consecutive steps "
          f"(warm-up steps left out), [min-max over repeats]; x {first}: its step s / this one's, repeat by repeat "
          f"(above 1 = faster); mean step s: time per step (over-sampling trains two batches per generation: its "
          f"median is bimodal); x {best}: mean step s of the fastest of OpenRLHF's own modes / this one's; oracle: "
          f"the lower "
          "bound of the oppo runs' own batches (decode of the trained groups + last scoring call + actor training)")


def stopped(bench: str, run, done: int, total: int, resume: str = "") -> int | None:
    """The bench's exit code when a signal (Ctrl-C, SIGTERM) stopped its current run, else
    None. The launcher ends that run gracefully and returns; without this check the bench
    would go on to its next run."""
    if not run.stopped_by:
        return None
    print(f"[bench {bench}] stopped by {signal.Signals(run.stopped_by).name} in run {done}/{total}: "
          f"no further runs{resume}", flush=True)
    return 128 + run.stopped_by


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
    p.add_argument("--warmup-steps", type=int, default=2, help="steps left out of the step latency (>= 1)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: summarize the runs already under --output (<schedule>-<repeat>)")
    p.add_argument("extra", nargs="*", help="after `--`: extra OpenRLHF flags for every run")
    args = p.parse_args(argv)
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown:
        p.error(f"--schedules: unknown {', '.join(unknown)}; allowed: {', '.join(SCHEDULES)}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.warmup_steps < 1:
        p.error(f"--warmup-steps must be >= 1, got {args.warmup_steps}")

    from openrlhf_oppo.integrations.launch import train_run as train

    extra = [*args.extra, *(["--train.full_determinism_enable"] if args.same_samples else [])]
    out = Path(args.output)
    results: dict[str, list[dict]] = {s: [] for s in args.schedules}
    order = [(rep, schedule) for rep in range(args.repeats) for schedule in args.schedules]
    for i, (rep, schedule) in enumerate(order, 1):
        root = out / f"{schedule}-{rep}"
        if args.report_only:
            result = json.loads((root / "result.json").read_text()) if (root / "result.json").exists() else {}
            returncode = result.get("returncode", 0 if (root / "tensorboard").is_dir() else 1)
            wall_s = result.get("wall_s")
        else:
            print(f"[bench schedules] run {i}/{len(order)}: {schedule} -> {root}", flush=True)
            run = train.run(["--schedule", schedule, "--config", args.config, "--output", str(root),
                             "--timeout-s", str(args.timeout_s), *(["--", *extra] if extra else [])])
            returncode, wall_s = run.returncode, run.wall_s
            (root / "result.json").write_text(json.dumps({"returncode": returncode, "wall_s": wall_s}))
            if (code := stopped("schedules", run, i, len(order))) is not None:
                return code
        summary = summarize_run(root, args.warmup_steps) if returncode == 0 else {"steps": 0, "step_s": []}
        results[schedule].append({"returncode": returncode, "wall_s": wall_s, **summary})
    rows = report(results)
    print_report(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"rows": rows, "runs": results}, indent=1))
    print(f"summary: {out / 'summary.json'}")
    return 0 if all(r["returncode"] == 0 for runs in results.values() for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
