"""The schedules, each a driver of the simulated cluster (`openrlhf_oppo.sim.world`).

OpenRLHF's own modes (`sync`, `async`, `partial`, `oversample`, in `drivers.openrlhf`) are
modelled after OpenRLHF 0.11.2's control flow; `oversample-3b` and `oversample-4b` are its
over-sampling with 3B and 4B prompts a vLLM call (`--rollout.vllm_generate_batch_size`), which
OpenRLHF accepts as it does 2B (`oversample`). `async+bg` (not in `schedule_names`: OpenRLHF's
shipped code cannot run it) is OpenRLHF's async trainer with OPPO's weight-sync transport (the
background sync and `staleness.background_sync_buffer`), for the "same transport" comparison.
OPPO's (`oppo`, `oppo-async`, `oppo-async-bg`, and any registered beside them with
`integrations.launch.schedules.register`, in `drivers.oppo`) are driven by the real `OverlapScheduler`.
An OpenRLHF mode's name + `CUT` (`sync+cut`, ...; not in `schedule_names`) runs it with OPPO's
`train.old_logprobs` cut: make_experience's old-log-prob forward only for samples holding a token
older than the weights that train them, for the "same cut" comparison.
`simulate` runs one schedule; `summarize` measures a run.
"""

from __future__ import annotations

import statistics

from openrlhf_oppo.core.types import LAG_BUCKETS
from openrlhf_oppo.integrations.launch.schedules import Schedule, all_schedules, is_oppo, register
from openrlhf_oppo.sim.costs import CostModel
from openrlhf_oppo.sim.drivers.openrlhf import AsyncDriver, OpenRLHFRunResult, SyncDriver
from openrlhf_oppo.sim.drivers.oppo import OppoDriver, OppoRunResult
from openrlhf_oppo.sim.presets import SimConfig, schedule_oppo
from openrlhf_oppo.sim.world import RunResult, StepRecord, World

OVERSAMPLE = {"oversample": 2, "oversample-3b": 3, "oversample-4b": 4}  # schedule -> prompts a vLLM call / B
BASELINES = ("sync", "async", "partial", *OVERSAMPLE)
SAME_TRANSPORT = "async+bg"  # OpenRLHF's async trainer with OPPO's sync transport: not OpenRLHF's shipped code
CUT = "+cut"  # "sync+cut", ...: an OpenRLHF mode with old log-probs from the rollout where exact ("same cut")


def _oversampled(k: int):
    return lambda flags: k * int(flags["rollout.batch_size"])


# the 3B and 4B over-sampling modes, offered beside the product's schedules (as the lab adds its ablations),
# so that the bench's table and `check` know them: OpenRLHF's own flags, its entry module
register(*(Schedule(name, f"OpenRLHF async over-sampling (vllm_generate_batch_size = {k} x rollout.batch_size)",
                    {"train.async_enable": True, "rollout.vllm_generate_batch_size": _oversampled(k)})
           for name, k in OVERSAMPLE.items() if name != "oversample"))


def oppo_schedules() -> tuple[str, ...]:
    """OPPO's schedules the simulator can run: the product's and any registered beside them."""
    return tuple(name for name in all_schedules() if is_oppo(name))


def schedule_names() -> tuple[str, ...]:
    return BASELINES + oppo_schedules()


def simulate(cfg: SimConfig, costs: CostModel, schedule: str, seed: int) -> RunResult:
    """One run of `schedule` with `seed` (an OpenRLHF mode + `CUT`: with OPPO's old-log-prob cut)."""
    cut = schedule.endswith(CUT) and schedule.removesuffix(CUT) in BASELINES
    mode = schedule.removesuffix(CUT) if cut else schedule
    if mode == "sync":
        return SyncDriver(cfg, costs, seed, cut=cut).run()
    if mode in ("async", "partial", SAME_TRANSPORT, *OVERSAMPLE):
        b = cfg.workload.batch_groups  # over-sampling: --rollout.vllm_generate_batch_size kB
        return AsyncDriver(cfg, costs, seed, partial=mode == "partial",
                           prompts_per_call=OVERSAMPLE.get(mode, 1) * b, name=schedule,
                           background_sync=mode == SAME_TRANSPORT, cut=cut).run()
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


