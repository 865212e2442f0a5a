"""What each device holds in a simulated layout, and whether it fits.

Per device (bytes), by the role's devices::

    training devices   ZeRO-3 states of the actor and critic: bf16 weights + bf16 gradients + fp32
                       Adam master weights, momentum and variance = 16 B a parameter, sharded over
                       the training devices; the reference (and, `split.reward_with_train`, the
                       reward model): bf16 weights sharded the same way; the parameters ZeRO-3
                       gathers at once (DeepSpeed's `stage3_max_live_parameters`, 1e9: 2 GB);
                       activations of one micro-batch of full-length samples (with
                       `workload.gradient_checkpointing` a layer input per layer and one layer's
                       working set, without it every layer's), fp32 logits and their gradient
    engine devices     vLLM claims `workload.kv_cache_fraction` of the device (its
                       gpu_memory_utilization): the actor's weights over tensor_parallel, the rest KV
    critic devices     with `split.critic_gpus` (OpenRLHF without --train.colocate_all): the critic's
                       ZeRO-3 states (and the reward model with `split.reward_with_train`)
    reward devices     OPPO's streaming reward actor: the whole model (it has no tensor parallelism)
                       and its forward's working set (2 x max_batch_tokens of KV: the padded cache
                       copy and the new KV); OpenRLHF's reward model: a ZeRO-3 shard
    reference devices  OPPO's streaming reference actors (`projections.reference_actors`, on
                       `split.reference_gpus` devices or beside the engines): the whole reference, its
                       forward's working set as the reward actor's, and its KV budget (the frozen
                       reference keeps each sequence's KV until it is trained); the training devices
                       then hold no reference
    every device       RESERVE_BYTES: CUDA context, NCCL buffers, allocator fragmentation

Colocated devices hold the engines' and the training devices' items at once (vLLM stays awake),
or, with `split.sleep` (OpenRLHF's hybrid engine: `--vllm.enable_sleep --ds.enable_sleep`), one
side at a time: each step then moves vLLM's weights and the DeepSpeed states over PCIe, out and
back (`sleep_transfer_s`). OPPO's streaming actors beside the engines do not sleep (they keep their
caches): they sit beside whichever side is awake. A colocated layout without sleep gives vLLM what
the training side and the streaming actors beside the engines leave (`fit_engines`), which may hold
fewer sequences; so do a sleeping layout and a split layout with streaming actors beside the engines
(what those actors leave).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from openrlhf_oppo.footprint import (  # one formula each, shared with the launch-time memory check
    GB,
    LIVE_PARAMETERS,
    RESERVE_BYTES,
    STREAM_MAX_BATCH_TOKENS,
    WEIGHT_BYTES_PER_PARAM,
    largest_param,
    training_activation_bytes,
    zero3_bytes,
)
from openrlhf_oppo.sim.presets import ModelShape, SimConfig


@dataclass(frozen=True)
class DeviceUse:
    """One kind of device in a layout: what each of them holds."""

    devices: str  # "training", "engine", "colocated", "reward"
    items: tuple[tuple[str, float], ...]  # (what, bytes per device)
    capacity: float

    @property
    def total(self) -> float:
        return sum(b for _, b in self.items)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def describe(self) -> str:
        parts = ", ".join(f"{what} {b / GB:.1f}" for what, b in self.items if b > 0)
        return f"{self.devices} devices: {self.total / GB:.1f} GB of {self.capacity / GB:.0f} GB ({parts})"


def _activations(cfg: SimConfig, m: ModelShape) -> float:
    """One micro-batch of full-length samples (`footprint.training_activation_bytes`), with or
    without `workload.gradient_checkpointing`."""
    ln = cfg.lengths
    tokens = cfg.workload.micro_batch_size * (ln.prompt_tokens + ln.cap_tokens)
    return training_activation_bytes(tokens, m.layers, m.hidden, m.intermediate, m.vocab,
                                     cfg.workload.gradient_checkpointing)


def training_items(cfg: SimConfig, group: str = "actor", ref_actors: bool = False,
                   sync_buffer: bool = False) -> list[tuple[str, float]]:
    """Per device of the training devices (`group` "actor": `split.train_gpus`, every DeepSpeed
    model unless the critic has devices of its own; "critic": `split.critic_gpus`, the critic and,
    with `split.reward_with_train`, the reward model). `ref_actors`: streaming reference actors hold
    the reference, the training devices do not. `sync_buffer` (`staleness.background_sync`): the
    actor's first rank holds a whole copy of its weights while they are broadcast (charged to every
    device: the one that holds it must fit), or with `staleness.background_sync_buffer` host, in host
    memory, one parameter at a time on the device; `shards`: each device its own partition."""
    s = cfg.split
    w = cfg.workload
    actor = cfg.actor
    reward = cfg.reward or actor
    critic = cfg.critic or reward
    apart = s.critic_gpus > 0
    n = s.pattern_nodes * (s.critic_gpus if group == "critic" else s.train_gpus)
    items = []
    if group == "actor":
        items.append(("actor ZeRO-3 states", zero3_bytes(actor.params, True, n)))
        if sync_buffer and cfg.oppo.staleness.background_sync_buffer == "shards":
            items.append(("weight-sync partitions", actor.weight_bytes / n))
        elif sync_buffer and cfg.oppo.staleness.background_sync_buffer == "host":
            largest = largest_param(actor.hidden, actor.intermediate, actor.vocab)
            items.append(("weight-sync staging", WEIGHT_BYTES_PER_PARAM * largest))
        elif sync_buffer:
            items.append(("weight-sync buffer", actor.weight_bytes))
        if w.reference and not ref_actors:
            items.append(("reference", zero3_bytes(actor.params, False, n)))
    if w.critic and (group == "critic") == apart:
        items.append(("critic ZeRO-3 states", zero3_bytes(critic.params, True, n)))
    if s.reward_with_train and w.reward_model and (group == "critic") == apart:
        items.append(("reward model", zero3_bytes(reward.params, False, n)))
    items.append(("ZeRO-3 live parameters", 2 * LIVE_PARAMETERS))
    # the activations of the larger model these devices train
    big = actor
    if w.critic and (group == "critic" or (not apart and critic.params > actor.params)):
        big = critic
    items.append(("activations", _activations(cfg, big)))
    return items


def engine_items(cfg: SimConfig) -> list[tuple[str, float]]:
    claim = cfg.workload.kv_cache_fraction * cfg.hardware.hbm_bytes
    weights = cfg.actor.weight_bytes / cfg.split.tensor_parallel
    return [("vLLM weights", weights), ("vLLM KV cache", max(0.0, claim - weights))]


def scorer_items(cfg: SimConfig, streams: bool) -> list[tuple[str, float]]:
    """A reward device: OPPO's streaming reward actor holds the whole model (no tensor
    parallelism) and its forward's KV copies; OpenRLHF's reward model is a ZeRO-3 shard over the
    reward devices."""
    s = cfg.split
    reward = cfg.reward or cfg.actor
    if streams:
        working = 2 * STREAM_MAX_BATCH_TOKENS * reward.kv_bytes_per_token
        return [("streaming reward actor", reward.weight_bytes), ("its forward", working)]
    return [("reward model", zero3_bytes(reward.params, False, s.pattern_nodes * max(1, s.score_gpus)))]


def reference_actor_count(cfg: SimConfig) -> int:
    """Streaming reference actors: one a `split.reference_gpus` device, or one beside each engine."""
    s = cfg.split
    return s.pattern_nodes * s.reference_gpus or s.engines


def reference_kv_budget_tokens(cfg: SimConfig) -> int:
    """The KV a streaming reference actor keeps (tokens): its share of the sequences in flight,
    (B + Δ max) x n, each at prompt + mean response (capped). The reference is frozen, so a carried
    sample's KV stays until the sample is trained (an estimate: the simulator does not track it)."""
    w = cfg.workload
    ln = cfg.lengths
    seqs = math.ceil((w.batch_groups + cfg.oppo.delta.max) * w.samples_per_group / reference_actor_count(cfg))
    return seqs * math.ceil(ln.prompt_tokens + min(ln.mean_tokens, ln.cap_tokens))


