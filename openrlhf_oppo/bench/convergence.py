"""`openrlhf-oppo bench convergence`: does OPPO learn what sync PPO learns, per step and per second?

Runs every schedule for every seed, seed-major (sync s0, partial s0, oppo s0, oppo-tis s0,
sync s1, ...) so that a shared machine's drift hits every schedule alike, each through
`openrlhf-oppo train` as `bench schedules` runs it, with `--train.seed <seed>` on the
config's task assets (one SFT policy, one reward model for every run) and, by default,
`--train.full_determinism_enable` (within a seed every schedule draws the same prompt
order and seeded requests). `oppo-tis` and `oppo-icepop` are the `oppo` schedule with
`--oppo.staleness.correction tis` / `icepop` (OpenRLHF's token-level importance sampling
against the recorded rollout logprobs: clipped / masked); `oppo` itself runs with the
configured correction (default `none`).

Then it reads every run directory (nothing is re-run; `--report-only` reads only):

- per step: the learned reward of the trained samples (TensorBoard
  `train/rollout/reward_mean`, else `train/reward`, else the mean of `rollouts.jsonl`'s
  rewards), the step's end (its `train/policy_loss` event) in seconds since the run's
  first driver `generate` span (timeline), the trained response lengths and their
  exact-match rate (`rollouts.jsonl`: the prompt's tokens are cut off the sequence and the
  response decoded with the task's tokenizer, then `tasks.learn.exact_match`), OPPO's
  off-policy token fraction (`oppo_metrics.jsonl`) and OpenRLHF's `vllm_kl` (logged only
  with an importance-sampling correction), `is_filter_ratio` and actor-vs-reference `kl`;
- length bias, per step: the KS distance between a schedule's trained response lengths
  and the first schedule's (`sync`) at the same step, both pooled over seeds; and, for
  OPPO runs (`oppo_trace.jsonl`), between the trained lengths and all lengths finished by
  the step's end (trained + finished but carried, pooled over seeds);
- per schedule, over seeds: final reward (mean of the last W steps, `--window`) and its
  difference to sync, seed by seed; time-to-reward (the first step end at which the W-step
  moving average of the reward reaches the threshold) and sync's time / this one's, seed
  by seed; final exact match; and whether the schedule's median moving-average reward
  stays within sync's min-max over seeds at every step;
- learn task: the SFT policy and every run's final actor on held-out prompts (`bench.final_eval`).

Writes `convergence.json` and four PNGs under --output; asserts nothing. Results:
docs/convergence.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from openrlhf_oppo import timeline
from openrlhf_oppo.bench.schedules import STEP_TAG, stopped, tensorboard_scalars
from openrlhf_oppo.integrations.launch.schedules import SCHEDULES
from openrlhf_oppo.tasks import learn

DEFAULT_SCHEDULES = ("sync", "partial", "oppo", "oppo-tis")
REWARD_TAGS = ("train/rollout/reward_mean", "train/reward")  # the first one logged wins
OFFPOLICY_KEY = "oppo/offpolicy_token_fraction"
# OpenRLHF 0.11.2's names: vllm_kl = mean(rollout logprob - actor's old logprob) over response
# tokens and is_filter_ratio exist only with an importance-sampling correction (oppo-tis);
# kl is the actor against the reference model (OpenRLHF's `logprobs_diff` is that too)
DRIFT_TAGS = {"vllm_kl": "train/vllm_kl", "is_filter_ratio": "train/is_filter_ratio", "ref_kl": "train/kl"}
WINDOW_STEPS = 8  # the moving average of the curves, time-to-reward and the final figures (--window)
THRESHOLD_FRACTION = 0.9  # default threshold: this far from sync's first moving average of the reward to its best
PLOTS = ("reward_vs_step.png", "reward_vs_time.png", "exact_match_vs_step.png", "length_ks_vs_step.png",
         "reward_gain_vs_step.png")  # the last one where the task has an SFT baseline (learn)

Spread = tuple  # (median, min, max), all None when there is nothing


@dataclass(frozen=True)
class Variant:
    """What a name on --schedules runs: a schedule of integrations.launch.schedules plus flags."""

    schedule: str
    flags: tuple[str, ...] = ()


# Bench-level variants: a flag of an existing schedule, not a schedule of the product.
VARIANTS = {f"oppo-{c}": Variant("oppo", ("--oppo.staleness.correction", c)) for c in ("none", "tis", "icepop")}


def resolve(name: str) -> Variant:
    """The variant called `name` (a schedule or one of VARIANTS); ValueError naming the allowed ones."""
    if name in VARIANTS:
        return VARIANTS[name]
    if name in SCHEDULES:
        return Variant(name)
    raise ValueError(f"--schedules: unknown {name}; allowed: {', '.join([*SCHEDULES, *VARIANTS])}")


# ---------------------------------------------------------------- one run directory


class Tokenizer(Protocol):  # the part of a transformers tokenizer used here
    eos_token: str

    def __call__(self, text: str, add_special_tokens: bool = ...) -> dict: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class ResponseText:
    """Cuts a `rollouts.jsonl` sequence into prompt and response and decodes the response.
    OpenRLHF's vLLM path builds a sequence as the prompt tokenized without special tokens
    followed by the response's ids (EOS included), so the prompt's ids are its prefix."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.eos_token = tokenizer.eos_token
        self.prompt_ids: dict[str, list[int]] = {}  # prompt text -> ids (prompts repeat across runs)

    def response_ids(self, prompt: str, sequence: list[int]) -> list[int] | None:
        """The response's ids, None when the sequence does not start with the prompt's ids."""
        ids = self.prompt_ids.get(prompt)
        if ids is None:
            ids = self.prompt_ids[prompt] = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        return list(sequence[len(ids):]) if list(sequence[: len(ids)]) == ids else None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def load_tokenizer(path: Path) -> ResponseText:
    from transformers import AutoTokenizer

    return ResponseText(AutoTokenizer.from_pretrained(str(path)))


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            continue
    return rows


