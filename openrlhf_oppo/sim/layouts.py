"""Which layouts each schedule's framework can run, whether they fit, and each schedule's best.

The rules, from OpenRLHF 0.11.2's `cli/train_ppo_ray.py` and OPPO's integration:

    colocated   vLLM on the DeepSpeed models' devices is `--train.colocate_all`: every model in one
                placement group, the reward model included (`split.score_gpus` 0). OpenRLHF's async
                modes cannot (with `--train.async_enable` it "only colocates DeepSpeed models": vLLM
                gets its own devices).
    sleep       the hybrid engine, colocated: `sync` and OPPO's schedules without async admission (OPPO
                stops its carried requests at the batch and decodes them on after the wake). OpenRLHF's
                async modes refuse it ("Async RLHF is not supported with --vllm.enable_sleep"), and so
                does OPPO's async admission (`staleness.max_policy_lag` >= 1, `oppo-async`): asleep,
                nothing decodes while the models train. OPPO's streaming actors beside the engines do
                not sleep: they keep their caches.
    split       vLLM on its own devices. The critic beside the actor and the reward model among
                the DeepSpeed models (`split.reward_with_train`) only under `--train.colocate_all`
                with `--train.async_enable`, which OPPO takes with async admission only (its
                trainer in place of OpenRLHF's async one; a streaming reward actor there would sit
                beside the DeepSpeed models: not modelled, so `oppo-async-inter`); otherwise the
                critic has devices of its own (`split.critic_gpus`, with the reward model under
                `--train.colocate_critic_reward`) and the reward model its own or the critic's.
                OPPO's streaming reward actors hold the whole model on devices of their own
                (beside the critic: not modelled).
    reference   OPPO's streaming reference actors (`projections.reference_actors`) hold the whole
                reference: beside the engines (colocated or split), or, split, on a device of their
                own a node (`split.reference_gpus`), which only such a schedule can use.

The paper's layout (colocated, the reward model on its own devices) is not one OpenRLHF's flags
can place; a preset that names it is simulated as named, and `--best-layout` never picks it.
Memory (`sim.memory`) rules out the rest: a layout that does not fit is reported with what
overflows, never simulated.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from openrlhf_oppo.integrations.launch.schedules import is_oppo
from openrlhf_oppo.sim import memory
from openrlhf_oppo.sim.presets import SimConfig, Split, schedule_oppo, vllm_tp_fits

ASYNC_BASELINES = ("async", "partial", "oversample", "oversample-3b", "oversample-4b", "async+bg")


def rule(schedule: str, split: Split, streams_reward: bool = False, critic: bool = True,
         ref_actors: bool = False, async_admission: bool = False, ahead: bool = False,
         reward_model: bool = True) -> str | None:
    """Why `schedule`'s framework cannot run `split`; None when it can. `streams_reward`: OPPO
    streams chunks into the reward model (its reward group is made of streaming reward actors);
    `critic`: the run has a critic; `ref_actors`: OPPO streams the reference into streaming
    reference actors; `async_admission`: OPPO admits the next step's groups while the trainer
    trains (`admits_async`); `ahead`: OPPO forwards committed groups while the engines generate
    (`projections.experience_ahead`); `reward_model`: a reward model scores the samples (false:
    a rule reward, no reward model to place)."""
    async_mode = schedule in ASYNC_BASELINES
    if split.reference_gpus and not ref_actors:
        return ("devices for streaming reference actors (split.reference_gpus) serve only OPPO streaming the "
                "reference into them (streaming.reference and projections.reference_actors)")
    if split.sleep and async_mode:
        return ("OpenRLHF refuses sleep mode with its async modes (\"Async RLHF is not supported with "
                "--vllm.enable_sleep\")")
    if split.colocate and async_mode:
        return ("OpenRLHF's async modes keep vLLM on its own devices (--train.colocate_all with "
                "--train.async_enable colocates only the DeepSpeed models)")
    if split.sleep and async_admission:
        return ("OPPO refuses sleep mode with async admission (staleness.max_policy_lag >= 1): asleep, the engines "
                "decode nothing while the models train")
    if split.sleep and ahead:
        return ("projections.experience_ahead forwards while the engines generate, when sleep mode has the DeepSpeed "
                "models offloaded")
    if streams_reward and split.reward_with_train:
        return ("streaming reward actors beside the DeepSpeed models (--train.colocate_critic_reward) are not "
                "modelled: give them devices of their own or the engines'")
    reward_on_train = reward_model and split.reward_with_train  # a rule reward has no model to place
    if reward_model and not streams_reward and split.colocate and not split.score_gpus and not reward_on_train:
        return "--train.colocate_all puts OpenRLHF's reward model among the DeepSpeed models (split.reward_with_train)"
    pooled = not split.colocate and not split.critic_gpus  # the DeepSpeed models share devices apart from vLLM
    if pooled and (critic or reward_on_train) and not ((async_mode or async_admission)
                                                               and split.reward_with_train):
        return ("apart from vLLM, OpenRLHF puts the critic and reward model beside the actor only under "
                "--train.colocate_all with --train.async_enable (split.reward_with_train; OPPO with async admission "
                "only); otherwise they need devices of their own (split.critic_gpus, split.score_gpus)")
    return None


def streams_reward(cfg: SimConfig, schedule: str) -> bool:
    """Whether `schedule` streams chunks into the reward model with `cfg`'s OPPO settings."""
    if not is_oppo(schedule):
        return False
    return "reward" in schedule_oppo(cfg, schedule).streaming.scorers()


