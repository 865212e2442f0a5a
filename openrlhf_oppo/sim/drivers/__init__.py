"""The schedules, each a driver of the simulated cluster (`openrlhf_oppo.sim.world`).

OpenRLHF's own modes (`sync`, `async`, `partial`, `oversample`, in `drivers.openrlhf`) are
modelled after OpenRLHF 0.11.2's control flow. OPPO's (`oppo`, `oppo-async`, `oppo-async-bg`, and any
registered beside them with `integrations.launch.schedules.register`, in `drivers.oppo`) are driven by
the real `OverlapScheduler`. `simulate` runs one schedule; `summarize` measures a run.
"""

from __future__ import annotations

import statistics

from openrlhf_oppo.core.types import LAG_BUCKETS
from openrlhf_oppo.integrations.launch.schedules import all_schedules, is_oppo
from openrlhf_oppo.sim.costs import CostModel
from openrlhf_oppo.sim.drivers.openrlhf import AsyncDriver, SyncDriver
from openrlhf_oppo.sim.drivers.oppo import OppoDriver, OppoRunResult
from openrlhf_oppo.sim.presets import SimConfig
from openrlhf_oppo.sim.world import RunResult, StepRecord, World

BASELINES = ("sync", "async", "partial", "oversample")


def oppo_schedules() -> tuple[str, ...]:
    """OPPO's schedules the simulator can run: the product's and any registered beside them."""
    return tuple(name for name in all_schedules() if is_oppo(name))


def schedule_names() -> tuple[str, ...]:
    return BASELINES + oppo_schedules()


def simulate(cfg: SimConfig, costs: CostModel, schedule: str, seed: int) -> RunResult:
    """One run of `schedule` with `seed`."""
    if schedule == "sync":
        return SyncDriver(cfg, costs, seed).run()
    if schedule in ("async", "partial", "oversample"):
        b = cfg.workload.batch_groups  # oversample: --rollout.vllm_generate_batch_size 2B
        return AsyncDriver(cfg, costs, seed, partial=schedule == "partial",
                           prompts_per_call=2 * b if schedule == "oversample" else b, name=schedule).run()
    if is_oppo(schedule):
        return OppoDriver(cfg, costs, seed, schedule).run()
    raise ValueError(f"--schedules: unknown schedule '{schedule}'; allowed: {', '.join(schedule_names())}")


def step_latencies_s(result: RunResult, warmup_steps: int) -> list[float]:
    """Gaps between consecutive steps' events after warm-up, as `bench schedules` measures them:
    OpenRLHF logs a step (its TensorBoard event) after the step's weight sync."""
    ends = [r.sync_end_s for r in result.steps][max(0, warmup_steps - 1):]
    return [b - a for a, b in zip(ends, ends[1:], strict=False)]  # consecutive pairs


def summarize(result: RunResult, warmup_steps: int) -> dict:
    """Per-run figures: step latency (median, mean), tokens/s and utilisation over the measured window."""
    lat = step_latencies_s(result, warmup_steps)
    # (time, tokens decoded, engine iterations) at the window's start and end
    t0, n0, i0 = result.decoded_tokens_at[max(0, warmup_steps - 1)]
    t1, n1, i1 = result.decoded_tokens_at[-1]
    half = len(lat) // 2
    util = {role: _covered(ivs, t0, t1) / (max(t1 - t0, 1e-12) * result.devices[role])
            for role, ivs in result.busy.items()}
    deferred = [r.deferred_fraction for r in result.steps[warmup_steps:]]
    window_drift = 0.0  # the second half of the measured steps' mean step against the first half's, - 1
    if half:
        window_drift = statistics.fmean(lat[half:]) / statistics.fmean(lat[:half]) - 1.0
    return {"median_step_s": statistics.median(lat), "mean_step_s": statistics.fmean(lat),
            "tokens_per_s": (n1 - n0) / max(t1 - t0, 1e-12), "util": util,
            "seqs_per_iteration": (n1 - n0) / (i1 - i0) if i1 > i0 else 0.0,
            "window_drift": window_drift,
            "deferred": statistics.fmean(deferred) if deferred else 0.0}


def staleness(result: RunResult, warmup_steps: int) -> dict | None:
    """An OPPO run's trained tokens by policy lag (shares of buckets "0", "1", "2", "3+"), the Δ in
    force at each measured step and the mean seconds a step's batch waited only for groups the
    staleness bounds forced into it; None for OpenRLHF's schedules (the core does not see them)."""
    if not isinstance(result, OppoRunResult):
        return None
    reports = result.reports[warmup_steps:]
    lag = {b: sum(r.lag_tokens.get(b, 0) for r in reports) for b in LAG_BUCKETS}
    total = sum(lag.values()) or 1
    return {"lag_share": {b: n / total for b, n in lag.items()}, "delta": [r.delta for r in reports],
            "stale_kv": statistics.fmean(r.stale_kv_token_fraction for r in reports) if reports else 0.0,
            "forced_wait_s": statistics.fmean(r.forced_wait_s for r in reports) if reports else 0.0}


def _covered(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Device-seconds busy within [t0, t1] (intervals of different devices add up)."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in intervals)


__all__ = [
    "BASELINES",
    "oppo_schedules",
    "schedule_names",
    "AsyncDriver",
    "OppoDriver",
    "OppoRunResult",
    "RunResult",
    "StepRecord",
    "SyncDriver",
    "World",
    "simulate",
    "staleness",
    "step_latencies_s",
    "summarize",
]
