"""`python -m oppo_lab published`: the simulator's absolute scale against published runs.

    python -m oppo_lab published [--heldout | --fitted] [--presets NAME ...] [--set key=value ...]
    python -m oppo_lab published --fit KEY LO HI [--presets NAME ...]

Every preset with a `published:` section (a published run's time per step and stage split,
sources in the preset's comments) is simulated with the schedule its run used (`sync`, or the
one `heldout.SCHEDULES` names) and printed beside the published figures: time per step, the
ratio, a verdict (within ±30 %, or a MISS), then the stage split; and for each published
async/sync pair (`heldout.PAIRS`), the simulated async/sync ratio against the published one
(within ±20 %). The runs are printed in two tables: the held-out set, whose count is the
verdict, and the fitted set (`heldout.FITTED`: constants may be fitted on these, so their
figures are no verdict). Efficiencies are the presets' own, one set for every hardware kind
fixed before the comparison.

`--fit KEY LO HI` is the one fit made here: the value of a numeric preset key (e.g.
`efficiency.train_mfu`) in [LO, HI] that brings the geometric mean of simulated / published
step time over the named presets to 1 (bisection; the key must move the step one way). It
refuses any preset that is not in the fitted set before simulating anything.

A stage's simulated seconds are the mean per measured step of the run's recorded spans
(`world.experience_and_train`, `World.weight_sync`), covered time in the window the step
latency is measured over (after warm-up).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from openrlhf_oppo import timeline
from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import drivers, presets
from openrlhf_oppo.sim.world import RunResult
from oppo_lab import sim as lab_sim
from oppo_lab.sim import heldout

TOLERANCE = 0.30  # a simulated step time within ±30 % of the published one counts as matched
# Table column -> the recorded spans it sums: (role, stage); a role of None is any role.
STAGES: dict[str, tuple[tuple[str, str], ...]] = {
    "generation": (("driver", "generate"),),
    "old_logprobs": (("actor", "old_logprobs"),),
    "reference": (("ref", "ref_logprobs"),),
    "values": (("critic", "values"),),
    "reward": (("reward", "score"),),
    "update": (("driver", "train"),),
    "weight_sync": (("driver", "weight_sync"),),
    "experience": (("driver", "generate"), ("driver", "make_experience")),
}
HEADERS = {"generation": "gen", "old_logprobs": "old-lp", "reference": "ref", "values": "values",
           "reward": "reward", "update": "update", "weight_sync": "w-sync", "experience": "gen+exp"}


@dataclass(frozen=True)
class Row:
    """One published run against its simulation."""

    preset: str
    schedule: str  # the schedule the published run used
    gpus: str  # e.g. "8 x h200"
    lengths: str  # e.g. "94+151/1024": prompt + mean response / cap, tokens
    simulated_step_s: float  # mean time per measured step, median over seeds
    published_step_s: float
    simulated: dict[str, float]  # stage -> mean seconds per measured step (first seed)
    published: dict[str, float]  # stage -> seconds (published stages only)

    @property
    def ratio(self) -> float:
        return self.simulated_step_s / self.published_step_s


@dataclass(frozen=True)
class PairRow:
    """A published async/sync pair: the async run's step time over the sync run's, simulated and published."""

    pair: heldout.Pair
    sync_s: float  # simulated
    async_s: float

    @property
    def ratio(self) -> float:
        return self.async_s / self.sync_s

    @property
    def against_published(self) -> float:
        return self.ratio / self.pair.published_ratio


def pair_verdict(simulated: float, published: float, tolerance: float = heldout.PAIR_TOLERANCE) -> str:
    """'within' when simulated / published ratio is within ±tolerance; no verdict where the band
    around the published ratio holds 1.00 (a simulator that saw no effect at all would pass it)."""
    if published * (1 - tolerance) <= 1.0 <= published * (1 + tolerance):
        return "no verdict: the band holds 1.00"
    return verdict(simulated / published, tolerance)


def verdict(ratio: float, tolerance: float = TOLERANCE) -> str:
    """'within' when simulated / published is within ±tolerance; else a MISS saying which way."""
    if abs(ratio - 1.0) <= tolerance + 1e-12:
        return "within"
    return "MISS: too fast" if ratio < 1.0 else "MISS: too slow"


def published_presets() -> list[str]:
    """Presets with a published step time."""
    return [name for name in lab_sim.preset_names() if lab_sim.load_preset(name).published.step_s > 0]


def published_stages(p: presets.PublishedRun) -> dict[str, float]:
    return {stage: getattr(p, f"{stage}_s") for stage in STAGES if getattr(p, f"{stage}_s") > 0}


def stage_split(result: RunResult, warmup_steps: int) -> dict[str, float]:
    """Mean seconds per measured step of every stage: its spans' covered time in the window
    step latency is measured over (from the last warm-up step's training end to the last)."""
    ends = [s.train_end_s for s in result.steps]
    t0, t1 = ends[max(0, warmup_steps - 1)], ends[-1]
    steps = len(ends) - max(1, warmup_steps)
    out = {}
    for stage, keys in STAGES.items():
        spans = [(r["t0"], r["t1"]) for r in result.rows
                 if r["kind"] == "span" and (r["role"], r["stage"]) in keys]
        out[stage] = timeline.covered_s(spans, t0, t1) / steps
    return out


def simulate(cfg: presets.SimConfig) -> Row:
    """The preset simulated with the schedule its published run used."""
    schedule = heldout.schedule(cfg.name)
    costs = cost_model.build(cfg)
    w, s = cfg.workload, cfg.split
    runs = [drivers.simulate(cfg, costs, schedule, w.seed + k) for k in range(w.seeds)]
    step_s = statistics.median(drivers.summarize(r, w.warmup_steps)["mean_step_s"] for r in runs)
    gpus = s.devices
    ln = cfg.lengths
    lengths = f"{ln.prompt_tokens}+{ln.mean_tokens:g}/{ln.cap_tokens}" if ln.kind == "lognormal" else ln.kind
    return Row(cfg.name, schedule, f"{gpus} x {cfg.hardware.name}", lengths, step_s, cfg.published.step_s,
               stage_split(runs[0], w.warmup_steps), published_stages(cfg.published))


def print_table(rows: list[Row], title: str = "", count: bool = True) -> None:
    """Step time and stage split of each row; `count`: the within count is a verdict (held-out rows)."""
    print(title or f"absolute scale: time per step simulated vs published (verdict: within ±{TOLERANCE:.0%})")
    print(f"{'run':<36} {'schedule':<8} {'GPUs':<12} {'tokens':<15} {'sim s':>7} {'pub s':>7} {'sim/pub':>7}  "
          f"{'verdict' if count else 'in-sample check'}")
    for r in rows:
        print(f"{_short(r.preset):<36} {r.schedule:<8} {r.gpus:<12} {r.lengths:<15} {r.simulated_step_s:>7.1f} "
              f"{r.published_step_s:>7.1f} {r.ratio:>7.2f}  {verdict(r.ratio)}")
    within = sum(verdict(r.ratio) == "within" for r in rows)
    print(f"{within} of {len(rows)} within ±{TOLERANCE:.0%}" + ("" if count else " (in-sample for any constant "
          "fitted on them: no verdict)") + "; tokens: prompt + mean response / cap (assumed where not published: "
          "see each preset)")
    print()
    print("stage split, s per step: simulated/published ('-': not published apart)")
    print(f"{'run':<36} " + " ".join(f"{HEADERS[s]:>11}" for s in STAGES))
    for r in rows:
        cells = [f"{r.simulated[s]:.0f}/" + (f"{r.published[s]:.0f}" if s in r.published else "-") for s in STAGES]
        print(f"{_short(r.preset):<36} " + " ".join(f"{c:>11}" for c in cells))
    print("gen: waiting for the batch (verl's timing_s/gen also holds the weight resharding: w-sync here); in an "
          "async run, generation beside training (the published wait for the batch is step - old-lp - update); "
          "gen+exp: generation and make_experience as one figure (OpenRLHF's benchmark)")


def print_pairs(pairs: list[PairRow]) -> None:
    pct = f"{heldout.PAIR_TOLERANCE:.0%}"
    print(f"published async/sync pairs (held out): async step / sync step, simulated vs published "
          f"(verdict: the ratio within ±{pct} of the published one)")
    print(f"{'pair':<30} {'sim sync s':>10} {'sim async s':>11} {'sim ratio':>9} {'pub ratio':>9} "
          f"{'sim/pub':>7}  verdict")
    for p in pairs:
        print(f"{p.pair.name:<30} {p.sync_s:>10.1f} {p.async_s:>11.1f} {p.ratio:>9.2f} {p.pair.published_ratio:>9.2f} "
              f"{p.against_published:>7.2f}  {pair_verdict(p.ratio, p.pair.published_ratio)}")
    within = sum(pair_verdict(p.ratio, p.pair.published_ratio) == "within" for p in pairs)
    print(f"{within} of {len(pairs)} pairs within ±{pct}; sources: " + "; ".join(
        sorted({p.pair.source for p in pairs})))
    for line in heldout.NOT_MODELLED:
        print(f"found, not modelled: {line}")


def fit_constant(key: str, names: list[str], lo: float, hi: float, sets: list[str] | tuple[str, ...] = (),
                 iterations: int = 12, simulate_fn: Callable[[presets.SimConfig], Row] | None = None) -> float:
    """The value of preset key `key` in [lo, hi] at which the geometric mean of simulated /
    published step time over `names` is 1 (bisection on log(value); the key must move the step
    time one way). Refuses a run outside the fitted set (`heldout.require_fittable`) first."""
    heldout.require_fittable(names, f"--fit {key}")
    if not 0 < lo < hi:
        raise ValueError(f"--fit {key}: needs 0 < LO < HI, got {lo} and {hi}")
    run = simulate_fn or simulate

    def log_ratio(value: float) -> float:
        rows = [run(lab_sim.load_preset(n, [*sets, f"{key}={value:.6g}"])) for n in names]
        return statistics.fmean(math.log(r.ratio) for r in rows)

    a, b = math.log(lo), math.log(hi)
    fa, fb = log_ratio(lo), log_ratio(hi)
    if fa * fb > 0:
        raise ValueError(f"--fit {key}: simulated / published does not cross 1 in [{lo}, {hi}] "
                         f"(geometric means {math.exp(fa):.2f} and {math.exp(fb):.2f})")
    for _ in range(iterations):
        m = (a + b) / 2
        fm = log_ratio(math.exp(m))
        if (fm > 0) == (fa > 0):
            a, fa = m, fm
        else:
            b = m
    return math.exp((a + b) / 2)


def paper_rows(name: str) -> list[dict]:
    """The paper preset's ablation speed-ups, simulated (`report.calibration_rows`: each ablation's
    schedule against sync, in the paper's layout)."""
    from openrlhf_oppo.sim import report

    cfg = lab_sim.load_preset(name)
    sim = report.run_all(cfg, ("sync", *(schedule for _, schedule in report.ABLATIONS)))
    return report.calibration_rows(sim)


def print_paper(tables: dict[str, list[dict]]) -> None:
    print("the OPPO paper's ablation speed-ups over sync (held out): simulated vs paper (verdict: within ±20%; "
          "none where the band holds 1.00)")
    print(f"{'preset':<16} {'ablation':<9} {'schedule':<12} {'sim':>5} {'paper':>6} {'sim/paper':>9}  verdict")
    decided = within = 0
    for name, rows in tables.items():
        for r in rows:
            v = ("no verdict: the band holds 1.00" if r["ok"] is None else
                 "within" if r["ok"] else f"MISS: too {'low' if r['rel'] < 1 else 'high'}")
            decided += r["ok"] is not None
            within += bool(r["ok"])
            print(f"{name:<16} {r['ablation']:<9} {r['schedule']:<12} {r['simulated']:>5.2f} {r['paper']:>6.2f} "
                  f"{r['rel']:>9.2f}  {v}")
    print(f"{within} of {decided} decided rows within ±20%")


def heldout_pairs(rows: dict[str, Row]) -> list[PairRow]:
    """Every pair whose two presets were simulated."""
    return [PairRow(p, rows[p.sync_preset].simulated_step_s, rows[p.async_preset].simulated_step_s)
            for p in heldout.PAIRS if p.sync_preset in rows and p.async_preset in rows]


def _short(preset: str) -> str:
    return preset.removeprefix("published-")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m oppo_lab published", description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--heldout", action="store_true",
                       help="the held-out set only (heldout.HELD_OUT): its runs and async/sync pairs, the verdict")
    which.add_argument("--fitted", action="store_true",
                       help="the fitted set only (heldout.FITTED): in-sample for any constant fitted on it")
    p.add_argument("--presets", nargs="+", default=None, metavar="NAME",
                   help="published presets to simulate (default: every preset with a published: section)")
    p.add_argument("--set", dest="sets", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                   help="edit every simulated preset (e.g. lengths.mean_tokens=500), for sensitivity")
    p.add_argument("--fit", nargs=3, default=None, metavar=("KEY", "LO", "HI"),
                   help="fit one numeric key (e.g. efficiency.train_mfu 0.1 0.6) on --presets (default: the "
                        "fitted set's published presets); refuses a held-out preset")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    sets = [s for group in args.sets for s in group]
    names = args.presets or published_presets()
    if args.fit:
        key, lo, hi = args.fit[0], float(args.fit[1]), float(args.fit[2])
        fit_names = args.presets or [n for n in published_presets() if heldout.placement(n) == "fitted"]
        value = fit_constant(key, fit_names, lo, hi, sets)
        print(f"{key} = {value:.4g}: geometric mean of simulated / published step time 1 over "
              f"{', '.join(map(_short, fit_names))} (fitted set: these runs' figures are in-sample from now on)")
        return 0
    cfgs = [lab_sim.load_preset(name, sets) for name in names]  # every preset and --set validated first
    missing = [c.name for c in cfgs if c.published.step_s <= 0 or c.hardware is None]
    if missing:
        raise ValueError(f"--presets: {', '.join(missing)} has no published: section with step_s "
                         f"(or no hardware); allowed: {', '.join(published_presets())}")
    held = [c for c in cfgs if heldout.placement(c.name) == "held out"]
    fitted = [c for c in cfgs if heldout.placement(c.name) == "fitted"]
    unplaced = [c.name for c in cfgs if heldout.placement(c.name) == "unplaced"]
    t0 = time.perf_counter()
    if not args.fitted:
        rows = {c.name: simulate(c) for c in held}
        print_table(list(rows.values()),
                    f"HELD-OUT SET (oppo_lab/sim/heldout.py; no constant fitted on these): time per step "
                    f"simulated vs published (verdict: within ±{TOLERANCE:.0%})")
        print()
        print_pairs(heldout_pairs(rows))
        if args.presets is None:  # the paper's ablations too: every held-out ratio
            print()
            print_paper({n: paper_rows(n) for n in heldout.HELD_OUT if n.startswith("paper-")})
    if unplaced:
        print(f"in neither set, not simulated (place it in oppo_lab/sim/heldout.py first): {', '.join(unplaced)}")
    if not args.heldout and fitted:
        if not args.fitted:
            print()
        print_table([simulate(c) for c in fitted],
                    "FITTED SET (oppo_lab/sim/heldout.py: constants may be fitted on these runs): time per step "
                    "simulated vs published", count=False)
    print(f"simulated in {time.perf_counter() - t0:.1f} s")
    return 0