def _by_step(events: list[tuple[float, int, float]]) -> dict[int, tuple[float, float]]:
    """step -> (wall time, value); a step logged twice (a resumed run) keeps its last event."""
    return {step: (wall, value) for wall, step, value in sorted(events)}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def trained_samples(record: dict, text: ResponseText | None) -> dict:
    """One `rollouts.jsonl` line -> the step's trained response lengths (tokens; none without
    a tokenizer), exact-match flags (None: no tokenizer and no text, or prompts that are not
    the learn task's) and how many sequences did not start with their prompt's tokens (left out)."""
    lengths: list[int] = []
    exact: list[bool] | None = []
    mismatches = 0
    for sample in record.get("samples", []):
        response = sample.get("response")  # text, where a record holds it
        if text is not None:
            ids = text.response_ids(sample["prompt"], sample["sequence"])
            if ids is None:
                mismatches += 1
                continue
            lengths.append(len(ids))
            if response is None:
                response = text.decode(ids)
        if exact is None:
            continue
        if response is None:
            exact = None
            continue
        try:
            exact.append(learn.exact_match(sample["prompt"], response, *([text.eos_token] if text else [])))
        except ValueError:  # not a learn-task prompt: no ground truth
            exact = None
    return {"lengths": lengths, "exact": exact, "mismatches": mismatches}


def trace_lengths(trace: list[dict]) -> tuple[list[list[int]], list[list[int]], int]:
    """Per OPPO step: (trained lengths, finished-but-carried lengths) and how many carried
    samples could not be placed. A carried sample had finished by a step's end when the
    tokens it held then are all the tokens it was trained with later; one never trained (the
    run ended) is left out."""
    final = {s["sample_id"]: s["tokens"] for row in trace for g in row["trained"] for s in g["samples"]}
    trained, finished_carried, unknown = [], [], 0
    for row in trace:
        trained.append([len(s["tokens"]) for g in row["trained"] for s in g["samples"]])
        done = []
        for sid, held in row.get("carried_tokens", {}).items():
            tokens = final.get(int(sid))
            if tokens is None:
                unknown += 1
            elif tokens == held:
                done.append(len(held))
        finished_carried.append(done)
    return trained, finished_carried, unknown


def _record_reward(record: dict) -> float | None:
    """Mean reward of a rollouts.jsonl line; None unless every sample holds one (OpenRLHF's
    reward forward scores after the line is written: its samples hold None)."""
    rewards = [s.get("reward") for s in record.get("samples", [])]
    return statistics.fmean(rewards) if rewards and None not in rewards else None


