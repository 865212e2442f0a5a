"""The numbers of `bench convergence`: KS distance, moving averages, final figures,
time-to-reward, the default threshold, per-step bands over seeds and a permutation test.
Pure functions of lists and run dicts (`read.read_run`'s)."""

from __future__ import annotations

import itertools
import math
import random
import statistics

from openrlhf_oppo.bench.table import Spread, spread

WINDOW_STEPS = 8  # the moving average of the curves, time-to-reward and the final figures (--window)
THRESHOLD_FRACTION = 0.9  # default threshold: this far from sync's first moving average of the reward to its best


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def ks_distance(a: list[float], b: list[float]) -> float | None:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical
    CDFs (0: same distribution of values, 1: disjoint). None when a side is empty."""
    if not a or not b:
        return None
    a, b = sorted(a), sorted(b)
    i = j = 0
    gap = 0.0
    for x in sorted(set(a) | set(b)):
        while i < len(a) and a[i] <= x:
            i += 1
        while j < len(b) and b[j] <= x:
            j += 1
        gap = max(gap, abs(i / len(a) - j / len(b)))
    return gap


def moving_average(values: list[float | None], window: int = WINDOW_STEPS) -> list[float | None]:
    """Trailing mean over `window` steps; None until a full window (or where it holds a None)."""
    out: list[float | None] = []
    for k in range(len(values)):
        win = values[k - window + 1 : k + 1] if k >= window - 1 else []
        out.append(statistics.fmean(win) if win and all(v is not None for v in win) else None)
    return out


def final(values: list[float | None] | None, window: int = WINDOW_STEPS) -> float | None:
    """Mean of the last `window` steps that have a value."""
    present = [v for v in (values or []) if v is not None]
    return statistics.fmean(present[-window:]) if present else None


def time_to_reward(run: dict, threshold: float, window: int = WINDOW_STEPS) -> tuple[float | None, int | None]:
    """(seconds, step) of the first step end at which the reward's moving average reaches
    `threshold`; (None, None) if it never does."""
    for k, avg in enumerate(moving_average(run["reward"], window)):
        if avg is not None and avg >= threshold:
            return run["time_s"][k], k
    return None, None


def sync_threshold(ref_runs: list[dict], fraction: float = THRESHOLD_FRACTION,
                   window: int = WINDOW_STEPS) -> tuple[float | None, list[float]]:
    """The default threshold: per run of the reference schedule, `fraction` of the way from
    its first moving average to its best; the median over its seeds."""
    per_seed = []
    for run in ref_runs:
        averages = [v for v in moving_average(run["reward"], window) if v is not None]
        best = max(averages, default=None)
        first = averages[0] if averages else None
        if best is not None and first is not None:
            per_seed.append(first + fraction * (best - first))
    return (statistics.median(per_seed) if per_seed else None), per_seed



def _at(series: list | None, k: int):
    return series[k] if series is not None and k < len(series) else None


def band(runs: list[dict], key: str) -> list[Spread]:
    """Per step, (median, min, max) of `key` over the runs that have it at that step."""
    steps = max((r["steps"] for r in runs), default=0)
    return [spread(_at(r.get(key), k) for r in runs) for k in range(steps)]


def within_band(runs: list[dict], ref_runs: list[dict], key: str = "reward") -> dict:
    """Whether the median over seeds of `runs`' `key` lies within the min-max over seeds
    of `ref_runs`' `key`, step by step, over the steps every run of both has a value."""
    steps = min((r["steps"] for r in [*runs, *ref_runs]), default=0)
    outside, checked = [], 0
    for k in range(steps):
        med = spread(_at(r.get(key), k) for r in runs)[0]
        _, lo, hi = spread(_at(r.get(key), k) for r in ref_runs)
        if med is None or lo is None:
            continue
        checked += 1
        if not lo <= med <= hi:
            outside.append(k)
    return {"steps": checked, "inside": checked - len(outside), "outside_steps": outside,
            "all": bool(checked) and not outside}


def pooled_lengths(runs: list[dict], key: str, k: int) -> list[int]:
    return [n for r in runs for n in (_at(r.get(key), k) or [])]


def ks_trained_vs_finished(runs: list[dict], k: int) -> float | None:
    """KS distance at step k between OPPO's trained lengths and all lengths finished by the
    step's end (trained + finished but carried), each pooled over the runs."""
    trained = pooled_lengths(runs, "trace_trained_lengths", k)
    return ks_distance(trained, trained + pooled_lengths(runs, "trace_finished_carried_lengths", k))


def permutation_p(a: list[float], b: list[float], limit: int = 20_000, seed: int = 0) -> float | None:
    """Two-sided p-value of the difference of the means of `a` and `b` under relabelling: the
    share of the ways to split a + b into groups of their sizes whose |difference of means| is
    at least the observed one (every split when there are at most `limit`, else `limit` seeded
    random ones and the observed). Needs no distribution; the smallest possible is 0.1 with
    3 + 3 values, 0.002 with 6 + 6. None with fewer than two values a side."""
    if len(a) < 2 or len(b) < 2:
        return None
    pooled, n = [*a, *b], len(a)
    total = sum(pooled)

    def gap(first: list[float]) -> float:
        s = sum(first)
        return abs(s / n - (total - s) / (len(pooled) - n))

    observed = gap(a) - 1e-12  # a split as extreme as the observed one counts, rounding aside
    if math.comb(len(pooled), n) <= limit:  # the observed split is among them
        splits = itertools.combinations(pooled, n)
        return statistics.fmean(gap(list(s)) >= observed for s in splits)
    rng = random.Random(seed)
    return (1 + sum(gap(rng.sample(pooled, n)) >= observed for _ in range(limit))) / (1 + limit)
