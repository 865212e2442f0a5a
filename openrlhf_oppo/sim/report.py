"""Tables, timelines and sweep plots of simulated runs.

The schedule table is `openrlhf-oppo bench schedules`' own (`bench.schedules.report` /
`print_report`): every run of a schedule is one "repeat" (one seed), so a figure is the
median over seeds [min-max]. Timelines are written in the JSONL format of real runs and
drawn by `bench.plot`, the code that draws real runs.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from openrlhf_oppo.bench import schedules as bench_schedules
from openrlhf_oppo.bench.table import name_width
from openrlhf_oppo.sim import bands as band_model
from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import layouts, memory
from openrlhf_oppo.sim.drivers import (
    BASELINES,
    CUT,
    SAME_TRANSPORT,
    RunResult,
    schedule_names,
    simulate,
    staleness,
    summarize,
    version_budget,
)
from openrlhf_oppo.sim.presets import SimConfig, schedule_oppo

NAME_W = 17  # the printed tables' schedule column: room for registered schedules' longer names too
ABLATIONS = (("intra", "oppo-intra"), ("inter", "oppo-inter"), ("both", "oppo"))
TOLERANCE = 0.20  # a simulated ratio within ±20 % of the paper's counts as reproduced


@dataclass
class Simulated:
    """Every run of every schedule of one configuration."""

    cfg: SimConfig
    runs: dict[str, list[RunResult]]
    summaries: dict[str, list[dict]]
    refused: dict[str, list[str]] = field(default_factory=dict)  # schedule -> why it cannot run this layout
    layouts: dict[str, SimConfig] = field(default_factory=dict)  # schedule -> the layout it ran (fitted)
    searched: bool = False  # each schedule in its own best layout (`best_layouts`): no like-for-like ablation
    beside: dict[str, tuple[SimConfig, list[dict]]] = field(default_factory=dict)  # not shipped: layout, summaries
    compared: list = field(default_factory=list)  # `equal_budget`'s rows (Comparison)


def run_all(cfg: SimConfig, schedules: tuple[str, ...] | None = None) -> Simulated:
    """Every schedule its framework can run in `cfg`'s layout (`sim.layouts`), each in that layout
    with vLLM's memory share fitted; the others refused with why."""
    sim = Simulated(cfg, {}, {})
    for s in schedules or schedule_names():
        fitted, reasons = layouts.check(cfg, s)
        if reasons:
            sim.refused[s] = reasons
        else:
            _run(sim, s, fitted)
    return sim


def _run(sim: Simulated, schedule: str, cfg: SimConfig) -> None:
    costs = cost_model.build(cfg)
    w = cfg.workload
    sim.runs[schedule] = [simulate(cfg, costs, schedule, w.seed + k) for k in range(w.seeds)]
    sim.summaries[schedule] = [summarize(r, w.warmup_steps) for r in sim.runs[schedule]]
    sim.layouts[schedule] = cfg


def best_layouts(cfg: SimConfig, schedules: tuple[str, ...]) -> tuple[Simulated, dict[str, list[tuple[str, float]]],
                                                                       layouts.Searched]:
    """Each schedule in every layout of `cfg`'s GPUs it can run (one seed each), then in its best
    (lowest mean time per step) with every seed. Returns the best runs, each schedule's tried layouts
    (description, mean step s), and the search space (with the layouts that do not fit)."""
    space = layouts.search_space(cfg, schedules)
    sim = Simulated(cfg, {}, {}, searched=True)
    tried = {}
    for s in schedules:
        scores = []
        for trial in space.runnable[s]:
            one = dataclasses.replace(trial, workload=dataclasses.replace(trial.workload, seeds=1))
            r = simulate(one, cost_model.build(one), s, one.workload.seed)
            scores.append((summarize(r, one.workload.warmup_steps)["mean_step_s"], trial))
        if not scores:
            sim.refused[s] = ["no layout of these GPUs that its framework can run fits"]
            continue
        scores.sort(key=lambda x: x[0])
        tried[s] = [(layouts.describe(t.split, layouts.streams_reference_actors(cfg, s)), m) for m, t in scores]
        _run(sim, s, scores[0][1])
    return sim, tried, space