def admits_async(cfg: SimConfig, schedule: str) -> bool:
    """Whether `schedule` admits the next step's groups while the trainer trains (OPPO's
    `staleness.max_policy_lag` >= 1 with `cfg`'s OPPO settings, as `oppo-async`)."""
    if not is_oppo(schedule):
        return False
    return schedule_oppo(cfg, schedule).staleness.max_policy_lag >= 1


def forwards_ahead(cfg: SimConfig, schedule: str) -> bool:
    """Whether `schedule` forwards committed groups ahead of the batch (`projections.experience_ahead`)."""
    if not is_oppo(schedule):
        return False
    return cfg.projections.experience_ahead


def syncs_in_background(cfg: SimConfig, schedule: str) -> bool:
    """Whether `schedule` broadcasts its weights beside the next step (`staleness.background_sync`,
    with async admission)."""
    if not admits_async(cfg, schedule):
        return False
    return schedule_oppo(cfg, schedule).staleness.background_sync


def streams_reference_actors(cfg: SimConfig, schedule: str) -> bool:
    """Whether `schedule` streams the reference into OPPO's streaming reference actors."""
    if not is_oppo(schedule):
        return False
    streaming = schedule_oppo(cfg, schedule).streaming
    return "reference" in streaming.scorers() and cfg.projections.reference_actors


def check(cfg: SimConfig, schedule: str) -> tuple[SimConfig, list[str]]:
    """`cfg` with vLLM's memory share fitted (`memory.fit_engines`), and why `schedule` cannot run
    it (empty: it can)."""
    streams = streams_reward(cfg, schedule)
    ref = streams_reference_actors(cfg, schedule)
    # a measured preset is one shared host (cpu-longtail): where the critic sits changes no device
    reason = rule(schedule, cfg.split, streams, cfg.workload.critic and cfg.hardware is not None, ref,
                  admits_async(cfg, schedule), forwards_ahead(cfg, schedule), cfg.workload.reward_model)
    reasons = [reason] if reason else []
    if cfg.hardware is not None and cfg.actor is not None:
        buffer = syncs_in_background(cfg, schedule)
        cfg = memory.fit_engines(cfg, ref, buffer)
        reasons += memory.overflow(cfg, streams, ref, buffer)
    return cfg, reasons


def describe(split: Split, ref_actors: bool = False) -> str:
    """A layout in a few words: the devices of one node, or the engine nodes and the pattern of the
    others (`ref_actors`: where the streaming reference actors sit)."""
    ref = ""
    if ref_actors and split.reference_gpus:
        ref = f" / {split.reference_gpus} ref"
    elif ref_actors:
        ref = " + ref by vLLM"
    if split.colocate:
        if split.score_gpus:
            rm = f" + {split.score_gpus} reward"
        elif split.reward_with_train:
            rm = ""
        else:
            rm = ", scorers"
        how = ", sleep" if split.sleep else ""
        return f"colocated {split.generate_gpus}{rm}{ref} (TP {split.tensor_parallel}{how})"
    if split.critic_gpus:
        train = f"{split.train_gpus} actor / {split.critic_gpus} critic"
    else:
        train = f"{split.train_gpus} train"
    if split.score_gpus:
        rm = f"{split.score_gpus} reward"
    elif split.critic_gpus:
        rm = "reward with critic"
    else:
        rm = "reward with train"
    if split.engine_nodes:
        return (f"{split.engine_nodes} vLLM node{'s' if split.engine_nodes > 1 else ''} + {split.pattern_nodes} x "
                f"({train} / {rm}{ref}) (TP {split.tensor_parallel})")
    return f"{split.generate_gpus} vLLM / {train} / {rm}{ref} (TP {split.tensor_parallel})"


def _tp_choices(cfg: SimConfig, weight_bytes: float) -> list[int]:
    """Every power of two up to a node that vLLM can shard the actor's heads by and whose share of the
    weights leaves a quarter of a device for KV. Not only the smallest: a larger TP decodes each iteration
    faster, which long responses need more than more engines (7B at reasoning lengths: over-sampling's
    best engines are TP 4)."""
    g = cfg.split.gpus_per_node
    tps = [tp for tp in (1, 2, 4, 8, 16) if tp <= g and weight_bytes / tp <= 0.75 * cfg.hardware.hbm_bytes
           and vllm_tp_fits(cfg.actor, tp)]
    return tps or [g]


