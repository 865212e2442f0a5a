"""`openrlhf-oppo bench schedules`: OpenRLHF's own modes and OPPO's, same config, interleaved.

Runs `openrlhf-oppo train --schedule S` for every schedule, `--repeats` times, in the
order s1 s2 … s1 s2 … so that a shared machine's drift hits every schedule alike.
Each run is a real training run (the baselines are OpenRLHF's own code). With
`--same-samples` (default) every run gets `--train.full_determinism_enable`: seeded
requests and prompt order, so all schedules start from the same prompts and tokens.

Per run, over the measured steps (every step after the first `--warmup-steps`: start-up,
vLLM's and DeepSpeed's first-call compilation; OpenRLHF's sync schedule spends seconds in
its second generation, once per run), from the TensorBoard events of tag `train/policy_loss`
(one per PPO step, every schedule):
  mean step s     mean of the wall-clock gaps between consecutive steps' events: time per
                  step, what time-to-reward sees (the lead figure);
  trained tok/s   response tokens trained in those steps / their wall-clock seconds (last
                  event - first); a step's trained tokens are OpenRLHF's own per-step
                  `train/rollout/response_length_mean` x `train/rollout/num_samples`, so
                  decoding that is never trained (carried, dropped, over-sampled) does not count;
  median step s   median of the same gaps (over-sampling trains two batches per generation:
                  its gaps are bimodal and their median flatters it);
  wall s          the whole run, process start-up included;
  reward          mean of `train/reward` over the run;
  overlap, idle, deferred  OPPO's `oppo/overlap_fraction`, `oppo/scorer_idle_fraction`,
                  `oppo/deferred_fraction` (oppo_metrics.jsonl), median over the run's steps;
  cores busy, CPU-s / 1k tok  the CPU seconds of every process of the run over those steps
                  (sampled into RUN_DIR/cpu.jsonl; `bench.cpu_use`), a second of wall time and a
                  thousand trained tokens.
Per schedule (`runs`: runs that exited 0 / runs) a figure is "median [min-max]" over its
repeats, a failed run left out. `x <mode>` is, for every OpenRLHF mode present (sync,
async, partial, oversample: schedules not run by openrlhf_oppo's entry module), the mode's
mean step s / this schedule's, taken repeat by repeat (repeat k with repeat k; above 1 =
this one is faster); `x best` is the same against the OpenRLHF mode with the lowest mean
step s. `spread` is (max - min) / median of a schedule's mean step s over its repeats: how
far identical runs land apart (unknown with one repeat). The verdict takes the OPPO
schedule with the lowest mean step s, its `x sync` and its ratio against every OpenRLHF mode
that could be the fastest (the best, and every mode whose lowest mean step s reaches the
best's highest: modes within each other's spread tie), and the largest spread among it, sync
and those modes, and says whether each ratio's min - 1 exceeds that spread; against the best
only when it does against every one of them. On a host without a GPU it adds the ceiling no
overlap passes there: the best OPPO schedule's trained tok/s with every core busy at its CPU
seconds per token, over the best mode's. Writes `summary.json` (`rows`, `verdict`, `runs`); asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from openrlhf_oppo.bench import breakdown, cpu_use
from openrlhf_oppo.bench.table import Spread, fmt, name_width, relative_spread, spread, table_line
from openrlhf_oppo.integrations.launch.schedules import all_schedules, check

STEP_TAG = "train/policy_loss"  # logged once per PPO step by every schedule
# OpenRLHF 0.11.2: BasePPOTrainer._compute_rollout_stats puts these in every step's status
# (all schedules, OPPO's trainer too: it calls the base train_step), and
# TensorboardLogger.log_train writes each status key `k` as `train/k`
LENGTH_TAG = "train/rollout/response_length_mean"  # mean response tokens of the step's trained samples
SAMPLES_TAG = "train/rollout/num_samples"  # samples trained in the step
DEFAULT_SCHEDULES = ("sync", "async", "partial", "oversample", "oppo", "oppo-async-bg")
OPPO_KEYS = ("oppo/overlap_fraction", "oppo/scorer_idle_fraction", "oppo/deferred_fraction")
CPU_KEYS = ("cores_busy", "cpu_s_per_ktok")  # cpu_use.window, over the same steps
FIGURES = ("mean_step_s", "trained_tokens_per_s", "median_step_s", "wall_s", "reward", *OPPO_KEYS, *CPU_KEYS)
NONE3: Spread = (None, None, None)
LEGEND = """\
runs: runs that exited 0 / runs. Per run, over the steps after warm-up (train/policy_loss events):
  mean step s    mean wall-clock seconds between consecutive steps' events (time per step)
  trained tok/s  response tokens trained in those steps (per step: OpenRLHF's train/rollout/response_length_mean
                 x train/rollout/num_samples) / seconds from the first event to the last
  median step s  median of the same gaps
