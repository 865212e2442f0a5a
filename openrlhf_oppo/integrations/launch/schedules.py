"""Schedule name -> OpenRLHF 0.11.2 flags: what `--schedule` offers. Adding a schedule is adding a row.

OpenRLHF's own modes, the baselines:

    sync        synchronous PPO (generate -> score -> train -> sync)
    async       --train.async_enable: rollout in a background loop, a queue to the trainer
    partial     + --train.partial_rollout_enable: vLLM pause/resume(keep) across weight sync
    oversample  async with --rollout.vllm_generate_batch_size = 2 x rollout.batch_size:
                the extra prompts are generated to completion and queued

OPPO's, one to choose by layout (docs/quickstart.md):

    oppo        chunks streamed into the reward model while the actor decodes (intra-step), B+Δ
                groups admitted, the first B trained, the rest carried (inter-step). The default
                where vLLM shares the GPUs with training (colocated, or the hybrid engine)
    oppo-async  `oppo` with async admission (--oppo.staleness.max_policy_lag 2): the next step's
                groups decode while the trainer trains; for vLLM on GPUs of its own with a
                learned reward model that has GPUs of its own too
    oppo-async-bg
                async admission and carry-over with the weight sync in the background
                (--oppo.staleness.background_sync), no streaming: the reward model may share the
                DeepSpeed models' GPUs, as in OpenRLHF's async layout. The default where vLLM has
                GPUs of its own

OPPO schedules run `python -m openrlhf_oppo.cli.train_ppo_ray` (OpenRLHF's entry point
plus OPPO's touch points) with the YAML's `oppo:` section and the schedule's
`oppo` overrides as `--oppo.*` flags. Other tools may add schedules with `register`
(the lab adds its ablations so); `--schedule` then accepts them too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from openrlhf_oppo import settings
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
        Schedule("oppo-async", f"OPPO with async admission (max_policy_lag {ASYNC_POLICY_LAG}): the next B+Δ decode "
                 "while the trainer trains", entry_module=OPPO_ENTRY,
                 oppo={"staleness": {"max_policy_lag": ASYNC_POLICY_LAG}}),
        Schedule("oppo-async-bg", "OPPO with async admission and carry-over, no streaming, and the weight sync in "
                 "the background: the trainer waits for the gather only", entry_module=OPPO_ENTRY,
                 oppo={"staleness": {"max_policy_lag": ASYNC_POLICY_LAG, "background_sync": True},
                       "streaming": {"enable": False}}),
    )
}


REGISTERED: dict[str, Schedule] = {}
"""Schedules added by `register` beyond the product's (the lab's ablations)."""


def register(*schedules: Schedule) -> None:
    """Offer `schedules` beside SCHEDULES to `check` and everything that resolves a name through it
    (`openrlhf-oppo train`, `bench schedules`, the simulator). All or nothing: a name already offered
    for another schedule is a ValueError and nothing is added."""
    offered = all_schedules()
    taken = [s.name for s in schedules if offered.get(s.name, s) != s]  # the same row again is no change
    if taken:
        raise ValueError(f"schedule names already offered: {', '.join(taken)}")
    REGISTERED.update({s.name: s for s in schedules})


def all_schedules() -> dict[str, Schedule]:
    """SCHEDULES and the registered ones, in that order."""
    return {**SCHEDULES, **REGISTERED}


def is_oppo(name: str) -> bool:
    """Whether `name` is one of OPPO's schedules (a known name with an `oppo:` section)."""
    schedule = all_schedules().get(name)
    return schedule is not None and schedule.oppo is not None


def check(name: str) -> Schedule:
    """The schedule called `name`; ValueError naming the allowed ones otherwise."""
    offered = all_schedules()
    schedule = offered.get(name)
    if schedule is None:
        raise ValueError(f"--schedule: unknown schedule '{name}'{settings.suggest(name, offered)}; allowed: "
                         f"{', '.join(offered)}")
    if not schedule.available:
        available = ", ".join(n for n, s in offered.items() if s.available)
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

    section = merged_oppo(name, oppo_section)
    return None if section is None else oppo_config_module.from_dict(section)


def merged_oppo(name: str, oppo_section: dict) -> dict | None:
    """The YAML's `oppo:` section with the OPPO schedule `name`'s overrides on top; None for OpenRLHF's."""
    schedule = check(name)
    return None if schedule.oppo is None else _merge(oppo_section, schedule.oppo)


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