def version_budget(cfg: SimConfig, schedule: str) -> int:
    """How many policy versions older than the weights that train them a schedule's trained tokens may
    be, by its construction (the measured lags are `staleness`'s):

        sync                0: each batch is generated from the weights it trains
        async, partial      1: a call decodes beside the step before, from its weights (partial: some
                            tokens after the sync, lag 0); async+bg alike
        oversample at kB    k: a call's k batches train from the next k versions (`drivers.openrlhf`)
        OPPO, lag 0         max_deferral_steps D when groups are carried (Δ > 0): a group admitted
                            after sync a and carried D times trains at a + D; else 0
        OPPO, lag N >= 1    min(N, D + 1) when groups are carried (a group admitted before sync a
                            decodes from a - 1; the core forces any group past N); else 1
    """
    if schedule.endswith(CUT) and schedule.removesuffix(CUT) in BASELINES:
        schedule = schedule.removesuffix(CUT)  # the cut changes no token's version
    if schedule == "sync":
        return 0
    if schedule in ("async", "partial", SAME_TRANSPORT):
        return 1
    if schedule in OVERSAMPLE:
        return OVERSAMPLE[schedule]
    if not is_oppo(schedule):
        raise ValueError(f"version budget: unknown schedule '{schedule}'")
    oppo = schedule_oppo(cfg, schedule)
    carries = oppo.delta.enable and oppo.delta.max > 0
    lag, deferrals = oppo.staleness.max_policy_lag, oppo.staleness.max_deferral_steps
    if lag == 0:
        return deferrals if carries else 0
    return min(lag, deferrals + 1) if carries else 1


def staleness(result: RunResult, warmup_steps: int) -> dict | None:
    """A run's trained tokens after warm-up by policy lag (shares of buckets "0", "1", "2", "3+") and the
    largest lag measured; for an OPPO run also the Δ in force at each measured step, the stale-KV share
    and the mean seconds a step's batch waited only for groups the staleness bounds forced into it
    (None where no lag was recorded)."""
    if isinstance(result, OpenRLHFRunResult):
        steps = result.lag_tokens[warmup_steps:]
        lag = {b: 0 for b in LAG_BUCKETS}
        for step in steps:
            for age, n in step.items():
                lag[_bucket(age)] += n
        total = sum(lag.values()) or 1
        return {"lag_share": {b: n / total for b, n in lag.items()},
                "max_lag": max((age for step in steps for age, n in step.items() if n), default=0)}
    if not isinstance(result, OppoRunResult):
        return None
    reports = result.reports[warmup_steps:]
    lag = {b: sum(r.lag_tokens.get(b, 0) for r in reports) for b in LAG_BUCKETS}
    total = sum(lag.values()) or 1
    return {"lag_share": {b: n / total for b, n in lag.items()}, "delta": [r.delta for r in reports],
            "max_lag": max((r.max_lag for r in reports), default=0),
            "stale_kv": statistics.fmean(r.stale_kv_token_fraction for r in reports) if reports else 0.0,
            "forced_wait_s": statistics.fmean(r.forced_wait_s for r in reports) if reports else 0.0}


def _bucket(age: int) -> str:
    """LAG_BUCKETS' bucket of a lag ("0", "1", "2", "3+")."""
    top = LAG_BUCKETS[-1]
    return str(age) if str(age) in LAG_BUCKETS else top


def _covered(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Device-seconds busy within [t0, t1] (intervals of different devices add up)."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in intervals)


__all__ = [
    "BASELINES",
    "CUT",
    "OVERSAMPLE",
    "SAME_TRANSPORT",
    "OpenRLHFRunResult",
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
    "version_budget",
]
