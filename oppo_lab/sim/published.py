"""`python -m oppo_lab published`: the simulator's absolute scale against published runs.

    python -m oppo_lab published [--presets NAME ...] [--set key=value ...]

Every preset with a `published:` section (a published run's time per step and stage split,
sources in the preset's comments) is simulated with the `sync` schedule (the published runs
are synchronous) and printed beside the published figures: time per step, the ratio, a
verdict (within ±30 %, or a MISS), then the stage split. Efficiencies are the presets' own,
one set per hardware kind fixed before the comparison; nothing here fits them.

A stage's simulated seconds are the mean per measured step of the run's recorded spans
(`world.experience_and_train`, `World.weight_sync`), covered time in the window the step
latency is measured over (after warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from openrlhf_oppo import timeline
from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import drivers, presets
from openrlhf_oppo.sim.world import RunResult
from oppo_lab import sim as lab_sim

SCHEDULE = "sync"
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
    gpus: str  # e.g. "8 x h200"
    lengths: str  # e.g. "94+151/1024": prompt + mean response / cap, tokens
    simulated_step_s: float  # mean time per measured step, median over seeds
    published_step_s: float
    simulated: dict[str, float]  # stage -> mean seconds per measured step (first seed)
    published: dict[str, float]  # stage -> seconds (published stages only)

    @property
    def ratio(self) -> float:
        return self.simulated_step_s / self.published_step_s


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
    costs = cost_model.build(cfg)
    w, s = cfg.workload, cfg.split
    runs = [drivers.simulate(cfg, costs, SCHEDULE, w.seed + k) for k in range(w.seeds)]
    step_s = statistics.median(drivers.summarize(r, w.warmup_steps)["mean_step_s"] for r in runs)
    gpus = s.devices
    ln = cfg.lengths
    lengths = f"{ln.prompt_tokens}+{ln.mean_tokens:g}/{ln.cap_tokens}" if ln.kind == "lognormal" else ln.kind
    return Row(cfg.name, f"{gpus} x {cfg.hardware.name}", lengths, step_s, cfg.published.step_s,
               stage_split(runs[0], w.warmup_steps), published_stages(cfg.published))


def print_table(rows: list[Row]) -> None:
    print(f"absolute scale: schedule {SCHEDULE}, time per step simulated vs published "
          f"(verdict: within ±{TOLERANCE:.0%})")
    print(f"{'run':<26} {'GPUs':<12} {'tokens':<15} {'sim s':>7} {'pub s':>7} {'sim/pub':>7}  verdict")
    for r in rows:
        print(f"{_short(r.preset):<26} {r.gpus:<12} {r.lengths:<15} {r.simulated_step_s:>7.1f} "
              f"{r.published_step_s:>7.1f} {r.ratio:>7.2f}  {verdict(r.ratio)}")
    within = sum(verdict(r.ratio) == "within" for r in rows)
    print(f"{within} of {len(rows)} within ±{TOLERANCE:.0%}; tokens: prompt + mean response / cap (assumed where "
          "not published: see each preset)")
    print()
    print("stage split, s per step: simulated/published ('-': not published apart)")
    print(f"{'run':<26} " + " ".join(f"{HEADERS[s]:>11}" for s in STAGES))
    for r in rows:
        cells = [f"{r.simulated[s]:.0f}/" + (f"{r.published[s]:.0f}" if s in r.published else "-") for s in STAGES]
        print(f"{_short(r.preset):<26} " + " ".join(f"{c:>11}" for c in cells))
    print("gen: waiting for the batch (verl's timing_s/gen also holds the weight resharding: w-sync here); "
          "gen+exp: generation and make_experience as one figure (OpenRLHF's benchmark)")


def _short(preset: str) -> str:
    return preset.removeprefix("published-")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m oppo_lab published", description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=None, metavar="NAME",
                   help="published presets to simulate (default: every preset with a published: section)")
    p.add_argument("--set", dest="sets", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                   help="edit every simulated preset (e.g. lengths.mean_tokens=500), for sensitivity")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    sets = [s for group in args.sets for s in group]
    names = args.presets or published_presets()
    cfgs = [lab_sim.load_preset(name, sets) for name in names]  # every preset and --set validated first
    missing = [c.name for c in cfgs if c.published.step_s <= 0 or c.hardware is None]
    if missing:
        raise ValueError(f"--presets: {', '.join(missing)} has no published: section with step_s "
                         f"(or no hardware); allowed: {', '.join(published_presets())}")
    t0 = time.perf_counter()
    print_table([simulate(cfg) for cfg in cfgs])
    print(f"simulated in {time.perf_counter() - t0:.1f} s")
    return 0