def _time_origin(root: Path, first_step_wall: float | None) -> tuple[str, float | None]:
    """(what, time.time() seconds) that a run's time axis starts at: the first driver
    `generate` span (training starts; process start-up and model loading left out)."""
    rows = timeline.read(root / "timeline") if (root / "timeline").is_dir() else []
    generates = timeline.stage_spans(rows, "driver", "generate")
    if generates:
        return "first driver generate", min(r["t0"] for r in generates)
    if rows:
        return "first timeline record", rows[0]["t0"]
    return "first step's end", first_step_wall


Baseline = dict  # prompt -> (the SFT policy's mean reward, its exact-match rate): tasks.learn_eval.sft_baseline


def load_baseline(path: Path) -> Baseline | None:
    """A learn task's `data/sft_baseline.jsonl` as a Baseline; None if it is absent."""
    return {r["input"]: (r["reward"], r["exact_match"]) for r in _jsonl(path)} or None


def step_baseline(record: dict, baseline: Baseline) -> tuple[float, float] | None:
    """The SFT policy's (reward, exact match) on a rollouts.jsonl line's prompts: the mean over
    its samples, as the step's reward is; None if a prompt has no baseline."""
    values = [baseline.get(s.get("prompt")) for s in record.get("samples", [])]
    if not values or None in values:
        return None
    return statistics.fmean(v[0] for v in values), statistics.fmean(v[1] for v in values)


def read_run(root: Path, text: ResponseText | None, baseline: Baseline | None = None) -> dict:
    """Per-step series of one run directory written by `openrlhf-oppo train`. Steps are the
    run's `train/policy_loss` events (one per PPO step, every schedule); the k-th line of
    rollouts.jsonl, oppo_metrics.jsonl and oppo_trace.jsonl is step k (an async schedule may
    have generated a batch more than it trained: left out). With a `baseline`, also the
    reward and exact match minus the SFT policy's on the step's prompts (`reward_gain`,
    `exact_match_gain`)."""
    scalars = tensorboard_scalars(root / "tensorboard") if (root / "tensorboard").is_dir() else {}
    step_events = _by_step(scalars.get(STEP_TAG, []))
    steps = sorted(step_events)
    n = len(steps)
    origin, t0 = _time_origin(root, step_events[steps[0]][0] if steps else None)

    def pad(values: list) -> list:
        return list(values[:n]) + [None] * (n - len(values))

    rollouts = _jsonl(root / "rollouts.jsonl")[:n]
    samples = [trained_samples(r, text) for r in rollouts]
    reward_tag = next((t for t in REWARD_TAGS if t in scalars), None)
    if reward_tag:
        by = _by_step(scalars[reward_tag])
        reward = [by[s][1] if s in by else None for s in steps]
    else:
        reward = pad([_record_reward(r) for r in rollouts])
        reward_tag = "rollouts.jsonl" if any(v is not None for v in reward) else None
    run = {
        "steps": n,
        "time_origin": origin,
        "time_s": [step_events[s][0] - t0 for s in steps] if t0 is not None else [None] * n,
        "reward": reward,
        "reward_source": reward_tag,
        "exact_match": pad([_mean(s["exact"]) if s["exact"] else None for s in samples]),
        "lengths": pad([s["lengths"] if text is not None else None for s in samples]),
        "split_mismatches": sum(s["mismatches"] for s in samples),
    }
    if baseline:
        base = pad([step_baseline(r, baseline) for r in rollouts])
        for key, series, i in (("reward_gain", run["reward"], 0), ("exact_match_gain", run["exact_match"], 1)):
            run[key] = [None if b is None or v is None else v - b[i] for v, b in zip(series, base)]
    for key, tag in DRIFT_TAGS.items():
        by = _by_step(scalars.get(tag, []))
        run[key] = [by[s][1] if s in by else None for s in steps] if by else None
    metrics = _jsonl(root / "oppo_metrics.jsonl")
    run[OFFPOLICY_KEY] = pad([m.get(OFFPOLICY_KEY) for m in metrics]) if metrics else None
    trace = _jsonl(root / "oppo_trace.jsonl")
    if trace:
        trained, finished_carried, unknown = trace_lengths(trace)
        run["trace_trained_lengths"] = pad(trained)
        run["trace_finished_carried_lengths"] = pad(finished_carried)
        run["trace_carried_unplaced"] = unknown
        run["ks_trained_vs_finished"] = [ks_trained_vs_finished([run], k) for k in range(n)]
    return run


