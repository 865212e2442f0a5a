"""`python -m oppo_lab validate RUN_DIR... [--preset cpu-longtail]`: the simulator against
measured runs of `bench schedules`, schedule by schedule, on mean time per step.

Each RUN_DIR is one run named `<schedule>-<repeat>` (as `bench schedules --output DIR` writes
them). Measured: `bench schedules`' own figure (`summarize_run`: the mean gap between
consecutive steps' TensorBoard events after `--warmup-steps`); simulated: the same gaps
between the simulated steps' events (`drivers.step_latencies_s`: OpenRLHF logs a step after
its weight sync). Two tables:

    replay   one simulated run per measured run, replaying that run's own response lengths in
             prompt order (`lengths.kind: replay`): the cost and control-flow model alone. Its
             verdict is the command's (exit status 1 on a MISS or another order). IN-SAMPLE when
             the preset was calibrated on these runs (the shipped CPU preset was: see
             `heldout.FITTED`), and printed so.
    preset   `--seeds` runs drawing lengths from the preset's distribution: what the simulator
             predicts for the workload (a measured run is one draw of its steps' stragglers).
             In-sample as the replay.

With `--leave-one-out`, a third table is held out: each schedule replayed with a preset calibrated
on the other schedules' runs only. The simulator's held-out verdict on published GPU runs is
`python -m oppo_lab published --heldout`.

A schedule is within when simulated / measured (medians) is within 1 ± `--tolerance`. The order
holds when every pair of schedules the measurement orders (one's slowest repeat faster than the
other's fastest) is simulated in that order (medians); a pair whose repeats overlap is a tie the
runs do not decide, printed `≈`, and either simulated order stands.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from openrlhf_oppo import timeline
from openrlhf_oppo.bench.table import Spread, fmt, name_width, spread
from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import drivers, presets
from oppo_lab import sim as lab_sim

TOLERANCE = 0.25
SHARED_HOST_FACTORS = ("decode_slowdown_shared", "train_slowdown_shared", "decode_slowdown_scoring")


@dataclass(frozen=True)
class Row:
    """One schedule: mean step s, median [min, max] over repeats (measured) and runs (simulated)."""

    schedule: str
    measured: Spread
    simulated: Spread
    ratio: float  # simulated / measured medians
    within: bool


def runs_order(faster: Row, slower: Row) -> bool:
    """Every repeat of `faster` was faster than every repeat of `slower` (else the runs tie them)."""
    return faster.measured[2] < slower.measured[1]


@dataclass(frozen=True)
class Validation:
    rows: tuple[Row, ...]
    measured_order: tuple[str, ...]  # fastest first, by median mean step s
    simulated_order: tuple[str, ...]
    tolerance: float

    @property
    def swapped(self) -> tuple[tuple[str, str], ...]:
        """(faster, slower) pairs the runs order (`runs_order`) that the simulation puts the other
        way round."""
        return tuple((a.schedule, b.schedule) for i, a in enumerate(self.rows) for b in self.rows[i + 1:]
                     if runs_order(a, b) and a.simulated[0] >= b.simulated[0])

    @property
    def order_reproduced(self) -> bool:
        return not self.swapped

    @property
    def passed(self) -> bool:
        return self.order_reproduced and all(r.within for r in self.rows)


def compare(measured: dict[str, list[float]], simulated: dict[str, list[float]], tolerance: float) -> Validation:
    """Per schedule, simulated against measured mean step s (lists over repeats / runs)."""
    if set(measured) != set(simulated):
        raise ValueError(f"schedules differ: measured {sorted(measured)}, simulated {sorted(simulated)}")
    if not 0 < tolerance < 1:
        raise ValueError(f"--tolerance must be in (0, 1), got {tolerance}")
    rows = []
    for s in sorted(measured, key=lambda s: statistics.median(measured[s])):
        m, x = spread(measured[s]), spread(simulated[s])
        ratio = x[0] / m[0]
        rows.append(Row(s, m, x, ratio, abs(ratio - 1.0) <= tolerance + 1e-12))
    order = tuple(sorted(simulated, key=lambda s: statistics.median(simulated[s])))
    return Validation(tuple(rows), tuple(r.schedule for r in rows), order, tolerance)


def verdict(row: Row, tolerance: float) -> str:
    if row.within:
        return "within"
    return f"MISS: too {'slow' if row.ratio > 1 else 'fast'}"


def print_validation(v: Validation, title: str, simulated_label: str, sample: str = "in-sample") -> None:
    """The table; `sample` ('in-sample' or 'held out') labels the title and the verdict line."""
    pct = round(100 * v.tolerance)
    print(f"{sample.upper()}: {title}")
    head = ["schedule", "measured mean step s", f"simulated ({simulated_label})", "sim/measured",
            f"verdict (±{pct}%)"]
    widths = [name_width(r.schedule for r in v.rows), 22, 27, 12, 18]
    print(" ".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w) in enumerate(zip(head, widths))))
    for r in v.rows:
        cells = [r.schedule, fmt(r.measured, ".2f"), fmt(r.simulated, ".2f"), f"{r.ratio:.2f}", verdict(r, v.tolerance)]
        print(" ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths))))
    rows = {r.schedule: r for r in v.rows}
    print(f"measured order (fastest first):  {v.measured_order[0]}" + "".join(
        f" {'<' if runs_order(rows[a], rows[b]) else '≈'} {b}"
        for a, b in zip(v.measured_order, v.measured_order[1:])) + "   (≈: repeats overlap, a tie)")
    print(f"simulated order (fastest first): {' < '.join(v.simulated_order)}  -> order "
          + ("reproduced" if v.order_reproduced else
             "NOT reproduced: " + ", ".join(f"{a} measured faster than {b}" for a, b in v.swapped)))
    within = sum(r.within for r in v.rows)
    print(f"{sample} verdict: {'PASS' if v.passed else 'FAIL'} ({within}/{len(v.rows)} within ±{pct}%, "
          f"order {'same' if v.order_reproduced else 'different'})")


# ----------------------------------------------------------------------- measured runs


def schedule_of(run: Path) -> str:
    """`bench schedules` names a run `<schedule>-<repeat>`."""
    m = re.fullmatch(r"(.+)-\d+", run.name)
    if not m or m.group(1) not in drivers.schedule_names():
        raise ValueError(f"{run}: expected a run directory named <schedule>-<repeat> (bench schedules' layout) "
                         f"with a schedule among {', '.join(drivers.schedule_names())}")
    return m.group(1)


def replay_lengths(run: Path, prompt_tokens: int) -> list[int]:
    """The run's response lengths in prompt order: by sample id where the timeline carries one
    (OPPO's carried groups train out of order), else rollouts.jsonl's order (OpenRLHF's
    generator hands each call's groups over in prompt order under the bench's seeded rollouts)."""
    rows = timeline.read(run / "timeline") if (run / "timeline").is_dir() else []
    by_id = {r["sample"]: r["tokens"] for r in rows if r["kind"] == "sample" and r.get("sample") is not None}
    if by_id:
        return [max(1, by_id[i]) for i in sorted(by_id)]
    path = run / "rollouts.jsonl"
    if not path.exists():
        raise ValueError(f"{run}: no rollouts.jsonl and no sample ids in timeline/: nothing to replay")
    return [max(1, len(s["sequence"]) - prompt_tokens) for line in path.read_text().splitlines() if line.strip()
            for s in json.loads(line)["samples"]]


def measure(runs: list[Path], warmup_steps: int) -> dict[Path, dict]:
    from openrlhf_oppo.bench.schedules import summarize_run  # reads TensorBoard events

    out = {}
    for run in runs:
        summary = summarize_run(run, warmup_steps)
        if summary["mean_step_s"] is None:
            raise ValueError(f"{run}: no step events after warm-up in tensorboard/ (a failed run?)")
        out[run] = summary
    return out


def calibrated_on(preset: str, runs: list[Path]) -> bool:
    """Whether `python -m oppo_lab calibrate` wrote the preset from any of these runs (its header
    names each run directory it read): then its tables on them are in-sample."""
    path = Path(preset) if Path(preset).exists() else lab_sim.PRESET_DIR / f"{preset}.yaml"
    if not path.exists():
        path = presets.PRESET_DIR / f"{preset}.yaml"
    header = path.read_text().splitlines()[0] if path.exists() else ""
    if not header.startswith("# Calibrated by"):
        return False
    named = {Path(w.strip("`")).parts[-2:] for w in header.split() if "/" in w}
    return any(run.parts[-2:] in named for run in runs)


# ------------------------------------------------------------------------- simulated


def simulate_mean_step_s(cfg: presets.SimConfig, schedule: str, seed: int, timeline_dir: Path | None = None) -> float:
    res = drivers.simulate(cfg, cost_model.build(cfg), schedule, seed)
    if timeline_dir is not None:
        from openrlhf_oppo.sim.report import write_timeline

        write_timeline(res, timeline_dir)
    return statistics.fmean(drivers.step_latencies_s(res, cfg.workload.warmup_steps))


def replayed(runs: dict[Path, dict], preset: str, sets: list[str], tmp: Path,
             output: Path | None = None) -> dict[str, list[float]]:
    """One simulated run per measured run, on that run's own lengths (its repeat index as the seed);
    with `output`, its timeline as OUTPUT/<run name>/timeline/ (`openrlhf-oppo plot compare` draws both)."""
    out: dict[str, list[float]] = {}
    for k, (run, summary) in enumerate(runs.items()):
        base = lab_sim.load_preset(preset, sets)
        lengths = tmp / f"{k}-lengths.json"
        lengths.write_text(json.dumps(replay_lengths(run, base.lengths.prompt_tokens)))
        cfg = lab_sim.load_preset(preset, [*sets, "lengths.kind=replay", f"lengths.path={lengths}",
                                           f"workload.steps={summary['steps']}"])
        seed = int(run.name.rsplit("-", 1)[1])
        sim_dir = output / run.name if output is not None else None
        out.setdefault(schedule_of(run), []).append(simulate_mean_step_s(cfg, schedule_of(run), seed, sim_dir))
    return out


def sampled(runs: dict[Path, dict], preset: str, sets: list[str], seeds: int) -> dict[str, list[float]]:
    """`seeds` simulated runs per schedule, lengths drawn from the preset's distribution."""
    steps = max(s["steps"] for s in runs.values())
    cfg = lab_sim.load_preset(preset, [*sets, f"workload.steps={steps}"])
    return {s: [simulate_mean_step_s(cfg, s, cfg.workload.seed + k) for k in range(seeds)]
            for s in sorted({schedule_of(r) for r in runs})}


def leave_one_out(runs: dict[Path, dict], base: str, sets: list[str], tmp: Path,
                  warmup_steps: int) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Per schedule S: `simulate calibrate` on every other schedule's runs (S's data unseen), then
    S's runs replayed with that preset. The base preset's shared-host factors (fitted, perhaps on
    S's runs) are reset to the simulator's defaults first: a factor the other runs cannot show
    stays at its default. Returns ({S: simulated mean step s per run}, {S: the factors fitted
    without S})."""
    from oppo_lab.sim import calibrate

    base_cfg = lab_sim.load_preset(base, sets)
    defaults = presets.Efficiency()
    base_cfg = replace(base_cfg, efficiency=replace(base_cfg.efficiency, **{
        k: getattr(defaults, k) for k in SHARED_HOST_FACTORS}))
    prompt_tokens = base_cfg.lengths.prompt_tokens
    out: dict[str, list[float]] = {}
    slowdowns: dict[str, dict[str, float]] = {}
    for held in sorted({schedule_of(r) for r in runs}):
        seen = [r for r in runs if schedule_of(r) != held]
        if not seen:
            raise ValueError("--leave-one-out needs runs of at least two schedules")
        found = calibrate.calibrate(seen, base_cfg, prompt_tokens, warmup_steps)
        preset = tmp / f"without-{held}.yaml"
        calibrate.write_preset(preset, found, base, seen, prompt_tokens)
        slowdowns[held] = {k: found["efficiency"][k] for k in SHARED_HOST_FACTORS}
        unseen = {r: s for r, s in runs.items() if schedule_of(r) == held}
        out.update(replayed(unseen, str(preset), sets, tmp))
    return out, slowdowns


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m oppo_lab validate", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="runs named <schedule>-<repeat>")
    p.add_argument("--preset", default="cpu-longtail", help="the calibrated preset (a name or a YAML path)")
    p.add_argument("--set", dest="sets", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                   help="edit the preset (as `simulate --set`)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help="simulated / measured within 1 ± this")
    p.add_argument("--seeds", type=int, default=20, help="preset table: simulated runs per schedule")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps left out, as `bench schedules --warmup-steps`")
    p.add_argument("--output", type=Path, default=None,
                   help="write each replayed run's simulated timeline to OUTPUT/<run name>/ (for `plot compare`)")
    p.add_argument("--leave-one-out", action="store_true",
                   help="also: each schedule replayed with a preset calibrated on the other schedules' runs only")
    args = p.parse_args(argv)
    if args.warmup_steps < 1:
        p.error(f"--warmup-steps must be >= 1, got {args.warmup_steps}")
    if args.seeds < 1:
        p.error(f"--seeds must be >= 1, got {args.seeds}")
    sets = [*(s for group in args.sets for s in group), f"workload.warmup_steps={args.warmup_steps}"]
    for run in args.runs:
        schedule_of(run)  # every name checked before anything is read
    runs = measure(args.runs, args.warmup_steps)
    measured: dict[str, list[float]] = {}
    for run, summary in runs.items():
        measured.setdefault(schedule_of(run), []).append(summary["mean_step_s"])
    with tempfile.TemporaryDirectory() as tmp:
        replay = compare(measured, replayed(runs, args.preset, sets, Path(tmp), args.output), args.tolerance)
        held_out = leave_one_out(runs, args.preset, sets, Path(tmp), args.warmup_steps) \
            if args.leave_one_out else None
    drawn = sampled(runs, args.preset, sets, args.seeds)
    prediction = compare(measured, drawn, args.tolerance)
    in_sample = calibrated_on(args.preset, args.runs)
    sample = "in-sample" if in_sample else "not fitted on these runs"
    fitted_on = "calibrated on these runs" if in_sample else "its calibration header names none of them"
    print_validation(replay, f"replay: each measured run's own response lengths (preset {args.preset}, {fitted_on}; "
                             "simulated: median [min-max] over the replayed runs)", "replay", sample)
    print()
    print_validation(prediction, f"prediction: lengths drawn from the preset's distribution "
                                 f"({len(next(iter(drawn.values())))} seeds a schedule)", "preset lengths", sample)
    if held_out is not None:
        print()
        print_validation(compare(measured, held_out[0], args.tolerance),
                         "leave one schedule out: each schedule replayed with a preset calibrated on the others' runs "
                         "(decode / train / scoring slowdowns fitted without it; scoring 0: not seen, the engine "
                         "stops for a prefill: " + ", ".join(
                             f"{s} {k['decode_slowdown_shared']:.2f}/{k['train_slowdown_shared']:.2f}/"
                             f"{k['decode_slowdown_scoring']:.2f}" for s, k in held_out[1].items()) + ")", "held out",
                         "held out")
    else:
        print()
        print(f"held out: none here (the tables above are {sample}); --leave-one-out adds a table held out by "
              "schedule, and `python -m oppo_lab published --heldout` the held-out published runs")
    return 0 if replay.passed else 1
