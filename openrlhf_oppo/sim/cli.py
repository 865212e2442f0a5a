"""`openrlhf-oppo simulate`: the cluster-scale simulator (discrete events, the real scheduler).

    openrlhf-oppo simulate --preset paper-7b-h200 [--set key=value ...] [--output DIR]
    openrlhf-oppo simulate --preset paper-7b-h200 --sweep delta.max=0,4,8,16 [--sweep ...]

Prints `bench schedules`' table for every schedule (and, for a preset with the paper's
figures, the calibration table), writes each schedule's simulated timeline in the format
of real runs and draws it with `openrlhf-oppo plot`'s code. Several `--sweep` flags are
zipped (same number of values): `--sweep split.nodes=1,2,4 --sweep workload.batch_groups=112,224,448`.
Keys: `openrlhf_oppo.sim.presets` (`delta.*`, `chunk.*`, ... are the `oppo:` section's).

Every run prints each schedule's version budget (the most policy versions a trained token may lag:
`drivers.version_budget`) beside its measured lags, and OPPO's fastest schedule against OpenRLHF's
fastest at each equal budget. With `--best-layout` also OpenRLHF's async trainer with OPPO's sync
transport where OPPO's fastest syncs in the background ("same transport", beside "as shipped"), and a
band on every ratio over the assumed constants (`openrlhf_oppo.sim.bands`; `--no-band` skips it). Where
OPPO takes old log-probs from the rollout (`train.old_logprobs`, its default), every OpenRLHF mode is
also run with that cut ("same cut"): the gain that is OPPO's own is the ratio against that row.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

from openrlhf_oppo.core.types import LAG_BUCKETS
from openrlhf_oppo.sim import drivers, layouts, presets, report
from openrlhf_oppo.sim.drivers import schedule_names
from openrlhf_oppo.sim.report import NAME_W

SWEEP_SCHEDULES = ("sync", "oversample", "oppo", "oppo-async-bg")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="openrlhf-oppo simulate", description=__doc__.splitlines()[0])
    p.add_argument("--preset", required=True, help=f"one of {', '.join(presets.preset_names())}, or a YAML path")
    p.add_argument("--set", dest="sets", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                   help="edit the preset (e.g. workload.batch_groups=64 hardware=h100 delta.max=8); an OPPO key "
                        "(delta.*, chunk.*, staleness.*, streaming.*, train.*) applies to every OPPO schedule, over "
                        "the schedule's own setting (staleness.max_policy_lag=3 makes oppo-async-bg's lag 3)")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="simulate once per value (several --sweep flags are zipped); writes a PNG")
    p.add_argument("--schedules", nargs="+", default=None,
                   help=f"schedules to simulate (default: all; sweeps: {' '.join(SWEEP_SCHEDULES)}); "
                        f"allowed: {', '.join(schedule_names())}")
    p.add_argument("--output", type=Path, default=None,
                   help="timelines, PNGs, summary.json (default: runs/sim/<preset>)")
    p.add_argument("--best-layout", action="store_true",
                   help="each schedule in the best layout of the preset's GPUs (nodes x gpus_per_node) that its "
                        "framework can run and that fits (openrlhf_oppo.sim.layouts); layouts that do not fit are "
                        "listed with what overflows")
    p.add_argument("--no-band", action="store_true",
                   help="--best-layout: print the equal-budget ratios without their bands (a band re-simulates the "
                        "compared schedules in their layouts at each assumed constant's low and high, one at a time: "
                        "openrlhf_oppo.sim.bands; on by default with --best-layout)")
    p.add_argument("--band-seeds", type=int, default=1,
                   help="seeds each band run takes (default 1: the preset's first; the headline ratios take every "
                        "seed)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--plot-steps", type=int, default=4, help="steps drawn in the timeline PNGs (after warm-up)")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    sets = [s for group in args.sets for s in group]
    schedules = _schedules(args.schedules, SWEEP_SCHEDULES if args.sweep else schedule_names())
    base = presets.load_preset(args.preset, sets)  # validates the preset and every --set first
    out = args.output or Path("runs") / "sim" / base.name
    no_plot = args.no_plot or not _can_plot()
    t0 = time.perf_counter()
    if args.sweep and args.best_layout:
        raise ValueError("--best-layout: not with --sweep (search one configuration at a time)")
    if args.sweep:
        _sweep(args.preset, sets, args.sweep, schedules, base, out, no_plot)
    else:
        tried = None
        if args.best_layout:
            if base.hardware is None or base.actor is None:
                raise ValueError(f"--best-layout: preset {base.name} has no hardware and model shapes to size "
                                 "layouts by (a measured preset's split is its machine's)")
            sim, tried, space = report.best_layouts(base, schedules)
            _print_refused_layouts(space)
        else:
            sim = report.run_all(base, schedules)
        if not sim.runs:
            report.print_layouts(sim, tried)
            print("nothing simulated: no schedule can run in a layout that fits (see above)")
            return 1
        report.print_tables(sim)
        report.print_layouts(sim, tried)
        _print_staleness(sim)
        band_seeds = None
        if args.best_layout:
            report.add_same_transport(sim)
        report.add_same_cut(sim)
        sim.compared = report.equal_budget(sim)
        if args.best_layout and not args.no_band:
            if args.band_seeds < 1:
                raise ValueError(f"--band-seeds: at least 1, got {args.band_seeds}")
            band_seeds = args.band_seeds
            report.add_bands(sim, sim.compared, band_seeds)
        report.print_budgets(sim)
        report.print_equal_budget(sim, sim.compared, band_seeds)
        if report.calibrates(sim):
            report.print_calibration(sim)
        print(f"simulated in {time.perf_counter() - t0:.1f} s")
        if not no_plot:
            report.write_outputs(sim, out, plot_steps=args.plot_steps)
        else:
            report.write_outputs(sim, out, plot_schedules=())
        print(f"timelines and summary: {out}")
    return 0


def _print_staleness(sim: report.Simulated) -> None:
    """OPPO schedules: how off-policy the trained tokens were and which Δ the rule chose."""
    w = sim.cfg.workload
    rows = [(s, [drivers.staleness(r, w.warmup_steps) for r in rs]) for s, rs in sim.runs.items()]
    rows = [(s, st) for s, st in rows if st[0] is not None and "delta" in st[0]]  # OPPO's (OpenRLHF's: budgets)
    if not rows:
        return
    print()
    lags = " ".join(f"{'lag ' + b:>6}" for b in LAG_BUCKETS)
    print(f"{'schedule':<{NAME_W}} {lags} {'stale kv':>8} {'forced s':>8}  delta (measured steps)")
    for s, st in rows:
        share = {b: statistics.median(x["lag_share"][b] for x in st) for b in LAG_BUCKETS}
        deltas = st[0]["delta"]
        print(f"{s:<{NAME_W}} " + " ".join(f"{share[b]:>6.2f}" for b in share)
              + f" {statistics.median(x['stale_kv'] for x in st):>8.2f}"
              + f" {statistics.median(x['forced_wait_s'] for x in st):>8.2f}  "
              + f"{min(deltas)}-{max(deltas)} (median {statistics.median(deltas):g}; seed {sim.runs[s][0].seed})")
    print("lag b: share of trained response tokens decoded by weights b versions older than those trained "
          "(median over seeds); stale kv: share decoded on KV cached by older weights; forced s: seconds a step's "
          "batch waited, B groups complete, only for groups the staleness bounds (max_policy_lag, "
          "max_deferral_steps) forced into it (mean over steps, median over seeds)")


def _print_refused_layouts(space: layouts.Searched) -> None:
    print(f"layouts searched: {sum(len(v) for v in space.runnable.values())} (schedule, layout) pairs; "
          f"{len(space.refused)} layouts do not fit" + (":" if space.refused else ""))
    for split, who, why in space.refused:
        print(f"  {layouts.describe(split, 'reference actors' in who):<48} for {who}: " + "; ".join(why))
    print()


def _can_plot() -> bool:
    """PNGs need matplotlib (the `bench` extra); without it the tables, timelines and summary still come."""
    if importlib.util.find_spec("matplotlib") is not None:
        return True
    print("note: matplotlib is not installed (pip install 'openrlhf-oppo[bench]'), so no PNG is drawn")
    return False


def _schedules(given: list[str] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    if given is None:
        return default
    offered = schedule_names()
    unknown = [s for s in given if s not in offered]
    if unknown:
        raise ValueError(f"--schedules: unknown {', '.join(unknown)}; allowed: {', '.join(offered)}")
    return tuple(given)


def sweep_points(sweeps: list[str], base: presets.SimConfig) -> list[tuple[str, list[str]]]:
    """(label, `--set` items) of every sweep point (zipped sweeps); Δ's init follows a lower Δ max."""
    keys, values = [], []
    for item in sweeps:
        key, raw = presets.parse_set(item)
        vals = [v.strip() for v in raw.split(",") if v.strip()]
        if not vals:
            raise ValueError(f"--sweep {key}: no values; write --sweep {key}=v1,v2,...")
        keys.append(presets.canonical_key(key))
        values.append(vals)
    if len({len(v) for v in values}) != 1:
        raise ValueError(f"--sweep: zipped sweeps need as many values each, got {[len(v) for v in values]}")
    points = []
    for vals in zip(*values, strict=True):  # equal lengths, checked above
        items = [f"{k}={v}" for k, v in zip(keys, vals, strict=True)]
        if "oppo.delta.max" in keys and "oppo.delta.init" not in keys:
            dmax = int(vals[keys.index("oppo.delta.max")])
            if base.oppo.delta.init > dmax:
                items.append(f"oppo.delta.init={dmax}")
                print(f"note: delta.max={dmax} is below the preset's delta.init ({base.oppo.delta.init}): "
                      f"delta.init={dmax} for that point")
        points.append((" ".join(vals), items))
    return points


def _sweep(preset: str, sets: list[str], sweeps: list[str], schedules: tuple[str, ...], base: presets.SimConfig,
           out: Path, no_plot: bool) -> None:
    points = []
    for label, items in sweep_points(sweeps, base):
        cfg = presets.load_preset(preset, [*sets, *items])
        points.append((label, report.run_all(cfg, schedules)))
    keys = " + ".join(presets.canonical_key(presets.parse_set(s)[0]) for s in sweeps)
    print(f"sweep of {keys} on preset {base.name}")
    report.print_sweep(points, schedules)
    if not no_plot:
        name = "-".join(presets.parse_set(s)[0].replace(".", "_") for s in sweeps)
        report.plot_sweep(points, schedules, f"{base.name}: sweep of {keys}", out / f"sweep-{name}.png")
