"""`bench convergence`'s output: the printed table of the summary and its PNGs."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from openrlhf_oppo.bench.table import fmt, name_width, table_line

PLOTS = ("reward_vs_step.png", "reward_vs_time.png", "exact_match_vs_step.png", "length_ks_vs_step.png",
         "reward_gain_vs_step.png")  # the last one where the task has an SFT baseline (learn)


def _band_cell(band_: dict | None) -> str:
    return "-" if band_ is None else f"{'yes' if band_['all'] else 'no'} {band_['inside']}/{band_['steps']}"


def print_report(summary: dict) -> None:
    ref = summary["reference"]
    cols = [("schedule", name_width(r["schedule"] for r in summary["rows"])),
            ("runs", 5), ("final reward", 22), (f"vs {ref}", 23), ("time-to-reward s", 18), ("steps", 13),
            (f"x {ref}", 17), ("reached", 7), ("exact match", 19), (f"in {ref} band", 11), ("gain over SFT", 22),
            ("gain in band", 12), ("trained len", 17), ("offpol", 6)]
    widths = [w for _, w in cols]
    print(table_line([name for name, _ in cols], widths))
    for r in summary["rows"]:
        cells = [r["schedule"], r["runs_ok"], fmt(r["final_reward"], ".3f"), fmt(r["final_reward_diff"], "+.3f"),
                 fmt(r["time_to_reward_s"], ".0f"), fmt(r["steps_to_reward"], ".0f"),
                 fmt(r["x_ref_time_to_reward"], ".2f"), r["reached"],
                 fmt(r["final_exact_match"], ".2f"),
                 _band_cell(r["within_ref_band"]),
                 fmt(r["final_reward_gain"], "+.3f"), _band_cell(r["gain_within_ref_band"]),
                 fmt(r["mean_trained_length"], ".1f"),
                 fmt(r["mean_offpolicy_token_fraction"], ".2f", False)]
        print(table_line(cells, widths))
    thr, window = summary["threshold"], summary["window_steps"]
    print(f"threshold: {'-' if thr is None else f'{thr:.4f}'} ({summary['threshold_how']}). "
          f"Every figure: median over seeds [min-max over seeds]. final reward / exact match: mean of the last "
          f"{window} steps (trained samples); vs {ref}: its final reward minus {ref}'s, seed by seed; "
          f"time-to-reward: seconds from the first rollout to the first step end whose {window}-step moving "
          f"average reward reaches the threshold (steps: that step's number); x {ref}: {ref}'s time / this "
          f"one's, seed by seed (above 1 = "
          f"sooner); reached: seeds that reach it; in {ref} band: the median over seeds of the reward's "
          f"moving average within {ref}'s min-max over seeds at every step (steps inside / steps; a schedule "
          f"that learns exactly as {ref} does falls outside at some steps by chance: at 40 % of them with 3 "
          f"seeds each); gain over SFT: the reward minus the SFT policy's mean reward on the same prompts "
          f"(data/sft_baseline.jsonl), last {window} steps: learning, not which prompts the steps drew; gain in "
          f"band: as 'in {ref} band', of that gain; trained len: mean response tokens of every trained sample; "
          f"offpol: mean off-policy token fraction (OPPO)")
    print_seeds(summary)


def print_seeds(summary: dict) -> None:
    """Time-to-reward seed by seed: seconds (steps) per schedule, '-' where a seed did not reach it."""
    seeds = sorted({int(k) for r in summary["rows"] for k in r.get("per_seed", {})})
    if not seeds:
        return
    widths = [name_width(r["schedule"] for r in summary["rows"])] + [12] * len(seeds)
    print(table_line(["time-to-reward", *(f"seed {k}" for k in seeds)], widths))
    for r in summary["rows"]:
        cells = [r["schedule"]]
        for k in seeds:
            fig = r.get("per_seed", {}).get(str(k), {})
            t, n = fig.get("time_to_reward_s"), fig.get("steps_to_reward")
            cells.append("-" if t is None else f"{t:.0f} s ({n})")
        print(table_line(cells, widths))


def plot(summary: dict, runs: dict[str, dict[int, dict]], out: Path) -> list[Path]:
    """The PNGs under `out` (PLOTS; the reward gain's where runs have it): median over seeds,
    band min-max over seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    good = {s: [r for r in by_seed.values() if r.get("steps")] for s, by_seed in runs.items()}
    colour = {s: f"C{i}" for i, s in enumerate(runs)}
    thr, ref = summary["threshold"], summary["reference"]
    paths = []

    def banded(ax, key: str, label: str) -> None:
        for schedule in runs:
            fig = summary["per_step"][key][schedule]
            ks = [k for k, (m, _, _) in enumerate(fig) if m is not None]
            ax.plot(ks, [fig[k][0] for k in ks], color=colour[schedule], label=schedule)
            ax.fill_between(ks, [fig[k][1] for k in ks], [fig[k][2] for k in ks], color=colour[schedule], alpha=0.2)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    def save(fig, ax, name: str, title: str) -> None:
        ax.set_title(title, fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        fig.tight_layout()
        out.mkdir(parents=True, exist_ok=True)
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        paths.append(out / name)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    window = summary["window_steps"]
    banded(ax, "reward", f"learned reward (trained samples), {window}-step moving average")
    if thr is not None:
        ax.axhline(thr, color="k", linestyle="--", linewidth=0.8, label="threshold")
    save(fig, ax, PLOTS[0],
         f"reward per step ({window}-step moving average): median over seeds, band min-max over seeds")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for schedule, rs in good.items():
        curves = [[(t, v) for t, v in zip(r["time_s"], r["reward_ma"], strict=False) if t is not None and v is not None]
                  for r in rs]
        curves = [c for c in curves if c]
        if not curves:
            continue
        lo_t, hi_t = max(c[0][0] for c in curves), min(c[-1][0] for c in curves)
        grid = [lo_t + (hi_t - lo_t) * i / 99 for i in range(100)] if hi_t > lo_t else [lo_t]
        values = [[_interp(c, t) for c in curves] for t in grid]
        for c in curves:  # each seed to its own end, past the band
            ax.plot([t for t, _ in c], [v for _, v in c], color=colour[schedule], linewidth=0.5, alpha=0.5)
        ax.plot(grid, [statistics.median(v) for v in values], color=colour[schedule], label=schedule)
        ax.fill_between(grid, [min(v) for v in values], [max(v) for v in values], color=colour[schedule], alpha=0.2)
        row = next(r for r in summary["rows"] if r["schedule"] == schedule)
        if row["time_to_reward_s"][0] is not None:
            ax.axvline(row["time_to_reward_s"][0], color=colour[schedule], linestyle=":", linewidth=0.8)
    if thr is not None:
        ax.axhline(thr, color="k", linestyle="--", linewidth=0.8, label="threshold")
    ax.set_xlabel("seconds since the first rollout (step ends)")
    ax.set_ylabel("learned reward (trained samples)")
    save(fig, ax, PLOTS[1], f"reward over wall time ({window}-step moving average): median over seeds, band min-max "
                            "over seeds (where every seed has data),\nthin: each seed; dotted: median time-to-reward")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    banded(ax, "exact_match", f"exact match (trained samples), {window}-step moving average")
    save(fig, ax, PLOTS[2],
         f"exact match per step ({window}-step moving average): median over seeds, band min-max over seeds")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for schedule, ks in summary["per_step"]["ks_trained_lengths_vs_ref"].items():
        ax.plot(range(len(ks)), [math.nan if v is None else v for v in ks], color=colour[schedule],
                label=f"{schedule} trained vs {ref} trained")
    for schedule, ks in summary["per_step"]["ks_trained_vs_finished"].items():
        ax.plot(range(len(ks)), [math.nan if v is None else v for v in ks], color=colour[schedule], linestyle="--",
                label=f"{schedule} trained vs all finished")
    ax.set_ylim(0, 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("KS distance of response lengths")
    save(fig, ax, PLOTS[3], "length bias per step (lengths pooled over seeds)")

    if summary["per_step"].get("reward_gain"):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        banded(ax, "reward_gain", f"reward minus SFT's on the same prompts, {window}-step moving average")
        ax.axhline(0, color="k", linewidth=0.6)
        save(fig, ax, PLOTS[4], f"reward gain over the SFT policy per step ({window}-step moving average): "
                                "median over seeds, band min-max over seeds")
    return paths


def _interp(curve: list[tuple[float, float]], t: float) -> float:
    """Linear interpolation of a (time, value) curve at t, within its range."""
    for (t0, v0), (t1, v1) in zip(curve, curve[1:], strict=False):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return curve[0][1] if t <= curve[0][0] else curve[-1][1]

