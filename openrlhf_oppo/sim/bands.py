"""Bands on the simulator's headline ratios: the range a ratio takes when each assumed constant
moves across a plausible range, one constant at a time (`openrlhf-oppo simulate --best-layout`
prints them; `--no-band` leaves them out).

The constants and their ranges (preset keys, settable with `--set`):

    efficiency.phase_overhead_s        0.1 - 2.0 s  the fixed cost of a make_experience / train phase
                                                     (Ray round trips, ZeRO-3 set-up); the presets assume
                                                     1.0 s (GPU) and nothing measures it at scale: from a
                                                     tenth of a second (a warm Ray call and a gather) to
                                                     two (cold ZeRO-3 set-up on many ranks). While it moves
                                                     the sync's own fixed cost stays at its value.
    efficiency.sync_overhead_s         0.1 - 2.0 s  the weight sync's fixed cost to the trainer (the Ray
                                                     call on every rank, the ZeRO-3 walk): the same range
    efficiency.weight_sync_base_s      0.1 - 1.0 s  the engines' side of a sync (pause, NCCL group,
                                                     reload): the presets assume 0.5 s
    efficiency.train_mfu               0.11 - 0.50  ZeRO-3 forward + backward: published RLHF and
    efficiency.forward_mfu             0.11 - 0.50  pre-training runs sit between about 11 % and 50 %
                                                     of peak (the issue's "published runs" range)
    efficiency.decode_step_overhead_s  1.5 - 6 ms   vLLM's scheduling, sampling and launch per engine
                                                     iteration: half to twice the presets' 3 ms (CUDA
                                                     graphs at the low end, eager Python at the high);
                                                     stated for 7B and kept at 72B (TP 8 adds its
                                                     all-reduces to the weights' read, not to this)

Each band re-simulates only the compared schedules, each in the layout its search found at the
preset's constants (the layouts are not searched again), with `seeds` seeds (default 1: the
first) and the run's steps, at each constant's low and high. The band is the lowest and highest
ratio over those runs and the ratio at the preset's constants; `extremes` names the constant and
end that gave each side. A band is not a confidence interval: it says how far the ratio rests on
the constants, one at a time (two moving together may reach further).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim.drivers import simulate, summarize
from openrlhf_oppo.sim.presets import SimConfig


@dataclass(frozen=True)
class Constant:
    key: str  # "section.field" of the preset
    low: float
    high: float
    pins: tuple[str, ...] = ()  # fields of the same section held at their resolved value while it moves


CONSTANTS = (
    Constant("efficiency.phase_overhead_s", 0.1, 2.0, pins=("sync_overhead_s",)),
    Constant("efficiency.sync_overhead_s", 0.1, 2.0),
    Constant("efficiency.weight_sync_base_s", 0.1, 1.0),
    Constant("efficiency.train_mfu", 0.11, 0.50),
    Constant("efficiency.forward_mfu", 0.11, 0.50),
    Constant("efficiency.decode_step_overhead_s", 0.0015, 0.006),
)


def with_constant(cfg: SimConfig, const: Constant, value: float) -> SimConfig:
    """`cfg` with `const` at `value` (its pinned fields at their resolved values). A key the preset
    does not have is a ValueError naming it."""
    section_name, name = const.key.split(".", 1)
    section = getattr(cfg, section_name, None)
    if section is None or not hasattr(section, name):
        raise ValueError(f"band constant {const.key}: the preset has no such key")
    held = {}
    for pin in const.pins:
        current = getattr(section, pin)
        if pin == "sync_overhead_s" and current < 0:  # -1: the phase's cost, resolved before the phase moves
            current = section.phase_overhead_s
        held[pin] = current
    return dataclasses.replace(cfg, **{section_name: dataclasses.replace(section, **held, **{name: value})})


def mean_step_s(cfg: SimConfig, schedule: str, seeds: int) -> list[float]:
    """The schedule's mean step s in `cfg`'s layout, seed by seed (the first `seeds` of the preset's)."""
    w = cfg.workload
    costs = cost_model.build(cfg)
    return [summarize(simulate(cfg, costs, schedule, w.seed + k), w.warmup_steps)["mean_step_s"]
            for k in range(seeds)]


@dataclass
class Band:
    low: float
    high: float
    extremes: tuple[str, str]  # what gave the low and the high ("preset" or "key=value")
    by_constant: dict[str, tuple[float, float]]  # key -> ratio at its low, at its high


def bands(pairs: list[tuple[str, str]], layouts: dict[str, SimConfig], at_preset: dict[tuple[str, str], float],
          seeds: int = 1, constants: tuple[Constant, ...] = CONSTANTS,
          step_s=mean_step_s) -> dict[tuple[str, str], Band]:
    """For each (numerator, denominator) pair of schedules: the band of numerator's step / denominator's
    (OpenRLHF's best / OPPO's: OPPO's speed-up), each schedule in its layout in `layouts`;
    `at_preset`: each pair's ratio at the preset's constants (inside every band)."""
    needed = sorted({s for pair in pairs for s in pair})
    at: dict[tuple[str, float], dict[str, float]] = {}
    for const in constants:
        for value in (const.low, const.high):
            at[(const.key, value)] = {s: statistics.median(step_s(with_constant(layouts[s], const, value), s, seeds))
                                      for s in needed}
    out = {}
    for num, den in pairs:
        points = [(at_preset[(num, den)], "preset")]
        by_constant = {}
        for const in constants:
            lo = at[(const.key, const.low)][num] / at[(const.key, const.low)][den]
            hi = at[(const.key, const.high)][num] / at[(const.key, const.high)][den]
            by_constant[const.key] = (lo, hi)
            points += [(lo, f"{const.key.split('.', 1)[1]}={const.low:g}"),
                       (hi, f"{const.key.split('.', 1)[1]}={const.high:g}")]
        low, high = min(points), max(points)
        out[(num, den)] = Band(low[0], high[0], (low[1], high[1]), by_constant)
    return out