def print_layouts(sim: Simulated, tried: dict[str, list[tuple[str, float]]] | None = None) -> None:
    """Each schedule's layout (and, after a search, the runner-up), then the schedules refused."""
    print()
    where = {s: layouts.describe(c.split, layouts.streams_reference_actors(c, s)) for s, c in sim.layouts.items()}
    lw = name_width(where.values(), 44)
    runner_up = "  runner-up (1 seed)" if tried else ""
    print(f"{'schedule':<{NAME_W}} {'layout (a node)':<{lw}} {'vLLM mem':>8}{runner_up}")
    for s, c in sim.layouts.items():
        share = f"{c.workload.kv_cache_fraction:.2f}" if c.hardware is not None else "-"
        extra = ""
        if tried and len(tried[s]) > 1:
            extra = f"  {tried[s][1][0]} {tried[s][1][1]:.2f} s (of {len(tried[s])} layouts)"
        print(f"{s:<{NAME_W}} {where[s]:<{lw}} {share:>8}{extra}")
    for s, reasons in sim.refused.items():
        print(f"{s:<{NAME_W}} not simulated: " + "; ".join(reasons))
    print("vLLM mem: its gpu_memory_utilization (colocated without sleep: what training leaves it; beside "
          "streaming actors: what they leave)")


def trained_tokens_per_s(result: RunResult, warmup_steps: int) -> float | None:
    """Response tokens trained per second over the window `bench schedules` measures: the
    steps after warm-up, from the last warm-up step's event to the last step's (after its sync)."""
    steps = result.steps[max(0, warmup_steps - 1):]
    if len(steps) < 2 or steps[-1].sync_end_s <= steps[0].sync_end_s:
        return None
    return sum(s.tokens for s in steps[1:]) / (steps[-1].sync_end_s - steps[0].sync_end_s)


def bench_rows(sim: Simulated) -> list[dict]:
    """Rows of `bench schedules`' table."""
    results = {}
    warmup = sim.cfg.workload.warmup_steps
    for s, sums in sim.summaries.items():
        results[s] = [{"returncode": 0, "median_step_s": x["median_step_s"], "mean_step_s": x["mean_step_s"],
                       "trained_tokens_per_s": trained_tokens_per_s(r, warmup), "wall_s": r.steps[-1].train_end_s,
                       "oppo/deferred_fraction": x["deferred"] if s not in BASELINES else None,
                       "oppo/scorer_idle_fraction": 1.0 - x["util"]["reward"] if s not in BASELINES else None}
                      for x, r in zip(sums, sim.runs[s])]
    return bench_schedules.report(results)


def print_tables(sim: Simulated) -> None:
    w = sim.cfg.workload
    print(f"simulated: preset {sim.cfg.name}, {w.steps} steps a run ({w.warmup_steps} warm-up), "
          f"{w.seeds} seeds a schedule; B = {w.batch_groups} groups x n = {w.samples_per_group}")
    bench_schedules.print_report(bench_rows(sim))
    print("(simulated: 'runs' are seeds; 'wall s' is simulated seconds; 'idle' is the reward servers' idle share)")
    print()
    print(f"{'schedule':<{NAME_W}} {'util rollout':>13} {'util reward':>12} {'util train':>11} {'seqs/iteration':>15}")
    for s, sums in sim.summaries.items():
        u = {k: statistics.median(x["util"][k] for x in sums) for k in ("rollout", "reward", "train")}
        seqs = statistics.median(x["seqs_per_iteration"] for x in sums)
        print(f"{s:<{NAME_W}} {u['rollout']:>13.2f} {u['reward']:>12.2f} {u['train']:>11.2f} {seqs:>15.1f}")
    print("util: busy device-seconds / (devices x measured window), median over seeds "
          "(rollout: engines decoding; reward: reward servers; train: the training devices); seqs/iteration: "
          "sequences an engine iteration decodes, on average over the window (a memory-bound iteration "
          "costs about the same for few as for many: busy engines with few sequences are not full)")
    drifts = {s: window_drift(sim, s) for s in sim.runs}
    drift = {s: d for s, d in drifts.items() if abs(d) > WINDOW_DRIFT}
    if drift:
        print("window: the mean step of the second half of the measured steps against the first (median over seeds) "
              + ", ".join(f"{s} {d:+.0%}" for s, d in drift.items())
              + f"; beyond {WINDOW_DRIFT:.0%}, the mean of that schedule depends on where the window ends (steps "
              "alternating long and short, or a run still filling up): raise workload.steps")


WINDOW_DRIFT = 0.05  # the halves of a measured window that differ by more than this are reported