Per schedule each figure is median [min-max] over its repeats (a failed run is left out).
  x <mode>       that OpenRLHF mode's mean step s / this one's, repeat k with repeat k (above 1 = faster)
  x best=<mode>  the same against the OpenRLHF mode with the lowest mean step s
  spread         (max - min) / median of mean step s over repeats: identical runs' spread (- with one repeat)
  wall s         the whole run, start-up included
  reward         mean of train/reward over the run; overlap, idle, deferred: OPPO's oppo/overlap_fraction,
                 oppo/scorer_idle_fraction, oppo/deferred_fraction, median over the run's steps
  (in summary.json) cores_busy, cpu_s_per_ktok: CPU seconds of the run's processes a wall second, per 1k tokens"""


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


def trained_tokens(scalars: dict[str, list[tuple[float, int, float]]], steps: list[int]) -> float | None:
    """Response tokens trained in the global `steps`: mean response length x samples, step by
    step. None when a step lacks either: a partial sum would understate the rate."""
    length = {step: v for _, step, v in scalars.get(LENGTH_TAG, [])}
    samples = {step: v for _, step, v in scalars.get(SAMPLES_TAG, [])}
    if not steps or any(s not in length or s not in samples for s in steps):
        return None
    return sum(length[s] * samples[s] for s in steps)


def summarize_run(root: Path, warmup_steps: int = 2, scalars: dict | None = None) -> dict:
    """Per-run figures from a run directory written by `openrlhf-oppo train`; the first
    `warmup_steps` steps are left out (the last of them only marks where the window starts).
    `scalars`: its TensorBoard scalars when the caller has read them already."""
    scalars = tensorboard_scalars(root / "tensorboard") if scalars is None else scalars
    events = scalars.get(STEP_TAG, [])[max(0, warmup_steps - 1):]
    walls = [w for w, _, _ in events]
    step_s = [b - a for a, b in zip(walls, walls[1:], strict=False)]
    tokens = trained_tokens(scalars, [step for _, step, _ in events[1:]])
    tokens_per_s = None
    if tokens is not None and walls[-1] > walls[0]:
        tokens_per_s = tokens / (walls[-1] - walls[0])
    rewards = [v for _, _, v in scalars.get("train/reward", [])]
    summary = {
        "steps": len(scalars.get(STEP_TAG, [])),
        "step_s": step_s,
        "median_step_s": statistics.median(step_s) if step_s else None,
        "mean_step_s": statistics.fmean(step_s) if step_s else None,  # = time per step: what time-to-reward sees
        "trained_tokens_per_s": tokens_per_s,
        "reward": statistics.fmean(rewards) if rewards else None,
        "breakdown": breakdown.run_breakdown(root, walls),
    }
    if len(walls) > 1:
        summary.update(cpu_use.window(root / cpu_use.FILE, walls[0], walls[-1], len(step_s), tokens))
    metrics = root / "oppo_metrics.jsonl"
    if metrics.exists():
        lines = [json.loads(line) for line in metrics.read_text().splitlines()]
        for key in OPPO_KEYS:
            values = [r[key] for r in lines if key in r]
            summary[key] = statistics.median(values) if values else None
    return summary