# ------------------------------------------------------------------ numbers


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


def _spread(values) -> Spread:
    values = [v for v in values if v is not None]
    return (statistics.median(values), min(values), max(values)) if values else (None, None, None)


def _at(series: list | None, k: int):
    return series[k] if series is not None and k < len(series) else None


def band(runs: list[dict], key: str) -> list[Spread]:
    """Per step, (median, min, max) of `key` over the runs that have it at that step."""
    steps = max((r["steps"] for r in runs), default=0)
    return [_spread(_at(r.get(key), k) for r in runs) for k in range(steps)]


def within_band(runs: list[dict], ref_runs: list[dict], key: str = "reward") -> dict:
    """Whether the median over seeds of `runs`' `key` lies within the min-max over seeds
    of `ref_runs`' `key`, step by step, over the steps every run of both has a value."""
    steps = min((r["steps"] for r in [*runs, *ref_runs]), default=0)
    outside, checked = [], 0
    for k in range(steps):
        med = _spread(_at(r.get(key), k) for r in runs)[0]
        _, lo, hi = _spread(_at(r.get(key), k) for r in ref_runs)
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
            **{key: _spread(f[key] for f in figs) for key in (
                "final_reward", "final_reward_diff", "time_to_reward_s", "steps_to_reward", "x_ref_time_to_reward",
                "final_exact_match", "final_reward_gain", "mean_offpolicy_token_fraction", "mean_vllm_kl")},
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
        "mean_offpolicy_token_fraction": _mean(run.get(OFFPOLICY_KEY) or []),
        "mean_vllm_kl": _mean(run.get("vllm_kl") or []),
    }


# ------------------------------------------------------------------ output


def _fmt(fig: Spread, spec: str, spread: bool = True) -> str:
    med, lo, hi = fig
    if med is None:
        return "-"
    return f"{med:{spec}} [{lo:{spec}}-{hi:{spec}}]" if spread and lo != hi else f"{med:{spec}}"


def table_line(cells: list[str], widths: list[int]) -> str:
    """One line of a printed table: the first cell left-aligned, the others right-aligned."""
    return " ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cells, widths)))


def _band_cell(band_: dict | None) -> str:
    return "-" if band_ is None else f"{'yes' if band_['all'] else 'no'} {band_['inside']}/{band_['steps']}"