def candidates(cfg: SimConfig, ref_actors: bool = False) -> list[Split]:
    """Splits of `cfg`'s nodes (one pattern a node, or whole nodes of vLLM and one pattern on the
    rest): colocated with and without sleep (OpenRLHF's reward model among the DeepSpeed models, or
    OPPO's streaming actors beside the engines), and every split of a node's devices into vLLM (a
    multiple of TP; none on the pattern's nodes beside engine nodes), reward (none, one or two devices; a
    streaming reward actor holds the whole model) and DeepSpeed devices, the critic's apart (about
    half of them) or not; with `ref_actors`, split layouts also with one device a node for streaming
    reference actors (else they sit beside the engines). `rule` and the memory check then say who
    can run each."""
    s = cfg.split
    g = s.gpus_per_node
    out = []
    for tp in _tp_choices(cfg, cfg.actor.weight_bytes):
        base = dataclasses.replace(s, tensor_parallel=tp, score_tensor_parallel=1, reward_with_train=False,
                                   critic_gpus=0, reference_gpus=0, engine_nodes=0)
        if g % tp == 0:  # OpenRLHF's reward model among the DeepSpeed models, or OPPO's scorers beside the engines
            coloc = dataclasses.replace(base, colocate=True, generate_gpus=g, train_gpus=g, score_gpus=0)
            out += [dataclasses.replace(coloc, sleep=sleep, reward_with_train=True) for sleep in (False, True)]
            out += [dataclasses.replace(coloc, sleep=sleep) for sleep in (False, True)]
        # vLLM on some devices of every node, or on whole nodes of its own (the pattern then has none)
        placements = [(0, gen) for gen in range(tp, g, tp)] + [(n, 0) for n in range(1, s.nodes) if g % tp == 0]
        refs = (0, 1) if ref_actors else (0,)  # devices a node for streaming reference actors
        for (nodes, gen), ref in itertools.product(placements, refs):
            for score in (0, 1, 2):
                rest = g - gen - score - ref
                critics = [0]  # the critic's own devices: none, or about half of the DeepSpeed ones
                if cfg.workload.critic:
                    critics = sorted({0, *(c for c in (rest // 2, rest - rest // 2) if 1 <= c < rest)})
                for critic in critics:
                    if rest - critic >= 1:
                        out.append(dataclasses.replace(base, colocate=False, sleep=False, generate_gpus=gen,
                                                       train_gpus=rest - critic, critic_gpus=critic,
                                                       score_gpus=score, reward_with_train=score == 0,
                                                       reference_gpus=ref, engine_nodes=nodes))
    return out


@dataclass
class Searched:
    """Every candidate layout of a cluster, per schedule: runnable (fitted cfg), and the layouts that
    do not fit with what overflows."""

    runnable: dict[str, list[SimConfig]]
    refused: list[tuple[Split, str, list[str]]]  # (layout, for whom, what overflows)


def search_space(cfg: SimConfig, schedules: tuple[str, ...]) -> Searched:
    runnable: dict[str, list[SimConfig]] = {s: [] for s in schedules}
    refused = []
    kinds = {s: (streams_reward(cfg, s), streams_reference_actors(cfg, s), syncs_in_background(cfg, s))
             for s in schedules}
    lagged = {s: admits_async(cfg, s) for s in schedules}
    for split in candidates(cfg, any(kind[1] for kind in kinds.values())):
        base = dataclasses.replace(cfg, split=split)
        allowed = [s for s in schedules
                   if rule(s, split, kinds[s][0], cfg.workload.critic, kinds[s][1], lagged[s],
                           forwards_ahead(cfg, s), cfg.workload.reward_model) is None]
        for kind in sorted({kinds[s] for s in allowed}):
            trial = memory.fit_engines(base, kind[1], kind[2])
            over = memory.overflow(trial, *kind)
            if over:
                refused.append((split, _whom(*kind), over))
            else:
                runnable.update({s: [*runnable[s], trial] for s in allowed if kinds[s] == kind})
    return Searched(runnable, refused)


def _whom(streams: bool, ref_actors: bool, sync_buffer: bool = False) -> str:
    """For whom a layout was checked, as the refusals list says it."""
    buffer = " (weight-sync buffer)" if sync_buffer else ""
    if not streams:
        return "OpenRLHF's reward model" + (" and OPPO's reference actors" if ref_actors else "") + buffer
    return "OPPO with streaming reward" + (" and reference actors" if ref_actors else " actors") + buffer
