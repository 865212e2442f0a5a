"""Schedule name -> OpenRLHF 0.11.2 flags. Adding a schedule is adding a row.

    sync        OpenRLHF's synchronous PPO (generate -> score -> train -> sync)
    async       --train.async_enable: rollout in a background loop, a queue to the trainer
    partial     + --train.partial_rollout_enable: vLLM pause/resume(keep) across weight sync
    oversample  async with --rollout.vllm_generate_batch_size = 2 x rollout.batch_size:
                the extra prompts are generated to completion and queued
    oppo        OPPO: chunks streamed into the reward model while the actor decodes
                (intra-step) and B+Δ groups admitted, first B trained, rest carried (inter-step)
    oppo-ref    OPPO with the reference streamed too (--oppo.streaming.reference true): streaming
                reference actors in OpenRLHF's reference group replace its reference forward
    oppo-async  OPPO with async admission (--oppo.staleness.max_policy_lag 2): the next step's
                groups are admitted as the trainer takes a batch and decode while it trains
    oppo-async-inter
                async admission without streaming: OpenRLHF's reward forward, so under
                --train.colocate_all --train.async_enable the reward model shares the DeepSpeed
                models' GPUs, as in OpenRLHF's async mode
    oppo-async-bg
                oppo-async-inter with the weight sync in the background
                (--oppo.staleness.background_sync): the trainer waits for the gather only
    oppo-eq4    OPPO with the paper's eq. 4 Δ rule (reward slope) instead of the system rule
    oppo-off    OPPO with Δ = 0, streaming, length buckets and vectorized advantages off:
                synchronous PPO through OPPO's machinery (what it costs with nothing to overlap)
    oppo-padded OPPO with length buckets and vectorized advantages off (--oppo.train.*): OpenRLHF's
                shuffled micro-batches and advantage loop, so its gain over OpenRLHF's modes is the
                overlap alone
    oppo-decode OPPO with carried groups decoding through training wherever the engines are (on a
                host without CUDA `oppo` holds them from the batch to the weight sync)
    oppo-fixed  OPPO with Δ fixed at delta.init (first B of B+Δ with a constant pool, as
                other frameworks ship it): the adaptive Δ's baseline
    oppo-intra  OPPO with Δ = 0: streaming only
    oppo-inter  OPPO with streaming off: carry-over only (each response scored once, at its end)

OPPO schedules run `python -m openrlhf_oppo.cli.train_ppo_ray` (OpenRLHF's entry point
plus OPPO's touch points) with the YAML's `oppo:` section and the schedule's
`oppo` overrides as `--oppo.*` flags.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from openrlhf_oppo.config import ASYNC_POLICY_LAG

FlagValue = object  # bool | int | float | str | list
FlagFn = Callable[[dict[str, FlagValue]], FlagValue]  # derives a value from the other flags


def _oversampled_batch(flags: dict[str, FlagValue]) -> int:
    return 2 * int(flags["rollout.batch_size"])


OPENRLHF_ENTRY = "openrlhf.cli.train_ppo_ray"
OPPO_ENTRY = "openrlhf_oppo.cli.train_ppo_ray"


@dataclass(frozen=True)
class Schedule:
    name: str
    summary: str
    flags: dict[str, FlagValue | FlagFn] = field(default_factory=dict)
    available: bool = True
    entry_module: str = OPENRLHF_ENTRY  # run as `python -m <entry_module> <flags>`
    oppo: dict[str, object] | None = None  # OPPO schedules: overrides of the YAML's `oppo:` section


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule("sync", "OpenRLHF synchronous PPO"),
        Schedule("async", "OpenRLHF --train.async_enable", {"train.async_enable": True}),
        Schedule(
            "partial",
            "OpenRLHF async + --train.partial_rollout_enable",
            {"train.async_enable": True, "train.partial_rollout_enable": True},
        ),
        Schedule(
            "oversample",
            "OpenRLHF async over-sampling (vllm_generate_batch_size = 2 x rollout.batch_size)",
            {"train.async_enable": True, "rollout.vllm_generate_batch_size": _oversampled_batch},
        ),
        Schedule("oppo", "OPPO intra- and inter-step overlap", entry_module=OPPO_ENTRY, oppo={}),
        Schedule("oppo-decode", "OPPO with carried groups decoding while the trainer trains, also where they share "
                 "its devices (--oppo.staleness.carried_in_training decode; on a CPU host 'oppo' holds them)",
                 entry_module=OPPO_ENTRY, oppo={"staleness": {"carried_in_training": "decode"}}),
        Schedule("oppo-ref", "OPPO with the reference streamed too (streaming reference actors replace "
                 "OpenRLHF's reference forward)", entry_module=OPPO_ENTRY, oppo={"streaming": {"reference": True}}),
        Schedule("oppo-async", f"OPPO with async admission (max_policy_lag {ASYNC_POLICY_LAG}): the next B+Δ decode "
                 "while the trainer trains", entry_module=OPPO_ENTRY,
                 oppo={"staleness": {"max_policy_lag": ASYNC_POLICY_LAG}}),
        Schedule("oppo-async-inter", f"OPPO with async admission (max_policy_lag {ASYNC_POLICY_LAG}) and carry-over, "
                 "no streaming: the reward model can share the DeepSpeed models' GPUs", entry_module=OPPO_ENTRY,
                 oppo={"staleness": {"max_policy_lag": ASYNC_POLICY_LAG}, "streaming": {"enable": False}}),
        Schedule("oppo-async-bg", "oppo-async-inter with the weight sync in the background: the trainer waits for "
                 "the gather only", entry_module=OPPO_ENTRY,
                 oppo={"staleness": {"max_policy_lag": ASYNC_POLICY_LAG, "background_sync": True},
                       "streaming": {"enable": False}}),
        Schedule("oppo-eq4", "OPPO with the paper's eq. 4 Δ rule (reward slope)", entry_module=OPPO_ENTRY,
                 oppo={"delta": {"rule": "eq4"}}),
        Schedule("oppo-off", "OPPO with Δ = 0, streaming, length buckets and vectorized advantages off: its machinery, "
                 "nothing to overlap",
                 entry_module=OPPO_ENTRY, oppo={"delta": {"enable": False}, "streaming": {"enable": False},
                                                "train": {"length_buckets": False, "vectorized_advantages": False}}),
        Schedule("oppo-padded", "OPPO with OpenRLHF's micro-batches and advantage loop: the overlap alone",
                 entry_module=OPPO_ENTRY, oppo={"train": {"length_buckets": False, "vectorized_advantages": False}}),
        Schedule("oppo-fixed", "OPPO with a fixed Δ = delta.init (first B of B+Δ, as a saturated pool)",
                 entry_module=OPPO_ENTRY, oppo={"delta": {"adaptive": False}}),
        Schedule("oppo-intra", "OPPO intra-step streaming only (Δ = 0)", entry_module=OPPO_ENTRY,
                 oppo={"delta": {"enable": False}}),
        Schedule("oppo-inter", "OPPO inter-step carry-over only (no streaming)", entry_module=OPPO_ENTRY,
                 oppo={"streaming": {"enable": False}}),
    )
}


def check(name: str) -> Schedule:
    """The schedule called `name`; ValueError naming the allowed ones otherwise."""
    schedule = SCHEDULES.get(name)
    if schedule is None:
        raise ValueError(f"--schedule: unknown schedule '{name}'; allowed: {', '.join(SCHEDULES)}")
    if not schedule.available:
        available = ", ".join(n for n, s in SCHEDULES.items() if s.available)
        raise ValueError(f"--schedule {name}: not yet available in this version; available now: {available}")
    return schedule


def schedule_flags(name: str, flags: dict[str, FlagValue]) -> dict[str, FlagValue]:
    """The flags schedule `name` adds on top of `flags` (the config's)."""
    schedule = check(name)
    return {key: value(flags) if callable(value) else value for key, value in schedule.flags.items()}


def oppo_config(name: str, oppo_section: dict):
    """The OppoConfig of an OPPO schedule: the YAML's `oppo:` section with the
    schedule's overrides on top, validated (ValueError naming the field); None for
    OpenRLHF's own schedules, where the section does not apply."""
    from openrlhf_oppo import config as oppo_config_module

    schedule = check(name)
    if schedule.oppo is None:
        return None
    return oppo_config_module.from_dict(_merge(oppo_section, schedule.oppo))


def oppo_argv(name: str, oppo_section: dict) -> list[str]:
    """`--oppo.*` flags for `oppo_config(name, oppo_section)` ([] for OpenRLHF's schedules)."""
    from openrlhf_oppo import config as oppo_config_module

    cfg = oppo_config(name, oppo_section)
    return [] if cfg is None else oppo_config_module.to_cli_args(cfg)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out