def print_report(summary: dict) -> None:
    ref = summary["reference"]
    cols = [("schedule", 11), ("runs", 5), ("final reward", 22), (f"vs {ref}", 23), ("time-to-reward s", 18),
            (f"x {ref}", 17), ("reached", 7), ("exact match", 19), (f"in {ref} band", 11), ("gain over SFT", 22),
            ("gain in band", 12), ("offpol", 6)]
    widths = [w for _, w in cols]
    print(table_line([name for name, _ in cols], widths))
    for r in summary["rows"]:
        cells = [r["schedule"], r["runs_ok"], _fmt(r["final_reward"], ".3f"), _fmt(r["final_reward_diff"], "+.3f"),
                 _fmt(r["time_to_reward_s"], ".0f"), _fmt(r["x_ref_time_to_reward"], ".2f"), r["reached"],
                 _fmt(r["final_exact_match"], ".2f"),
                 _band_cell(r["within_ref_band"]),
                 _fmt(r["final_reward_gain"], "+.3f"), _band_cell(r["gain_within_ref_band"]),
                 _fmt(r["mean_offpolicy_token_fraction"], ".2f", False)]
        print(table_line(cells, widths))
    thr, window = summary["threshold"], summary["window_steps"]
    print(f"threshold: {'-' if thr is None else f'{thr:.4f}'} ({summary['threshold_how']}). "
          f"Every figure: median over seeds [min-max over seeds]. final reward / exact match: mean of the last "
          f"{window} steps (trained samples); vs {ref}: its final reward minus {ref}'s, seed by seed; "
          f"time-to-reward: seconds from the first rollout to the first step end whose {window}-step moving "
          f"average reward reaches the threshold; x {ref}: {ref}'s time / this one's, seed by seed (above 1 = "
          f"sooner); reached: seeds that reach it; in {ref} band: the median over seeds of the reward's "
          f"moving average within {ref}'s min-max over seeds at every step (steps inside / steps; a schedule that learns exactly as {ref} "
          f"does falls outside at some steps by chance: at 40 % of them with 3 seeds each); gain over SFT: the "
          f"reward minus the SFT policy's mean reward on the same prompts (data/sft_baseline.jsonl), last {window} "
          f"steps: learning, not which prompts the steps drew; gain in band: as 'in {ref} band', of that gain; "
          f"offpol: mean "
          f"off-policy token fraction (OPPO)")


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
    save(fig, ax, PLOTS[0], f"reward per step ({window}-step moving average): median over seeds, band min-max over seeds")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for schedule, rs in good.items():
        curves = [[(t, v) for t, v in zip(r["time_s"], r["reward_ma"]) if t is not None and v is not None] for r in rs]
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
    save(fig, ax, PLOTS[1], f"reward over wall time ({window}-step moving average): median over seeds, band min-max over seeds (where every seed "
                            "has data),\nthin: each seed; dotted: median time-to-reward")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    banded(ax, "exact_match", f"exact match (trained samples), {window}-step moving average")
    save(fig, ax, PLOTS[2], f"exact match per step ({window}-step moving average): median over seeds, band min-max over seeds")

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
    for (t0, v0), (t1, v1) in zip(curve, curve[1:]):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return curve[0][1] if t <= curve[0][0] else curve[-1][1]


# ------------------------------------------------------------------ CLI


def task_root(config_path: str) -> tuple[str, Path]:
    """(variant, assets directory) of the config's task."""
    from openrlhf_oppo import tasks
    from openrlhf_oppo.integrations.launch import yaml_config

    task = yaml_config.load(config_path).task
    variant = task.get("variant", "tiny")
    return variant, Path(task.get("assets") or tasks.default_root(variant)).expanduser()


