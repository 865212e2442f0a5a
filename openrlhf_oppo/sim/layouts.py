"""Which layouts each schedule's framework can run, whether they fit, and each schedule's best.

The rules, from OpenRLHF 0.11.2's `cli/train_ppo_ray.py` and OPPO's integration:

    colocated   vLLM on the DeepSpeed models' devices is `--train.colocate_all`: every model in one
                placement group, the reward model included (`split.score_gpus` 0). OpenRLHF's async
                modes cannot (with `--train.async_enable` it "only colocates DeepSpeed models": vLLM
                gets its own devices).
    sleep       the hybrid engine: sync only ("Async RLHF is not supported with --vllm.enable_sleep";
                OPPO refuses it, its engines decode while the trainer trains).
    split       vLLM on its own devices, the DeepSpeed models on theirs; the reward model on its own
                devices, or among the DeepSpeed models (`split.reward_with_train`; not for an OPPO
                schedule that streams rewards: its streaming reward actors beside the DeepSpeed
                models are not modelled).

The paper's layout (colocated, the reward model on its own devices) is not one OpenRLHF's flags
can place; a preset that names it is simulated as named, and `--best-layout` never picks it.
Memory (`sim.memory`) rules out the rest: a layout that does not fit is reported with what
overflows, never simulated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from openrlhf_oppo import config as oppo_config
from openrlhf_oppo.integrations.launch.schedules import oppo_config as schedule_oppo_config
from openrlhf_oppo.sim import memory
from openrlhf_oppo.sim.drivers import OPPO_SCHEDULES
from openrlhf_oppo.sim.presets import SimConfig, Split

ASYNC_BASELINES = ("async", "partial", "oversample")


def rule(schedule: str, split: Split, streams_reward: bool = False) -> str | None:
    """Why `schedule`'s framework cannot run `split`; None when it can. `streams_reward`: OPPO
    streams chunks into the reward model (its reward group is made of streaming reward actors)."""
    if split.colocate and schedule in ASYNC_BASELINES:
        return ("OpenRLHF's async modes keep vLLM on its own devices (--train.colocate_all with "
                "--train.async_enable colocates only the DeepSpeed models)")
    if split.sleep and schedule != "sync":
        return "sleep mode is for sync only (OpenRLHF refuses it with async; OPPO refuses --vllm.enable_sleep)"
    if streams_reward and split.reward_with_train:
        return ("streaming reward actors beside the DeepSpeed models (--train.colocate_critic_reward) are not "
                "modelled: give them devices of their own or the engines'")
    if not streams_reward and split.colocate and not split.score_gpus and not split.reward_with_train:
        return "--train.colocate_all puts OpenRLHF's reward model among the DeepSpeed models (split.reward_with_train)"
    return None


def streams_reward(cfg: SimConfig, schedule: str) -> bool:
    """Whether `schedule` streams chunks into the reward model with `cfg`'s OPPO settings."""
    if schedule not in OPPO_SCHEDULES:
        return False
    return "reward" in schedule_oppo_config(schedule, oppo_config.to_dict(cfg.oppo)).streaming.scorers()


def check(cfg: SimConfig, schedule: str) -> tuple[SimConfig, list[str]]:
    """`cfg` with vLLM's memory share fitted (`memory.fit_engines`), and why `schedule` cannot run
    it (empty: it can)."""
    reason = rule(schedule, cfg.split, streams_reward(cfg, schedule))
    reasons = [reason] if reason else []
    if cfg.hardware is not None and cfg.actor is not None:
        cfg = memory.fit_engines(cfg)
        reasons += memory.overflow(cfg)
    return cfg, reasons


def describe(split: Split) -> str:
    """A layout in a few words: the devices of one node."""
    if split.colocate:
        rm = f" + {split.score_gpus} reward" if split.score_gpus else ("" if split.reward_with_train else ", scorers")
        how = ", sleep" if split.sleep else ""
        return f"colocated {split.generate_gpus}{rm} (TP {split.tensor_parallel}{how})"
    rm = f"{split.score_gpus} reward" if split.score_gpus else "reward with train"
    return f"{split.generate_gpus} vLLM / {split.train_gpus} train / {rm} (TP {split.tensor_parallel})"


def _tp_choices(cfg: SimConfig, weight_bytes: float) -> list[int]:
    """The two smallest powers of two up to a node whose share of the weights leaves a quarter of a
    device for KV."""
    g = cfg.split.gpus_per_node
    tps = [tp for tp in (1, 2, 4, 8, 16) if tp <= g and weight_bytes / tp <= 0.75 * cfg.hardware.hbm_bytes]
    return tps[:2] or [g]


def candidates(cfg: SimConfig) -> list[Split]:
    """OpenRLHF-placeable splits of `cfg`'s nodes (one pattern a node): colocated with and without
    sleep, and every split of a node's devices into vLLM (a multiple of TP), training and reward
    (none, one or two reward servers)."""
    s, g = cfg.split, cfg.split.gpus_per_node
    reward = cfg.reward or cfg.actor
    stp = _tp_choices(cfg, reward.weight_bytes)[0]
    out = []
    for tp in _tp_choices(cfg, cfg.actor.weight_bytes):
        base = dataclasses.replace(s, tensor_parallel=tp, score_tensor_parallel=stp, reward_with_train=False)
        if g % tp == 0:  # OpenRLHF's reward model among the DeepSpeed models, or OPPO's scorers beside the engines
            coloc = dataclasses.replace(base, colocate=True, generate_gpus=g, train_gpus=g, score_gpus=0,
                                        score_tensor_parallel=tp)
            out += [dataclasses.replace(coloc, sleep=sleep, reward_with_train=True) for sleep in (False, True)]
            out.append(coloc)
        for gen in range(tp, g, tp):
            for score in (0, stp, 2 * stp):
                train = g - gen - score
                if train >= 1:
                    out.append(dataclasses.replace(base, colocate=False, sleep=False, generate_gpus=gen,
                                                   train_gpus=train, score_gpus=score, reward_with_train=score == 0))
    return out


@dataclass
class Searched:
    """Every candidate layout of a cluster, per schedule: runnable (cfg) or not (reasons)."""

    runnable: dict[str, list[SimConfig]]
    refused: list[tuple[Split, list[str]]]  # layouts no schedule can run (memory), with what overflows


def search_space(cfg: SimConfig, schedules: tuple[str, ...]) -> Searched:
    runnable: dict[str, list[SimConfig]] = {s: [] for s in schedules}
    refused = []
    for split in candidates(cfg):
        trial = dataclasses.replace(cfg, split=split)
        fitted, overflow = check(trial, "sync")
        overflow = [r for r in overflow if r != rule("sync", split)]
        if overflow:
            refused.append((split, overflow))
            continue
        for s in schedules:
            if rule(s, split, streams_reward(cfg, s)) is None:
                runnable[s].append(fitted)
    return Searched(runnable, refused)