def window_drift(sim: Simulated, schedule: str) -> float:
    """Median over seeds of (mean step of the measured steps' second half / the first half's) - 1."""
    return statistics.median(x["window_drift"] for x in sim.summaries[schedule])


def speedups(sim: Simulated, schedule: str) -> list[float]:
    """Seed by seed: sync's time per step / this schedule's (the paper's ratios are time-to-reward:
    time per step, not its median)."""
    return [b["mean_step_s"] / x["mean_step_s"] for b, x in zip(sim.summaries["sync"], sim.summaries[schedule])]


def calibrates(sim: Simulated) -> bool:
    """Whether the paper's ablation table can be made: a preset with its figures, and sync and
    every ablation's schedule simulated in the preset's one layout."""
    return bool(sim.cfg.paper.both) and not sim.searched and {"sync", *(s for _, s in ABLATIONS)} <= set(sim.runs)


def calibration_rows(sim: Simulated) -> list[dict]:
    p = sim.cfg.paper
    rows = []
    for key, schedule in ABLATIONS:
        ratios = speedups(sim, schedule)
        target = getattr(p, key)
        med = statistics.median(ratios)
        # a band that holds 1.00 (no effect at all) decides nothing: no verdict
        decisive = abs(1.0 / target - 1.0) > TOLERANCE
        rows.append({"ablation": key, "schedule": schedule, "simulated": med, "min": min(ratios), "max": max(ratios),
                     "paper": target, "rel": med / target,
                     "ok": abs(med / target - 1.0) <= TOLERANCE if decisive else None})
    return rows


def print_calibration(sim: Simulated) -> None:
    print()
    print(f"calibration against the paper ({sim.cfg.paper.source}): speedup over sync per step")
    print(f"{'ablation':<9} {'schedule':<{NAME_W}} {'simulated':>22} {'paper':>6} {'sim/paper':>10}  verdict (±20%)")
    for r in calibration_rows(sim):
        spread = f"{r['simulated']:.2f} [{r['min']:.2f}-{r['max']:.2f}]"
        if r["ok"] is None:
            verdict = "no verdict: the band holds 1.00, no effect"
        elif r["ok"]:
            verdict = "within"
        elif r["rel"] < 1:
            verdict = "MISS: too low"
        else:
            verdict = "MISS: too high"
        print(f"{r['ablation']:<9} {r['schedule']:<{NAME_W}} {spread:>22} {r['paper']:>6.2f} {r['rel']:>10.2f}  "
              f"{verdict}")
    print("simulated: sync's mean step s / the schedule's, seed by seed, median [min-max]; the paper's figures are "
          "time-to-reward speedups (same samples per step, so per-step time is their proxy)")


# ------------------------------------------------------------- equal version budgets


def _summaries(sim: Simulated, schedule: str) -> list[dict]:
    """A schedule's summaries, seed by seed (`beside` runs too)."""
    return sim.summaries[schedule] if schedule in sim.summaries else sim.beside[schedule][1]


def step_s(sim: Simulated, schedule: str) -> float:
    """A schedule's mean step s, median over seeds (`beside` runs too)."""
    return statistics.median(x["mean_step_s"] for x in _summaries(sim, schedule))


def budgets(sim: Simulated) -> dict[str, int]:
    """Each simulated schedule's version budget (`drivers.version_budget`)."""
    out = {s: version_budget(c, s) for s, c in sim.layouts.items()}
    out.update({s: version_budget(c, s) for s, (c, _) in sim.beside.items()})
    return out


@dataclass
class Comparison:
    """OPPO's fastest schedule against OpenRLHF's fastest, both within one version budget."""

    budget: int
    oppo: str
    openrlhf: str
    ratios: list[float]  # seed by seed: OpenRLHF's mean step / OPPO's
    openrlhf_as: str = "as shipped"  # or "same transport": OpenRLHF's async with OPPO's sync transport
    band: band_model.Band | None = None

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)


def _ratios(sim: Simulated, num: str, den: str) -> list[float]:
    pairs = zip(_summaries(sim, num), _summaries(sim, den), strict=False)
    return [a["mean_step_s"] / b["mean_step_s"] for a, b in pairs]