def reference_actor_items(cfg: SimConfig) -> list[tuple[str, float]]:
    """A streaming reference actor's device: the whole reference (the actor's shape; no tensor
    parallelism), its forward's KV copies as the reward actor's, and its KV budget."""
    kv = cfg.actor.kv_bytes_per_token
    return [("streaming reference actor", cfg.actor.weight_bytes), ("its forward", 2 * STREAM_MAX_BATCH_TOKENS * kv),
            ("its KV budget", reference_kv_budget_tokens(cfg) * kv)]


def _scorers_on_engines(cfg: SimConfig) -> bool:
    """A streaming reward actor beside each engine: a reward model without devices of its own (a rule
    reward has none)."""
    s = cfg.split
    return cfg.workload.reward_model and s.score_gpus == 0 and not s.reward_with_train


def _beside_engines(cfg: SimConfig, ref_actors: bool) -> list[tuple[str, float]]:
    """Streaming actors on an engine's device: the reward actor without devices of its own, the
    reference actor with `ref_actors` and no `split.reference_gpus`."""
    s = cfg.split
    items = scorer_items(cfg, True) if _scorers_on_engines(cfg) else []
    if ref_actors and not s.reference_gpus:
        items += reference_actor_items(cfg)
    return items


def _load(items: list[tuple[str, float]]) -> float:
    return sum(b for _, b in items)