def is_openrlhf(schedule: str) -> bool:
    """One of OpenRLHF's own modes: run by OpenRLHF's entry module, not openrlhf_oppo's."""
    return not check(schedule).entry_module.startswith("openrlhf_oppo")


def _figure(runs: list[dict], key: str) -> Spread:
    return spread([r.get(key) for r in runs])


def _ratio(base: list[dict], runs: list[dict]) -> Spread:
    """base's mean step s / this schedule's, repeat by repeat (a repeat missing either is left out)."""
    pairs = [(b.get("mean_step_s"), r.get("mean_step_s")) for b, r in zip(base, runs, strict=False)]
    return spread([b / r for b, r in pairs if b and r])


def _fastest(runs: dict[str, list[dict]], among: list[str]) -> str | None:
    """The schedule among `among` with the lowest mean step s (median over its repeats)."""
    return min(among, key=lambda s: _figure(runs[s], "mean_step_s")[0] or float("inf"), default=None)


def report(results: dict[str, list[dict]]) -> list[dict]:
    """One row per schedule: every figure as (median, min, max) over repeats, its spread and
    its ratios against every OpenRLHF mode present (`x`, by mode) and the fastest (`x_best`)."""
    # a failed run leaves a gap ({}) so that repeat k still pairs with repeat k
    ok = {s: [r if r.get("returncode") == 0 else {} for r in runs] for s, runs in results.items()}
    modes = [s for s in ok if is_openrlhf(s)]
    best = _fastest(ok, modes)
    rows = []
    for schedule, runs in ok.items():
        row = {"schedule": schedule, "openrlhf": schedule in modes, "runs_ok": f"{sum(map(bool, runs))}/{len(runs)}"}
        row.update({key: _figure(runs, key) for key in FIGURES})
        row["spread"] = relative_spread(r.get("mean_step_s") for r in runs)
        row["x"] = {mode: _ratio(ok[mode], runs) for mode in modes}
        row["x_best"] = _ratio(ok[best], runs) if best else NONE3
        row["best"] = best
        cores = next((r["host"]["cores"] for r in runs if r.get("host") and not r["host"].get("gpu")), None)
        paired = []  # `cpu_use.factors` against the fastest mode, repeat by repeat
        if best:
            paired = [cpu_use.factors(b, r, cores) for b, r in zip(ok[best], runs, strict=False)]
        paired = [f for f in paired if f]
        row["x_best_cpu"] = None
        if paired:
            row["x_best_cpu"] = {k: spread(f[k] for f in paired) for k in paired[0]}
        row["cores"] = cores
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Verdict:
    """Is the best OPPO schedule faster by more than identical runs differ?

    Attributes:
        best_oppo: the OPPO schedule with the lowest mean step s (median over repeats).
        best_openrlhf: the OpenRLHF mode with the lowest mean step s.
        vs_sync: sync's mean step s / best_oppo's, repeat by repeat, (median, min, max).
        vs_best: best_openrlhf's mean step s / best_oppo's, the same way.
        spread: the largest (max - min) / median of mean step s over repeats among best_oppo,
            sync and the rivals; None (unknown) when one of them has under two repeats.
        vs_sync_beyond_spread: vs_sync's min - 1 > spread; None when either is unknown.
        vs_best_beyond_spread: the ratio's min - 1 > spread against every rival, not only the best;
            None when one is unknown.
        work_vs_best: best_oppo's response tokens trained a step / best_openrlhf's (medians of trained
            tok/s x mean step s); away from 1 by more than the spread, the two steps held unequal work
            (e.g. a policy that drifted to shorter answers) and mean step s flatters the faster one.
        work_vs_sync: the same against sync (None without sync, or where sync is best_openrlhf).
        cpu_vs_best: vs_best as the product of `cpu_use.factors` (work a step, CPU per token, cores
            busy), each repeat by repeat, and on a host without a GPU `ceiling`: the most best_oppo's CPU
            per token lets it reach there at equal work, a bound no overlap passes; None without samples.
        cores: the host's cores (None on a GPU host or without samples); cores_busy: best_oppo's (median).
        rivals: every OpenRLHF mode that could be the fastest, best_openrlhf first: those whose lowest
            mean step s over repeats is at or below best_openrlhf's highest (two modes within each
            other's spread tie, and picking one by its median would let the verdict flip with the
            pick), each with best_oppo's ratio against it, as vs_best.
    """

    best_oppo: str | None
    best_openrlhf: str | None
    vs_sync: Spread
    vs_best: Spread
    spread: float | None
    vs_sync_beyond_spread: bool | None
    vs_best_beyond_spread: bool | None
    work_vs_best: float | None = None
    cpu_vs_best: dict | None = None
    cores: int | None = None
    cores_busy: float | None = None
    rivals: dict | None = None
    work_vs_sync: float | None = None


