"""`bench convergence`'s summary of every run: per schedule over seeds (final reward and its
difference to the reference, time-to-reward, exact match, the band check, the gain over the
SFT policy, the mean trained response length) and per-step series across seeds (bands,
length KS distances)."""

from __future__ import annotations

from openrlhf_oppo.bench.table import spread
from oppo_lab.convergence.numbers import (
    THRESHOLD_FRACTION,
    WINDOW_STEPS,
    band,
    final,
    ks_distance,
    ks_trained_vs_finished,
    mean,
    moving_average,
    pooled_lengths,
    sync_threshold,
    time_to_reward,
    within_band,
)
from oppo_lab.convergence.read import OFFPOLICY_KEY


def summarize(runs: dict[str, dict[int, dict]], threshold: float | None = None, window: int = WINDOW_STEPS) -> dict:
    """Rows per schedule and per-step series across seeds. `runs`: schedule -> seed -> run
    (a failed run holds no series: `steps` 0); the first schedule is the reference, and
    figures against it are paired seed by seed. Adds to each run its `window`-step moving
    averages (`reward_ma`, `exact_match_ma`, and `reward_gain_ma` where runs hold the gain over
    the SFT baseline): one step's 32-odd samples of a few prompts
    are too few to compare schedules by."""
    ref = next(iter(runs))
    good = {s: {seed: r for seed, r in by_seed.items() if r.get("steps")} for s, by_seed in runs.items()}
    for by_seed in good.values():
        for r in by_seed.values():
            r["reward_ma"] = moving_average(r["reward"], window)
            r["exact_match_ma"] = moving_average(r.get("exact_match") or [], window)
            if r.get("reward_gain"):
                r["reward_gain_ma"] = moving_average(r["reward_gain"], window)
    default_thr, per_seed_thr = sync_threshold(list(good[ref].values()), window=window)
    thr = threshold if threshold is not None else default_thr
    thr_how = (f"given (--threshold {threshold})" if threshold is not None else
               f"{THRESHOLD_FRACTION:.0%} of the way from {ref}'s first {window}-step moving average of the reward "
               f"to its best, median over seeds")
    per_seed = {s: {seed: _seed_figures(r, thr, window) for seed, r in by_seed.items()} for s, by_seed in good.items()}
    has_gain = any(r.get("reward_gain") for by_seed in good.values() for r in by_seed.values())
    for by_seed in per_seed.values():  # against the reference's run of the same seed
        for seed, fig in by_seed.items():
            base = per_seed[ref].get(seed)
            fig["final_reward_diff"] = (fig["final_reward"] - base["final_reward"]
                                        if base and None not in (fig["final_reward"], base["final_reward"]) else None)
            # the reference's time / this one's: above 1 = reaches the threshold sooner
            fig["x_ref_time_to_reward"] = (base["time_to_reward_s"] / fig["time_to_reward_s"]
                                           if base and base["time_to_reward_s"] and fig["time_to_reward_s"] else None)
    rows = []
    for schedule, by_seed in good.items():
        figs = per_seed[schedule].values()
        rows.append({
            "schedule": schedule,
            "runs_ok": f"{len(by_seed)}/{len(runs[schedule])}",
            **{key: spread(f[key] for f in figs) for key in (
                "final_reward", "final_reward_diff", "time_to_reward_s", "steps_to_reward", "x_ref_time_to_reward",
                "final_exact_match", "final_reward_gain", "mean_trained_length", "mean_offpolicy_token_fraction",
                "mean_vllm_kl")},
            "reached": f"{sum(f['time_to_reward_s'] is not None for f in figs)}/{len(by_seed)}",
            "within_ref_band": within_band(list(by_seed.values()), list(good[ref].values()), "reward_ma"),
            "gain_within_ref_band": (within_band(list(by_seed.values()), list(good[ref].values()), "reward_gain_ma")
                                     if has_gain else None),
            "per_seed": {str(seed): f for seed, f in per_seed[schedule].items()},
        })
    ref_runs = list(good[ref].values())
    per_step = {"reward": {}, "exact_match": {}, "ks_trained_lengths_vs_ref": {}, "ks_trained_vs_finished": {}}
    for schedule, by_seed in good.items():
        rs = list(by_seed.values())
        steps = max((r["steps"] for r in rs), default=0)
        per_step["reward"][schedule] = band(rs, "reward_ma")
        per_step["exact_match"][schedule] = band(rs, "exact_match_ma")
        if has_gain:
            per_step.setdefault("reward_gain", {})[schedule] = band(rs, "reward_gain_ma")
        if schedule != ref:
            per_step["ks_trained_lengths_vs_ref"][schedule] = [
                ks_distance(pooled_lengths(rs, "lengths", k), pooled_lengths(ref_runs, "lengths", k))
                for k in range(steps)]
        if any("trace_trained_lengths" in r for r in rs):
            per_step["ks_trained_vs_finished"][schedule] = [ks_trained_vs_finished(rs, k) for k in range(steps)]
    return {"reference": ref, "threshold": thr, "threshold_how": thr_how, "threshold_per_seed": per_seed_thr,
            "window_steps": window, "band": "min-max over seeds, line: median over seeds", "rows": rows,
            "per_step": per_step}


def _seed_figures(run: dict, threshold: float | None, window: int) -> dict:
    seconds, step = time_to_reward(run, threshold, window) if threshold is not None else (None, None)
    return {
        "final_reward": final(run["reward"], window),
        "time_to_reward_s": seconds,
        "steps_to_reward": step,
        "final_exact_match": final(run["exact_match"], window),
        "final_reward_gain": final(run.get("reward_gain"), window),
        "mean_trained_length": mean(n for step in run.get("lengths") or [] for n in step or []),
        "mean_offpolicy_token_fraction": mean(run.get(OFFPOLICY_KEY) or []),
        "mean_vllm_kl": mean(run.get("vllm_kl") or []),
    }
