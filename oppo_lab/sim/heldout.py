"""Which measured runs the simulator's constants may be fitted on, and which they may not.

The split is written down here before any fit of a GPU constant uses it, and a fit refuses a
held-out run (`require_fittable`, called by `published.fit_constant` before it simulates anything).
The verdict on the simulator's seconds and ratios is reported on the held-out set only
(`python -m oppo_lab published --heldout`); a figure on the fitted set is in-sample and is
printed as such.

How a run was placed:

- **Fitted**: runs whose workload is published in full (response lengths from the run's own log),
  so a fit there fits the cost constants and not an assumed length distribution; and the CPU
  host's runs, which the CPU preset is fitted on already. None of them pairs an asynchronous run
  with a synchronous one.
- **Held out**: every published async/sync pair (the ratio is the kind of claim the simulator
  makes), every run whose lengths are assumed, and the paper's ablation speed-ups (OPPO's own
  claim). Nothing in the simulator's GPU constants was fitted on any of them; after this file,
  nothing may be.

A placement is changed only by editing this file in a commit of its own, before the fit that
would use it; a run moved from held out to fitted leaves the held-out verdict for good.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FITTED: dict[str, str] = {
    "cpu-longtail": (
        "the CPU host's 15 `bench schedules` runs (sync, async, partial, oversample, oppo; 3 repeats) that "
        "`python -m oppo_lab calibrate` fitted the CPU preset on: `validate`'s replay and prediction tables "
        "are in-sample, its leave-one-out table held out by schedule"),
    "published-verl-qwen2-7b-gsm8k": (
        "verl GRPO, Qwen2-7B-Instruct on GSM8K, 8 GPUs: the log gives every stage a step and the mean "
        "response and prompt lengths of the steps used, so a fit on it fits costs, not lengths; synchronous "
        "only; its device is inferred (H200, or a 141 GB H20), which a fit must carry as a second case"),
    "published-verl-deepseek-7b-ppo": (
        "verl PPO with a critic, deepseek-llm-7b-chat on GSM8K, Megatron, 4 GPUs: the log gives every "
        "stage and the lengths, as above; synchronous only; device inferred (H20) from the log's memory"),
}

HELD_OUT: dict[str, str] = {
    "published-verl-dapo-7b-16xh20": (
        "the synchronous half of verl's one-step-off pair (FSDP2, 749 s): held out with its async half"),
    "published-verl-dapo-7b-16xh20-onestep": (
        "the asynchronous half of verl's one-step-off pair (FSDP2, 4 GPUs generate, 12 train, 520 s): the "
        "pair's ratio 0.69 is an async/sync claim of the kind the simulator makes"),
    "published-verl-dapo-7b-16xh20-megatron": (
        "the synchronous half of verl's one-step-off pair on Megatron (699 s): held out with its async half"),
    "published-verl-dapo-7b-16xh20-megatron-onestep": (
        "the asynchronous half of verl's one-step-off pair on Megatron (566 s; ratio 0.81)"),
    "published-verl-dapo-7b-32xh20": (
        "verl DAPO colocated sync on 32 H20 (fully_async's baseline, 790 s): lengths not published (assumed); "
        "its fully_async rows are async figures the simulator cannot model yet, so this run stays unfitted "
        "for when it can"),
    "published-openrlhf-llama2-7b": (
        "OpenRLHF's own benchmark (Llama-2-7B PPO, 8 A800, 885 s): lengths not published (assumed), and the "
        "run of the baseline the simulator's claims are against"),
    "paper-7b-h200": (
        "the OPPO paper's ablation speed-ups at 7B (1.2x / 1.6x / 1.9x over sync): OPPO's own claim, a ratio; "
        "checked by `openrlhf-oppo simulate --preset paper-7b-h200`"),
    "paper-3b-a100": (
        "the OPPO paper's ablation speed-ups at 3B (1.3x / 2.06x / 2.5x): as above, `--preset paper-3b-a100`"),
}

# The schedule a published preset's run used (a preset not named here ran `sync`).
SCHEDULES: dict[str, str] = {
    "published-verl-dapo-7b-16xh20-onestep": "async",
    "published-verl-dapo-7b-16xh20-megatron-onestep": "async",
}

PAIR_TOLERANCE = 0.20  # a simulated async/sync ratio within ±20 % of the published one (the paper check's band)


@dataclass(frozen=True)
class Pair:
    """A published asynchronous run and the synchronous run it was measured against."""

    name: str
    sync_preset: str
    async_preset: str
    published_ratio: float  # async step s / sync step s, as published
    source: str


PAIRS: tuple[Pair, ...] = (
    Pair("verl one-step-off, FSDP2", "published-verl-dapo-7b-16xh20", "published-verl-dapo-7b-16xh20-onestep",
         520 / 749, "verl docs/advance/one_step_off.md, 16 x H20, Qwen2.5-Math-7B DAPO"),
    Pair("verl one-step-off, Megatron", "published-verl-dapo-7b-16xh20-megatron",
         "published-verl-dapo-7b-16xh20-megatron-onestep", 566 / 699,
         "verl docs/advance/one_step_off.md, 16 x H20, Qwen2.5-Math-7B DAPO"),
)

# Published async/sync pairs found and not modelled, with why (printed under the held-out table).
NOT_MODELLED: tuple[str, ...] = (
    "verl fully_async_policy vs colocated sync on 32/64/128 H20 (docs/advance/fully_async.md: 294.77/790.10, "
    "189.26/365.28, 150.63/356.30 s): streaming trainer, partial rollouts and staleness 0.5, a parameter sync "
    "every 4 mini-batches; its 'step' is not the sync run's step, and the simulator has no such mode",
)


def placement(name: str) -> str:
    """'fitted', 'held out' or 'unplaced' (a run in neither set: no verdict, and no fit either)."""
    key = _key(name)
    if key in FITTED:
        return "fitted"
    if key in HELD_OUT:
        return "held out"
    return "unplaced"


def require_fittable(names: list[str] | tuple[str, ...], what: str = "fit") -> None:
    """Raise ValueError unless every run is in the fitted set: a constant fitted on a held-out run
    would turn its verdict in-sample, and an unplaced run must be placed (here, first) before a fit."""
    held = [n for n in names if placement(n) == "held out"]
    if held:
        raise ValueError(f"{what}: {', '.join(held)} is held out (oppo_lab/sim/heldout.py): the constants may "
                         f"not be fitted on it; fittable: {', '.join(FITTED)}")
    unplaced = [n for n in names if placement(n) == "unplaced"]
    if unplaced:
        raise ValueError(f"{what}: {', '.join(unplaced)} is in neither set of oppo_lab/sim/heldout.py: place it "
                         f"(with the reason) before fitting on it; fittable: {', '.join(FITTED)}")


def schedule(preset: str) -> str:
    return SCHEDULES.get(_key(preset), "sync")


def _key(name: str) -> str:
    """A preset's name from a name or a path to its YAML."""
    return Path(name).stem if name.endswith((".yaml", ".yml")) else name