def _tokens_a_step(row: dict) -> float | None:
    tok = row["trained_tokens_per_s"][0]
    step = row["mean_step_s"][0]
    return None if tok is None or step is None else tok * step


def _work_ratio(row: dict, base: dict) -> float | None:
    tokens = _tokens_a_step(row)
    base_tokens = _tokens_a_step(base)
    return None if tokens is None or not base_tokens else tokens / base_tokens


def _beyond(ratio: Spread, spread_rel: float | None) -> bool | None:
    if ratio[1] is None or spread_rel is None:
        return None
    return ratio[1] - 1.0 > spread_rel


def verdict(rows: list[dict]) -> Verdict:
    """The verdict of `report`'s rows."""
    by_name = {r["schedule"]: r for r in rows}
    oppo = [r["schedule"] for r in rows if not r["openrlhf"]]
    best_oppo = min(oppo, key=lambda s: by_name[s]["mean_step_s"][0] or float("inf"), default=None)
    best = rows[0]["best"] if rows else None
    if best_oppo is None or best is None:
        return Verdict(best_oppo, best, NONE3, NONE3, None, None, None)
    row = by_name[best_oppo]
    vs_sync = row["x"].get("sync", NONE3)
    highest = by_name[best]["mean_step_s"][2] or 0.0  # no repeat of the best ran: it has no rival
    rivals = [best]  # and every mode whose fastest repeat is at or below the best's slowest
    for m in row["x"]:
        if m != best and (by_name[m]["mean_step_s"][1] or float("inf")) <= highest:
            rivals.append(m)
    compared = {best_oppo, *rivals}
    if "sync" in by_name:
        compared.add("sync")
    spreads = [by_name[s]["spread"] for s in sorted(compared)]
    spread_rel = None if None in spreads else max(spreads)
    beyond = [_beyond(row["x"][m], spread_rel) for m in rivals]
    work_vs_sync = None
    if "sync" in by_name and best != "sync":
        work_vs_sync = _work_ratio(row, by_name["sync"])
    return Verdict(
        best_oppo=best_oppo,
        best_openrlhf=best,
        vs_sync=vs_sync,
        vs_best=row["x_best"],
        spread=spread_rel,
        vs_sync_beyond_spread=_beyond(vs_sync, spread_rel),
        vs_best_beyond_spread=None if None in beyond else all(beyond),
        work_vs_best=_work_ratio(row, by_name[best]),
        cpu_vs_best=row.get("x_best_cpu"),
        cores=row.get("cores"),
        cores_busy=row.get("cores_busy", NONE3)[0],
        rivals={m: row["x"][m] for m in rivals},
        work_vs_sync=work_vs_sync,
    )


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def print_report(rows: list[dict]) -> None:
    best = rows[0]["best"] if rows else None
    modes = [r["schedule"] for r in rows if r["openrlhf"]]
    cols = [("schedule", name_width(r["schedule"] for r in rows)), ("runs", 5), ("mean step s", 18),
            ("trained tok/s", 16),
            *((f"x {m}", 18) for m in modes), (f"x best={best or '-'}", 18), ("spread", 7), ("median step s", 18),
            ("wall s", 12), ("reward", 8), ("overlap", 8), ("idle", 6), ("deferred", 8)]
    widths = [w for _, w in cols]
    print(table_line([name for name, _ in cols], widths))
    for r in rows:
        cells = [r["schedule"], r["runs_ok"], fmt(r["mean_step_s"], ".2f"), fmt(r["trained_tokens_per_s"], ".0f"),
                 *(fmt(r["x"][m], ".2f") for m in modes), fmt(r["x_best"], ".2f"), _percent(r["spread"]),
                 fmt(r["median_step_s"], ".2f"), fmt(r["wall_s"], ".0f"),
                 fmt(r["reward"], ".3f", False), fmt(r["oppo/overlap_fraction"], ".2f", False),
                 fmt(r["oppo/scorer_idle_fraction"], ".2f", False), fmt(r["oppo/deferred_fraction"], ".2f", False)]
        print(table_line(cells, widths))
    print(LEGEND)
    print_verdict(verdict(rows))