def equal_budget(sim: Simulated) -> list[Comparison]:
    """At each version budget L an OPPO schedule has: OPPO's fastest schedule of budget <= L against
    OpenRLHF's fastest of budget <= L (equal budget: the same most versions a trained token may lag),
    as shipped and, where one was simulated (`add_same_transport`) and is the faster, with OPPO's sync
    transport (a shipped mode still the faster: the "as shipped" row stands for both); and, where the
    modes were simulated with OPPO's old-log-prob cut (`add_same_cut`), the fastest of them ("same cut")."""
    b = budgets(sim)
    oppo = [s for s in sim.runs if s not in BASELINES]
    shipped = [s for s in sim.runs if s in BASELINES]
    transport = [s for s in sim.beside if s == SAME_TRANSPORT]
    pools = (("as shipped", shipped), ("same transport", [*shipped, *transport]),
             ("same cut", [s for s in sim.beside if s.endswith(CUT)]))  # every mode with the cut: always a row
    rows = []
    for level in sorted({b[s] for s in oppo}):
        x = min((s for s in oppo if b[s] <= level), key=lambda s: step_s(sim, s))
        for label, pool in pools:
            ys = [s for s in pool if b[s] <= level]
            if not ys:
                continue
            y = min(ys, key=lambda s: step_s(sim, s))
            if label == "same transport" and y not in transport:
                continue
            rows.append(Comparison(level, x, y, _ratios(sim, y, x), label))
    return rows


def headline_budget(sim: Simulated) -> int | None:
    """The budget of OPPO's fastest schedule (its row is the headline), None without one."""
    oppo = [s for s in sim.runs if s not in BASELINES]
    if not oppo:
        return None
    return budgets(sim)[min(oppo, key=lambda s: step_s(sim, s))]


def add_same_transport(sim: Simulated) -> str | None:
    """Where OPPO's fastest schedule syncs in the background (`staleness.background_sync`, with the
    preset's `staleness.background_sync_buffer`), OpenRLHF's async trainer with that transport
    (`drivers.SAME_TRANSPORT`): in `async`'s best layout and in OPPO's, where its flags can place it
    and it fits with the buffer, the faster (one seed) with every seed. Its name, or None."""
    oppo = [s for s in sim.runs if s not in BASELINES]
    if not oppo:
        return None
    best = min(oppo, key=lambda s: step_s(sim, s))
    if not layouts.syncs_in_background(sim.layouts[best], best):
        return None
    critic = sim.cfg.workload.critic
    trials = []
    for s in ("async", best):
        if s not in sim.layouts:
            continue
        split = sim.layouts[s].split
        if layouts.rule(SAME_TRANSPORT, split, critic=critic) is not None:
            continue
        trial = memory.fit_engines(dataclasses.replace(sim.cfg, split=split), False, True)
        if memory.overflow(trial, False, False, True):
            continue
        one = dataclasses.replace(trial, workload=dataclasses.replace(trial.workload, seeds=1))
        r = simulate(one, cost_model.build(one), SAME_TRANSPORT, one.workload.seed)
        trials.append((summarize(r, one.workload.warmup_steps)["mean_step_s"], trial))
    if not trials:
        return None
    cfg = min(trials, key=lambda t: t[0])[1]
    w = cfg.workload
    costs = cost_model.build(cfg)
    sums = [summarize(simulate(cfg, costs, SAME_TRANSPORT, w.seed + k), w.warmup_steps) for k in range(w.seeds)]
    sim.beside[SAME_TRANSPORT] = (cfg, sums)
    return SAME_TRANSPORT


def add_same_cut(sim: Simulated) -> list[str]:
    """Where an OPPO schedule takes old log-probs from the rollout (`train.old_logprobs`), every OpenRLHF mode
    simulated with the same cut (`drivers.CUT`), in its layout, every seed: what OpenRLHF could do with it.
    Their names."""
    if not any(s not in BASELINES and schedule_oppo(c, s).train.old_logprobs == "rollout"
               for s, c in sim.layouts.items()):
        return []
    names = []
    for s in [s for s in sim.runs if s in BASELINES]:
        cfg = sim.layouts[s]
        w = cfg.workload
        costs = cost_model.build(cfg)
        sums = [summarize(simulate(cfg, costs, s + CUT, w.seed + k), w.warmup_steps) for k in range(w.seeds)]
        sim.beside[s + CUT] = (cfg, sums)
        names.append(s + CUT)
    return names


def add_bands(sim: Simulated, rows: list[Comparison], seeds: int = 1) -> None:
    """Each row's band (`sim.bands`), its schedules in their layouts."""
    where = {**sim.layouts, **{s: c for s, (c, _) in sim.beside.items()}}
    pairs = sorted({(r.openrlhf, r.oppo) for r in rows})
    found = band_model.bands(pairs, where, {(r.openrlhf, r.oppo): r.ratio for r in rows}, seeds)
    for r in rows:
        r.band = found[(r.openrlhf, r.oppo)]