def plan(cfg: SimConfig, streams: bool = False, ref_actors: bool = False, sync_buffer: bool = False) -> list[DeviceUse]:
    """What each kind of device holds (requires `hardware` and `actor`); `streams`: the schedule
    streams into OPPO's reward actors; `ref_actors`: into OPPO's streaming reference actors;
    `sync_buffer`: a background weight sync's copy of the actor (`training_items`)."""
    s = cfg.split
    cap = cfg.hardware.hbm_bytes
    reserve = [("reserve", RESERVE_BYTES)]
    train = training_items(cfg, ref_actors=ref_actors, sync_buffer=sync_buffer)
    engines = engine_items(cfg)
    on_engines = _beside_engines(cfg, ref_actors)
    out = []
    if s.colocate:
        if s.sleep:  # one side at a time: the larger must fit; OPPO's streaming actors stay awake beside both
            side = max((train, engines), key=_load)
            out.append(DeviceUse("colocated", tuple(side + on_engines + reserve), cap))
        else:
            out.append(DeviceUse("colocated", tuple(engines + on_engines + train + reserve), cap))
    else:
        out.append(DeviceUse("training", tuple(train + reserve), cap))
        if s.critic_gpus:
            out.append(DeviceUse("critic", tuple(training_items(cfg, "critic") + reserve), cap))
        out.append(DeviceUse("engine", tuple(engines + on_engines + reserve), cap))
    if s.score_gpus and cfg.workload.reward_model:  # a rule reward: nothing on them
        out.append(DeviceUse("reward", tuple(scorer_items(cfg, streams) + reserve), cap))
    if ref_actors and s.reference_gpus:
        out.append(DeviceUse("reference", tuple(reference_actor_items(cfg) + reserve), cap))
    return out


def overflow(cfg: SimConfig, streams: bool = False, ref_actors: bool = False, sync_buffer: bool = False) -> list[str]:
    """The devices that do not fit, each described; empty when the layout fits. Also an engine whose
    KV cache cannot hold one full-length sequence (vLLM refuses to start)."""
    msgs = [f"{u.describe()}: over by {(u.total - u.capacity) / GB:.1f} GB"
            for u in plan(cfg, streams, ref_actors, sync_buffer) if not u.fits]
    kv = dict(engine_items(cfg))["vLLM KV cache"]
    ln = cfg.lengths
    need = cfg.actor.kv_bytes_per_token / cfg.split.tensor_parallel * (ln.prompt_tokens + ln.cap_tokens)
    if kv < need:
        msgs.append(f"engine devices: a KV cache of {kv / GB:.1f} GB cannot hold one {ln.prompt_tokens} + "
                    f"{ln.cap_tokens} token sequence ({need / GB:.2f} GB)")
    return msgs


def fit_engines(cfg: SimConfig, ref_actors: bool = False, sync_buffer: bool = False) -> SimConfig:
    """vLLM's share (`workload.kv_cache_fraction`) lowered to what the other items on its devices and
    the reserve leave, never raised: colocated with vLLM awake, the training side and the streaming
    actors beside the engines; split or asleep (`split.sleep`: the training side is away while vLLM
    generates), those actors (`ref_actors`: the reference actors among them). Other layouts as given."""
    s = cfg.split
    beside = _load(_beside_engines(cfg, ref_actors))
    awake_beside_training = s.colocate and not s.sleep
    if not (awake_beside_training or beside):
        return cfg
    cap = cfg.hardware.hbm_bytes
    others = beside + RESERVE_BYTES
    if awake_beside_training:
        others += _load(training_items(cfg, ref_actors=ref_actors, sync_buffer=sync_buffer))
    share = min(cfg.workload.kv_cache_fraction, max(0.0, (cap - others) / cap))
    return dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, kv_cache_fraction=share))


def sleep_transfer_s(cfg: SimConfig) -> float:
    """One direction of the hybrid engine's per-step moves, per device (all devices in parallel):
    vLLM's weights and the actor's and critic's ZeRO-3 states over PCIe (OpenRLHF offloads those
    two; the reference and reward model stay); 0 without `split.sleep`."""
    if not cfg.split.sleep:
        return 0.0
    moved = cfg.actor.weight_bytes / cfg.split.tensor_parallel
    moved += sum(b for what, b in training_items(cfg) if what.endswith("ZeRO-3 states"))
    return moved / cfg.hardware.pcie_bytes_per_s