def print_verdict(v: Verdict) -> None:
    if v.best_oppo is None or v.best_openrlhf is None:
        print("verdict: none (needs an OPPO schedule and an OpenRLHF mode)")
        return
    print(f"verdict: best OPPO schedule {v.best_oppo} (lowest mean step s), repeat by repeat, median [min-max]:")
    lines = [("sync", v.vs_sync)]
    for m, ratio in v.rivals.items():
        if m == v.best_openrlhf:
            lines.append((f"{m} (best OpenRLHF)", ratio))
        elif m != "sync":
            lines.append((f"{m} (within {v.best_openrlhf}'s range: it could be the fastest)", ratio))
    for name, ratio in lines:
        if ratio[0] is None:
            print(f"  x {name}: -")
            continue
        judged = {None: "unknown (spread unknown)", True: "larger than the spread",
                  False: "NOT larger than the spread"}[_beyond(ratio, v.spread)]
        print(f"  x {name}: {fmt(ratio, '.2f')}; effect (min - 1) {100 * (ratio[1] - 1):+.0f}%: {judged}")
    if len(v.rivals) > 1:
        judged = {None: "unknown", True: "larger", False: "NOT larger"}[v.vs_best_beyond_spread]
        print(f"  against the best OpenRLHF mode: {judged} than the spread against every mode that could be the "
              f"fastest ({', '.join(v.rivals)})")
    for mode, work in ((v.best_openrlhf, v.work_vs_best), ("sync", v.work_vs_sync)):
        if work is not None:
            line = f"  work: {v.best_oppo}'s steps held {work:.2f}x the response tokens of {mode}'s"
            if v.spread is not None and abs(work - 1.0) > v.spread:
                line += "; beyond the spread, so mean step s compares unequal work: read trained tok/s"
            print(line)
    if v.cpu_vs_best:
        f = v.cpu_vs_best
        print(f"  why (cpu.jsonl), repeat by repeat: x {v.best_openrlhf} = work a step {fmt(f['work'], '.2f')} "
              f"x CPU per trained token {fmt(f['cpu_per_token'], '.2f')} x cores busy {fmt(f['cores_busy'], '.2f')}")
        if "ceiling" in f:
            print(f"  ceiling: {v.best_oppo} kept {v.cores_busy:.2f} of {v.cores} shared cores busy; at its CPU per "
                  f"token, equal work and every core busy it would be {fmt(f['ceiling'], '.2f')}x "
                  f"{v.best_openrlhf}: no overlap passes that")
    if v.spread is None:
        print("  spread between identical runs: unknown (one repeat: two or more tell the effect from noise)")
    else:
        print(f"  largest spread between identical runs of these schedules: {_percent(v.spread)}")


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
                   help="schedules to run; ratios are against every OpenRLHF mode among them")
    p.add_argument("--repeats", type=int, default=1, help="runs per schedule, interleaved")
    p.add_argument("--output", default="runs/bench-schedules", help="one run directory per schedule and repeat")
    p.add_argument("--same-samples", action=argparse.BooleanOptionalAction, default=True,
                   help="--train.full_determinism_enable for every run (seeded requests and prompt order)")
    p.add_argument("--timeout-s", type=float, default=900, help="per run")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="first steps left out of the mean time a step and tokens/s (>= 1)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: summarize the runs already under --output (<schedule>-<repeat>)")
    p.add_argument("--keep-done", action="store_true",
                   help="reuse the runs under --output that finished (result.json with exit 0) instead of running "
                        "them again; run the rest (a bench cut short, or a schedule or repeat added)")
    p.add_argument("extra", nargs="*", help="after `--`: extra OpenRLHF flags for every run")
    args = p.parse_args(argv)
    offered = all_schedules()
    unknown = [s for s in args.schedules if s not in offered]
    if unknown:
        p.error(f"--schedules: unknown {', '.join(unknown)}; allowed: {', '.join(offered)}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.warmup_steps < 1:
        p.error(f"--warmup-steps must be >= 1, got {args.warmup_steps}")

    from openrlhf_oppo.integrations.launch import train_run as train

    extra = list(args.extra)
    if args.same_samples:
        extra.append("--train.full_determinism_enable")
    out = Path(args.output)
    results: dict[str, list[dict]] = {s: [] for s in args.schedules}
    order = [(rep, schedule) for rep in range(args.repeats) for schedule in args.schedules]
    for i, (rep, schedule) in enumerate(order, 1):
        root = out / f"{schedule}-{rep}"
        result = json.loads((root / "result.json").read_text()) if (root / "result.json").exists() else {}
        if args.report_only or (args.keep_done and result.get("returncode") == 0):
            returncode = result.get("returncode", 0 if (root / "tensorboard").is_dir() else 1)
            wall_s = result.get("wall_s")
            if not args.report_only:
                print(f"[bench schedules] run {i}/{len(order)}: {schedule}: kept (finished in {root})", flush=True)
        else:
            print(f"[bench schedules] run {i}/{len(order)}: {schedule} -> {root}", flush=True)
            train_argv = ["--schedule", schedule, "--config", args.config, "--output", str(root),
                          "--timeout-s", str(args.timeout_s)]
            if extra:
                train_argv += ["--", *extra]
            with cpu_use.Sampler(root / cpu_use.FILE):
                run = train.run(train_argv)
            returncode = run.returncode
            wall_s = run.wall_s
            (root / "result.json").write_text(json.dumps({"returncode": returncode, "wall_s": wall_s}))
            code = stopped("schedules", run, i, len(order))
            if code is not None:
                return code
        summary = summarize_run(root, args.warmup_steps) if returncode == 0 else {"steps": 0, "step_s": []}
        results[schedule].append({"returncode": returncode, "wall_s": wall_s, **summary})
    rows = report(results)
    print_report(rows)
    breakdown.print_breakdown({s: runs[0].get("breakdown") for s, runs in results.items() if runs})
    cpu_use.print_table({s: runs[0] for s, runs in results.items() if runs})
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"rows": rows, "verdict": asdict(verdict(rows)), "runs": results},
                                                  indent=1))
    print(f"summary: {out / 'summary.json'}")
    return 0 if all(r["returncode"] == 0 for runs in results.values() for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