def print_budgets(sim: Simulated) -> None:
    """Every schedule's version budget, step and measured lags."""
    w = sim.cfg.workload
    b = budgets(sim)
    print()
    print(f"{'schedule':<{NAME_W}} {'budget':>6} {'step s':>7} {'max lag':>7} "
          + " ".join(f"{'lag ' + k:>6}" for k in ("0", "1", "2", "3+")))
    for s in [*sim.runs, *sim.beside]:
        st = [staleness(r, w.warmup_steps) for r in sim.runs[s]] if s in sim.runs else []
        st = [x for x in st if x is not None]
        if st:
            measured = (f"{max(x['max_lag'] for x in st):>7} "
                        + " ".join(f"{statistics.median(x['lag_share'][k] for x in st):>6.2f}"
                                   for k in ("0", "1", "2", "3+")))
        else:
            measured = f"{'-':>7}"
        print(f"{s:<{NAME_W}} {b[s]:>6} {step_s(sim, s):>7.2f} {measured}")
    print("budget: the most policy versions a trained token may lag the weights that train it, by the schedule's "
          "construction (sync 0; async, partial 1; over-sampling at kB prompts a call k; OPPO: max_deferral_steps at "
          "lag 0, min(max_policy_lag, max_deferral_steps + 1) with async admission; 0 / 1 without carry-over); "
          "measured after warm-up: the largest lag over seeds, each lag's share of trained tokens (median over seeds)"
          + (f"; {SAME_TRANSPORT}: OpenRLHF's async with OPPO's sync transport, not its shipped code "
             "(every seed, its lags not recorded)" if SAME_TRANSPORT in sim.beside else "")
          + ("; +cut: an OpenRLHF mode with OPPO's old-log-prob cut (every seed, its lags not recorded)"
             if any(s.endswith(CUT) for s in sim.beside) else ""))


def print_equal_budget(sim: Simulated, rows: list[Comparison], band_seeds: int | None = None) -> None:
    if not rows:
        return
    head = headline_budget(sim)
    print()
    print("OPPO against OpenRLHF's best at equal version budget (each side's fastest schedule whose budget is at "
          "most the row's)")
    print(f"{'budget':>6}  {'OPPO':<{NAME_W}} {'step s':>7}  {'OpenRLHF':<{NAME_W}} {'step s':>7}  {'':<14} "
          f"{'OPPO ÷ OpenRLHF':>22}  band")
    for r in rows:
        mark = "*" if r.budget == head else " "
        spread = f"{r.ratio:.2f} [{min(r.ratios):.2f}-{max(r.ratios):.2f}]"
        band = "-"
        if r.band is not None:
            band = f"{r.band.low:.2f}-{r.band.high:.2f} (low: {r.band.extremes[0]}; high: {r.band.extremes[1]})"
        print(f"{r.budget:>5}{mark}  {r.oppo:<{NAME_W}} {step_s(sim, r.oppo):>7.2f}  {r.openrlhf:<{NAME_W}} "
              f"{step_s(sim, r.openrlhf):>7.2f}  {r.openrlhf_as:<14} {spread:>22}  {band}")
    print("*: the budget of OPPO's fastest schedule (the headline). ratio: OpenRLHF's mean step / OPPO's, seed by "
          "seed, median [min-max]; 'same transport': OpenRLHF's best with its async trainer given OPPO's background "
          "sync and its buffer (staleness.background_sync_buffer) beside the shipped modes; 'same cut': OpenRLHF's "
          "best with OPPO's old-log-prob cut (+cut: the actor's forward only for samples holding a token older than "
          "the weights that train them, train.old_logprobs) beside the shipped modes")
    if band_seeds is not None:
        ranges = ", ".join(f"{c.key.split('.', 1)[1]} {c.low:g}-{c.high:g}" for c in band_model.CONSTANTS)
        print(f"band: the lowest and highest ratio with each assumed constant at its low and high, one at a time "
              f"(sim.bands: {ranges}), "
              f"each schedule in its layout above, {band_seeds} seed{'s' if band_seeds > 1 else ''}, "
              f"{sim.cfg.workload.steps} steps; the preset's ratio is inside it")


# ---------------------------------------------------------------------------- timelines


