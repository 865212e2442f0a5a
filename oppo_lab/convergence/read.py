"""One run directory of `bench convergence` as per-step series (`read_run`): reward, time,
trained lengths and exact match (responses decoded with the task's tokenizer and checked by
`tasks.learn.exact_match`), drift metrics, OPPO's off-policy fraction and trace, and the
reward over the SFT policy's baseline."""

from __future__ import annotations

import statistics
from pathlib import Path

from openrlhf_oppo import timeline
from openrlhf_oppo.bench.schedules import STEP_TAG, tensorboard_scalars
from openrlhf_oppo.tasks.learn.rollouts import Baseline, ResponseText, jsonl, trained_samples
from oppo_lab.convergence.numbers import ks_trained_vs_finished, mean

REWARD_TAGS = ("train/rollout/reward_mean", "train/reward")  # the first one logged wins
OFFPOLICY_KEY = "oppo/offpolicy_token_fraction"
# OpenRLHF 0.11.2's names: vllm_kl = mean(rollout logprob - actor's old logprob) over response
# tokens and is_filter_ratio exist only with an importance-sampling correction (oppo-tis);
# kl is the actor against the reference model (OpenRLHF's `logprobs_diff` is that too)
DRIFT_TAGS = {"vllm_kl": "train/vllm_kl", "is_filter_ratio": "train/is_filter_ratio", "ref_kl": "train/kl"}


def _by_step(events: list[tuple[float, int, float]]) -> dict[int, tuple[float, float]]:
    """step -> (wall time, value); a step logged twice (a resumed run) keeps its last event."""
    return {step: (wall, value) for wall, step, value in sorted(events)}



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

    rollouts = jsonl(root / "rollouts.jsonl")[:n]
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
        "exact_match": pad([mean(s["exact"]) if s["exact"] else None for s in samples]),
        "lengths": pad([s["lengths"] if text is not None else None for s in samples]),
        "split_mismatches": sum(s["mismatches"] for s in samples),
    }
    if baseline:
        base = pad([step_baseline(r, baseline) for r in rollouts])
        for key, series, i in (("reward_gain", run["reward"], 0), ("exact_match_gain", run["exact_match"], 1)):
            run[key] = [None if b is None or v is None else v - b[i] for v, b in zip(series, base, strict=False)]
    for key, tag in DRIFT_TAGS.items():
        by = _by_step(scalars.get(tag, []))
        run[key] = [by[s][1] if s in by else None for s in steps] if by else None
    metrics = jsonl(root / "oppo_metrics.jsonl")
    run[OFFPOLICY_KEY] = pad([m.get(OFFPOLICY_KEY) for m in metrics]) if metrics else None
    trace = jsonl(root / "oppo_trace.jsonl")
    if trace:
        trained, finished_carried, unknown = trace_lengths(trace)
        run["trace_trained_lengths"] = pad(trained)
        run["trace_finished_carried_lengths"] = pad(finished_carried)
        run["trace_carried_unplaced"] = unknown
        run["ks_trained_vs_finished"] = [ks_trained_vs_finished([run], k) for k in range(n)]
    return run