def default_tokenizer(config_path: str) -> Path:
    """The config's task tokenizer: <task.assets or the variant's default>/tokenizer."""
    return task_root(config_path)[1] / "tokenizer"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="openrlhf-oppo bench convergence", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/learn-cpu.yaml", help="YAML run config")
    p.add_argument("--seeds", type=int, default=3,
                   help="seeds per schedule (--train.seed first-seed, first-seed+1, ...)")
    p.add_argument("--first-seed", type=int, default=0, help="the first --train.seed")
    p.add_argument("--schedules", nargs="+", default=list(DEFAULT_SCHEDULES),
                   help=f"schedules (and {', '.join(VARIANTS)}); the first is the reference")
    p.add_argument("--output", default="runs/bench-convergence", help="one run directory per schedule and seed")
    p.add_argument("--threshold", type=float, default=None,
                   help=f"reward of time-to-reward (default: {THRESHOLD_FRACTION * 100:.0f}%% of the way from the first "
                        "schedule's first moving average of the reward to its best, median over seeds)")
    p.add_argument("--window", type=int, default=WINDOW_STEPS,
                   help="steps of the moving average of the curves, of time-to-reward and of the final figures")
    p.add_argument("--tokenizer", default=None, help="decodes responses (default: the config's task assets/tokenizer)")
    p.add_argument("--same-samples", action=argparse.BooleanOptionalAction, default=True,
                   help="--train.full_determinism_enable for every run (seeded requests and prompt order)")
    p.add_argument("--timeout-s", type=float, default=None, help="per run (default: none)")
    p.add_argument("--final-eval", action=argparse.BooleanOptionalAction, default=True,
                   help="learn task: the SFT policy and every run's final actor on held-out prompts")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: summarize the runs already under --output (<schedule>-s<seed>)")
    p.add_argument("--keep-done", action="store_true",
                   help="reuse the runs under --output that finished (result.json with exit 0) instead of running "
                        "them again; run the rest (a bench cut short, or a schedule added to an earlier one)")
    p.add_argument("extra", nargs="*", help="after `--`: extra OpenRLHF flags for every run")
    args = p.parse_args(argv)
    try:
        variants = {name: resolve(name) for name in args.schedules}
    except ValueError as e:
        p.error(str(e))
    if args.seeds < 1:
        p.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.window < 1:
        p.error(f"--window must be >= 1, got {args.window}")
    if any(a == "--train.seed" or a.startswith("--train.seed=") for a in args.extra):
        p.error("--train.seed after `--`: the bench sets it per run (--seeds, --first-seed)")

    out = Path(args.output)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    extra = [*args.extra, *(["--train.full_determinism_enable"] if args.same_samples else [])]
    results: dict[str, dict[int, dict]] = {s: {} for s in args.schedules}
    order = [(seed, name) for seed in seeds for name in args.schedules]
    for i, (seed, name) in enumerate(order, 1):
        root = out / f"{name}-s{seed}"
        done = json.loads((root / "result.json").read_text()) if (root / "result.json").exists() else {}
        if args.keep_done and done.get("returncode") == 0:
            print(f"[bench convergence] run {i}/{len(order)}: {name} seed {seed}: kept (finished in {root})", flush=True)
            results[name][seed] = done
            continue
        if args.report_only:
            result = done
            results[name][seed] = {"returncode": result.get("returncode", 0 if (root / "tensorboard").is_dir() else 1),
                                   "wall_s": result.get("wall_s")}
            continue
        from openrlhf_oppo.integrations.launch import train_run as train

        print(f"[bench convergence] run {i}/{len(order)}: {name} seed {seed} -> {root}", flush=True)
        variant = variants[name]
        run = train.run(["--schedule", variant.schedule, "--config", args.config, "--output", str(root),
                         *(["--timeout-s", str(args.timeout_s)] if args.timeout_s else []),
                         "--", *extra, *variant.flags, "--train.seed", str(seed)])
        root.mkdir(parents=True, exist_ok=True)
        (root / "result.json").write_text(json.dumps({"returncode": run.returncode, "wall_s": run.wall_s}))
        results[name][seed] = {"returncode": run.returncode, "wall_s": run.wall_s}
        if (code := stopped("convergence", run, i, len(order), "; the same command with --keep-done runs the rest")) is not None:
            return code

    tokenizer = Path(args.tokenizer).expanduser() if args.tokenizer else default_tokenizer(args.config)
    text = load_tokenizer(tokenizer) if tokenizer.is_dir() else None
    if text is None:
        print(f"[bench convergence] no tokenizer at {tokenizer}: no response lengths, exact match or KS", flush=True)
    variant, assets_root = task_root(args.config)
    baseline = None
    if variant == "learn":
        baseline_path = learn.LearnAssets(assets_root).sft_baseline
        baseline = load_baseline(baseline_path)
        if baseline is None:
            print(f"[bench convergence] no {baseline_path} (assets built before it existed: openrlhf-oppo prepare "
                  "--variant learn --force): no reward gain over the SFT policy", flush=True)
    for name, by_seed in results.items():
        for seed, result in by_seed.items():
            if result["returncode"] == 0:
                result.update(read_run(out / f"{name}-s{seed}", text, baseline))
            else:
                result["steps"] = 0
    summary = summarize(results, args.threshold, args.window)
    print_report(summary)
    from openrlhf_oppo.bench import final_eval

    final = final_eval.evaluate(args.config, out, results) if args.final_eval else None
    if final:
        final_eval.print_table(final)
    out.mkdir(parents=True, exist_ok=True)
    (out / "convergence.json").write_text(json.dumps(
        {"config": args.config, "seeds": seeds, "schedules": args.schedules,
         "variants": {n: {"schedule": v.schedule, "flags": list(v.flags)} for n, v in variants.items()},
         "tokenizer": str(tokenizer) if text else None, "summary": summary, "final_eval": final,
         "runs": {n: {str(seed): r for seed, r in by_seed.items()} for n, by_seed in results.items()}}, indent=1))
    for path in plot(summary, results, out):
        print(f"wrote {path}")
    print(f"summary: {out / 'convergence.json'}")
    return 0 if all(r["returncode"] == 0 for by_seed in results.values() for r in by_seed.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