def write_timeline(result: RunResult, run_dir: Path) -> Path:
    """The run's rows as `RUN_DIR/timeline/sim-0.jsonl` (openrlhf_oppo.timeline's format)."""
    tl = run_dir / "timeline"
    tl.mkdir(parents=True, exist_ok=True)
    path = tl / "sim-0.jsonl"
    with open(path, "w") as fh:
        for row in result.rows:
            fh.write(json.dumps(row, separators=(",", ":")) + "\n")
    return path


def write_outputs(sim: Simulated, out: Path, plot_schedules: tuple[str, ...] = ("sync", "oppo"),
                  plot_steps: int = 4) -> list[Path]:
    """Timelines of each schedule's first seed (`openrlhf-oppo plot timeline OUT/<schedule>` draws
    any of them), summary.json, and one PNG drawn by bench.plot: the two schedules on one time
    scale (or the one schedule's timeline)."""
    from openrlhf_oppo.bench import plot

    out.mkdir(parents=True, exist_ok=True)
    rows = bench_rows(sim)
    for s, rs in sim.runs.items():
        write_timeline(rs[0], out / s)
    (out / "summary.json").write_text(json.dumps(
        {"preset": sim.cfg.name, "rows": rows, "verdict": asdict(bench_schedules.verdict(rows)),
         "calibration": calibration_rows(sim) if calibrates(sim) else None,
         "version_budgets": budgets(sim) if sim.runs else {},
         "equal_budget": [{"budget": r.budget, "oppo": r.oppo, "openrlhf": r.openrlhf, "openrlhf_as": r.openrlhf_as,
                           "ratio": r.ratio, "ratios": r.ratios,
                           "band": asdict(r.band) if r.band is not None else None} for r in sim.compared]}, indent=1,
        default=str))
    first = sim.cfg.workload.warmup_steps
    pngs = []
    drawn = [s for s in plot_schedules if s in sim.runs]
    if len(drawn) == 1:
        pngs.append(plot.plot_timeline(out / drawn[0], out / f"timeline-{drawn[0]}.png", first, plot_steps))
    if len(drawn) == 2:
        pngs.append(plot.plot_compare(out / drawn[0], out / drawn[1], out / f"compare-{drawn[0]}-{drawn[1]}.png",
                                      first, plot_steps))
    return pngs


# ------------------------------------------------------------------------------- sweeps


def print_sweep(points: list[tuple[str, Simulated]], schedules: tuple[str, ...]) -> None:
    cols = [f"{s} step s" for s in schedules] + [f"x sync {s}" for s in schedules if s != "sync"]
    print(f"{'value':<28} " + " ".join(f"{c:>17}" for c in cols))
    for label, sim in points:
        cells = [_step_cell(sim, s) for s in schedules]
        if "sync" in schedules:
            cells += [_speedup_cell(sim, s) for s in schedules if s != "sync"]
        print(f"{label:<28} " + " ".join(f"{c:>17}" for c in cells))
    print("step s: time per step (mean over measured steps), median over seeds; x sync: sync's / the schedule's")


def _step_cell(sim: Simulated, schedule: str) -> str:
    """The schedule's mean step s (median over seeds), or "refused"."""
    if schedule not in sim.summaries:
        return "refused"
    return f"{statistics.median(x['mean_step_s'] for x in sim.summaries[schedule]):.2f}"


def _speedup_cell(sim: Simulated, schedule: str) -> str:
    """sync's mean step over the schedule's (median over seeds), or "-" where either was refused."""
    if not {schedule, "sync"} <= set(sim.summaries):
        return "-"
    return f"{statistics.median(speedups(sim, schedule)):.2f}"


def plot_sweep(points: list[tuple[str, Simulated]], schedules: tuple[str, ...], title: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, _ in points]
    xs = list(range(len(points)))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for s in schedules:  # a schedule refused at a point (its layout) has no marker there
        at = [(i, sim.summaries[s]) for i, (_, sim) in enumerate(points) if s in sim.summaries]
        if not at:
            continue
        med = [statistics.median(x["mean_step_s"] for x in sums) for _, sums in at]
        lo = [min(x["mean_step_s"] for x in sums) for _, sums in at]
        hi = [max(x["mean_step_s"] for x in sums) for _, sums in at]
        ax.plot([i for i, _ in at], med, marker="o", label=s)
        ax.fill_between([i for i, _ in at], lo, hi, alpha=0.15)
    ax.set_xticks(xs, labels, fontsize=7, rotation=15)
    ax.set_ylabel("simulated time per step (s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")
    return out
