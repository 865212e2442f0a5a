"""Memory of every GPU of a run, per phase of a step, checked before anything starts.

OpenRLHF 0.11.2 places its models in groups (`train_ppo_ray.train`): vLLM's engines; the actor
(the reference beside it with `--train.colocate_actor_ref`); the critic (the reward model beside it
with `--train.colocate_critic_reward`); under `--train.colocate_all` every group on the actor's
GPUs, vLLM too unless `--train.async_enable`. OPPO's streaming reward (and reference) actors take
the place of the reward (reference) group, one whole model each. GPUs that hold the same things
are one kind; for each kind this counts, per GPU, what is on the device in each phase of a step:

    generating   vLLM decodes (asleep otherwise with --vllm.enable_sleep), streaming actors prefill
    experience   make_experience's forwards: old log-probs, reference, values, rewards; colocated
                 models take turns (OpenRLHF empties each one's cache after it), so only the
                 largest forward's working set counts
    training     the actor's and critic's updates; with --ds.enable_sleep one after the other
                 (critic, then actor), each reloading its optimizer states, so two phases

Per GPU (`openrlhf_oppo.footprint`):

    vLLM                      --vllm.gpu_memory_utilization x device memory (its weights, KV cache,
                              activations and context); on a GPU of its own 1 GB beyond it
    actor, critic (DeepSpeed) ZeRO-3 over their GPUs: bf16 weights 2 B a parameter always; gradients
                              and Adam states 14 B (with --ds.enable_sleep only while it trains);
                              training activations of --train.micro_batch_size x --data.max_len
                              tokens; ZeRO-3's live parameters (2 GB) while it runs
    actor (Megatron)          (2 + 4 + 12 / DP) B a parameter of its heaviest pipeline stage over
                              tensor parallel ranks; the activations of the micro-batches 1F1B keeps
                              in flight on the first stage (PP of them)
    reference, reward model   ZeRO-3 inference: 2 B a parameter over their GPUs
    forwards                  --rollout.micro_batch_size x --data.max_len tokens: one layer's
                              working set, the logits of an LM (bf16 and fp32), live parameters
    streaming actor           the whole model (--ds.param_dtype), its KV budget, the batched
                              forward's 2 x 16,384 tokens of KV and one layer's working set
    background sync buffer    as --oppo.staleness.background_sync_buffer places it
    reserve                   4 GB (CUDA context, NCCL, fragmentation) + 0.5 GB for each further
                              process on the GPU

These are estimates (activations of padded, full-length micro-batches; no measurement yet of a
whole preset on GPUs): a layout over the device's memory is refused, one within 8 % of it is
flagged. Model shapes come from `model_shapes` (a local config.json, Hugging Face's local cache, or
the shipped table: nothing is downloaded); a model found in none leaves the layout uncounted, said
so, never passed.

A streaming actor's automatic KV budget (0.5 of `mem_get_info()` at its load) reads free memory
while the models beside it may still be loading or allocating (vLLM under --train.colocate_all,
the actor's ZeRO-3 initialisation under --train.colocate_actor_ref, the critic under
--train.colocate_critic_reward), so where it shares its GPU the budget must be given
(`--oppo.streaming.kv_budget_tokens`); this check then counts it.

The device's memory: `OPPO_DEVICE_MEMORY_GB`, else the launching host's first CUDA device, else the
preset's `device:` section (the GPU it was sized for); without any (a CPU run) nothing is counted
and a note says so.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from openrlhf_oppo import footprint, run_env
from openrlhf_oppo.config import OppoConfig
from openrlhf_oppo.integrations.launch import model_shapes
from openrlhf_oppo.integrations.launch.model_shapes import Shape

NOTE = "openrlhf-oppo: memory check:"
GB = footprint.GB
MIN_MARGIN = 0.08  # of the device's memory, in the tightest phase: below it the table flags the layout
DTYPE_BYTES = {"bf16": 2, "fp16": 2}  # --ds.param_dtype; anything else: fp32
GENERATING = "generating"
EXPERIENCE = "experience"
TRAINING = "training"
TRAINING_CRITIC = "training critic"
TRAINING_ACTOR = "training actor"
LEGEND = [
    "  phases: generating (vLLM decodes, streaming actors prefill); experience (make_experience's forwards); "
    "training (the updates)",
    "  forward: one layer's working set, an LM's logits (bf16 and fp32), ZeRO-3's live parameters; forwards take "
    "turns: a total counts the largest",
    f"  streaming forward: its batch's KV copies and one layer over {footprint.STREAM_MAX_BATCH_TOKENS:,} tokens; "
    f"reserve: {footprint.RESERVE_BYTES / footprint.GB:g} GB (CUDA context, NCCL, fragmentation) + "
    f"{footprint.CUDA_CONTEXT_BYTES / footprint.GB:g} GB a further process",
]
# vLLM's own activations (profiled at start-up) and CUDA graphs inside its share: what its KV
# cache does not get (an estimate, for the KV room note)
VLLM_WORKING_BYTES = 2 * GB


def _note(message: str) -> None:
    print(f"{NOTE} {message}", flush=True)


@dataclass(frozen=True)
class Device:
    """One GPU's memory and where the figure came from."""

    memory_bytes: float
    source: str


@dataclass(frozen=True)
class Item:
    """Something on each GPU of a kind."""

    what: str
    bytes: float
    phases: frozenset[str] | None = None  # the phases it is on the device; None: every phase
    in_turn: bool = False  # a forward's working set: colocated forwards take turns, the largest counts


@dataclass(frozen=True)
class GpuKind:
    """GPUs that hold the same things."""

    name: str  # what is on them, e.g. "vLLM (4 engines x TP 1)"
    gpus: int
    items: tuple[Item, ...]

    def present(self, item: Item, phase: str) -> bool:
        return item.phases is None or phase in item.phases

    def need(self, phase: str) -> float:
        """Bytes on each of these GPUs in `phase`."""
        steady = sum(i.bytes for i in self.items if self.present(i, phase) and not i.in_turn)
        turns = [i.bytes for i in self.items if self.present(i, phase) and i.in_turn]
        return steady + max(turns, default=0.0)


@dataclass(frozen=True)
class Count:
    """The check's result: what every GPU kind holds in every phase, on `device`."""

    device: Device
    phases: tuple[str, ...]
    kinds: tuple[GpuKind, ...]
    uncounted: tuple[str, ...]  # the models that could not be counted, each with why
    notes: tuple[str, ...] = field(default=())  # shapes' sources, vLLM's KV room, ...

    @property
    def counted(self) -> bool:
        return not self.uncounted

    def tightest(self) -> tuple[GpuKind, str, float]:
        """(kind, phase, bytes needed) with the least memory left."""
        return max(((k, p, k.need(p)) for k in self.kinds for p in self.phases), key=lambda t: t[2])

    def margin(self) -> float:
        """Memory left in the tightest phase, as a share of the device's."""
        return 1 - self.tightest()[2] / self.device.memory_bytes

    def table(self) -> list[str]:
        """The per-GPU, per-phase table, GB with one decimal; the tightest phase marked."""
        cap = self.device.memory_bytes
        if not self.kinds:
            return [f"device {cap / GB:.1f} GB ({self.device.source}): no GPU kind could be counted",
                    *(f"  UNCOUNTED: {what}" for what in self.uncounted)]
        tight_kind, tight_phase, tight_need = self.tightest()
        width = max(len(i.what) for k in self.kinds for i in k.items) + 2
        col = max(10, *(len(p) + 2 for p in self.phases))

        def row(label: str, cells: list[str], marks: list[str] | None = None) -> str:
            marks = marks or [" "] * len(cells)
            return "    " + label.ljust(width) + "".join(c.rjust(col) + m for c, m in zip(cells, marks))

        lines = [f"memory per GPU in GB, device {cap / GB:.1f} GB ({self.device.source}); estimates"]
        for n, kind in enumerate(self.kinds, 1):
            lines.append(f"[{n}] {kind.gpus} GPU{'s' if kind.gpus > 1 else ''}: {kind.name}")
            lines.append(row("item", list(self.phases)))
            for item in kind.items:
                lines.append(row(item.what, [f"{item.bytes / GB:.1f}" if kind.present(item, p) else "-"
                                             for p in self.phases]))
            marks = ["*" if (kind, p) == (tight_kind, tight_phase) else " " for p in self.phases]
            lines.append(row("total", [f"{kind.need(p) / GB:.1f}" for p in self.phases], marks))
            lines.append(row("margin", [f"{(cap - kind.need(p)) / GB:.1f}" for p in self.phases]))
        if tight_need > cap:
            verdict = "over the device"
        elif self.margin() < MIN_MARGIN:
            verdict = f"below {MIN_MARGIN:.0%}"
        else:
            verdict = "ok"
        lines.append(f"tightest (*): [{self.kinds.index(tight_kind) + 1}] {tight_phase}: {tight_need / GB:.1f} of "
                     f"{cap / GB:.1f} GB, margin {(cap - tight_need) / GB:.1f} GB ({self.margin():.1%}): {verdict}")
        lines += LEGEND
        lines += [f"  {note}" for note in self.notes]
        lines += [f"  UNCOUNTED: {what}" for what in self.uncounted]
        return lines


def device_memory(environ: Mapping[str, str] | None = None, preset: Device | None = None) -> Device | None:
    """One GPU's memory: `OPPO_DEVICE_MEMORY_GB`, the host's first CUDA device, or the preset's
    device; None on a host without CUDA where neither is given."""
    env = os.environ if environ is None else environ
    given = env.get(run_env.DEVICE_MEMORY_GB)
    if given:
        try:
            gb = float(given)
        except ValueError:
            gb = -1.0
        if not gb > 0:
            raise ValueError(f"{run_env.DEVICE_MEMORY_GB} must be a number of GB > 0, got {given!r}")
        return Device(gb * GB, run_env.DEVICE_MEMORY_GB)
    import torch

    if torch.cuda.is_available():
        return Device(float(torch.cuda.get_device_properties(0).total_memory), "torch.cuda.get_device_properties(0)")
    return preset


def preset_device(section: Mapping[str, Any], where: str) -> Device | None:
    """The `device:` section of a preset ({name, memory_gb}) as a Device; None without one."""
    if not section:
        return None
    return Device(float(section["memory_gb"]) * GB, f"{where} device: {section['name']}")


# ----------------------------------------------------------------------------- the models


@dataclass(frozen=True)
class _Models:
    """The shapes of the run's models (None: not in the run, or uncounted)."""

    actor: Shape | None
    critic: Shape | None
    reward: Shape | None
    uncounted: tuple[str, ...]
    sources: tuple[str, ...]


def _models(v: dict[str, Any]) -> _Models:
    """Each model's shape, found as `model_shapes.find` finds it; the critic as OpenRLHF picks it
    (given, else the reward model, else the actor)."""
    uncounted = []
    sources = {}

    def shape(flag: str, name: str) -> Shape | None:
        found, where = model_shapes.find(name)
        if found is None:
            uncounted.append(f"--{flag} {name}: {where}; point the flag at a local checkpoint (its config.json is "
                             "read, no weights) to count it")
        else:
            sources[name] = where
        return found

    actor = shape("actor.model_name_or_path", v["actor.model_name_or_path"])
    reward_names = []
    if not v["reward.remote_url"]:
        reward_names = [p.strip() for p in (v["reward.model_name_or_path"] or "").split(",") if p.strip()]
    if len(reward_names) > 1:
        uncounted.append(f"--reward.model_name_or_path {v['reward.model_name_or_path']}: several reward models; "
                         "this check counts one")
    reward = shape("reward.model_name_or_path", reward_names[0]) if len(reward_names) == 1 else None
    critic = None
    if v["algo.advantage.estimator"] == "gae":
        flag, name = "critic.model_name_or_path", v["critic.model_name_or_path"]
        if not name and reward_names:
            flag, name = "reward.model_name_or_path", reward_names[0]
        elif not name:
            flag, name = "actor.model_name_or_path", v["actor.model_name_or_path"]
        critic = shape(flag, name)
    for flag in ("ds.tensor_parallel_size", "ds.ring_attn_size"):
        if v[flag] > 1:
            uncounted.append(f"--{flag} {v[flag]}: this check does not count DeepSpeed's tensor parallelism or ring "
                             "attention")
    notes = tuple(f"{name}: {where}" for name, where in sources.items())
    return _Models(actor, critic, reward, tuple(dict.fromkeys(uncounted)), notes)


def streams_reward(v: dict[str, Any], cfg: OppoConfig | None) -> bool:
    return cfg is not None and not v["reward.remote_url"] and cfg.streaming.enable and cfg.streaming.reward


def streams_reference(cfg: OppoConfig | None) -> bool:
    return cfg is not None and "reference" in cfg.streaming.scorers()


def _gpus(v: dict[str, Any], group: str) -> int:
    return max(1, v[f"{group}.num_nodes"] * v[f"{group}.num_gpus_per_node"])


# ------------------------------------------------------------------------------- the items


class _Items:
    """Builds each model's items on a kind of GPU, for one run's flags and phases."""

    def __init__(self, v: dict[str, Any], cfg: OppoConfig | None, models: _Models, capacity: float):
        self.v = v
        self.cfg = cfg
        self.models = models
        self.capacity = capacity
        self.sleep = bool(v["ds.enable_sleep"])
        self.dtype_bytes = DTYPE_BYTES.get(v["ds.param_dtype"], 4)
        self.max_len = v["data.max_len"]
        self.checkpointing = bool(v["actor.gradient_checkpointing_enable"])  # OpenRLHF: the critic's too
        # the phase of each trained model's update: with --ds.enable_sleep one after the other
        if self.sleep and models.critic is not None:
            self.update_phase = {"critic": TRAINING_CRITIC, "actor": TRAINING_ACTOR}
        else:
            self.update_phase = {"critic": TRAINING, "actor": TRAINING}

    @property
    def phases(self) -> tuple[str, ...]:
        return (GENERATING, EXPERIENCE, *dict.fromkeys(self.update_phase.values()))

    def _forward(self, name: str, shape: Shape, lm: bool, live: bool) -> Item:
        """A forward of --rollout.micro_batch_size x --data.max_len tokens in make_experience."""
        mb = self.v["rollout.micro_batch_size"]
        tokens = mb * self.max_len
        size = footprint.layer_forward_bytes(tokens, shape.hidden, shape.intermediate)
        if lm:
            size += footprint.logits_forward_bytes(tokens, shape.vocab)
        if live:
            size += footprint.WEIGHT_BYTES_PER_PARAM * footprint.LIVE_PARAMETERS
        return Item(f"{name} forward ({mb} x {self.max_len})", size, frozenset({EXPERIENCE}), True)

    def trained(self, name: str, shape: Shape) -> list[Item]:
        """The actor or critic under DeepSpeed over its group's n GPUs. Per GPU, by --ds.zero_stage:
        bf16 weights 2 B a parameter (1/n at stage 3), bf16 gradients 2 B (1/n from stage 2), fp32
        master weights and Adam's moments 12 B (1/n from stage 1; on the host with --ds.adam_offload)."""
        lm = name == "actor"
        n = _gpus(self.v, name)
        stage = self.v["ds.zero_stage"]
        params = shape.params(lm_head=lm)
        phase = frozenset({self.update_phase[name]})
        weights = 2 * params / (n if stage >= 3 else 1)
        grads = 2 * params / (n if stage >= 2 else 1)
        adam = 0.0 if self.v["ds.adam_offload"] else 12 * params / (n if stage >= 1 else 1)
        where = f"ZeRO-{stage}, 1/{n}"
        mb = self.v["train.micro_batch_size"]
        tokens = mb * self.max_len
        act = footprint.training_activation_bytes(tokens, shape.layers, shape.hidden, shape.intermediate, shape.vocab,
                                                  self.checkpointing, lm_head=lm)
        kept = "ckpt" if self.checkpointing else "no ckpt"
        adam_what = "grads (Adam on the host)" if self.v["ds.adam_offload"] else "grads + Adam"
        items = [Item(f"{name} weights ({where})", weights),
                 Item(f"{name} {adam_what} ({where})", grads + adam, phase if self.sleep else None),
                 Item(f"{name} activations ({mb} x {self.max_len}, {kept})", act, phase)]
        if stage >= 3:
            items.append(Item(f"{name} live parameters", footprint.WEIGHT_BYTES_PER_PARAM * footprint.LIVE_PARAMETERS,
                              phase))
        return [*items, self._forward(name, shape, lm=lm, live=stage >= 3)]

    def megatron(self, shape: Shape) -> list[Item]:
        """The actor under Megatron-Core: TP x PP x DP over its group's GPUs, distributed optimizer
        (fp32 gradients, fp32 main weights and moments sharded over DP); the heaviest stage holds
        layers / PP and the embedding (or LM head)."""
        meg = self.cfg.megatron
        tp, pp = meg.tensor_parallel_size, meg.pipeline_parallel_size
        dp = max(1, _gpus(self.v, "actor") // (tp * pp))
        stage = shape.layers // pp * shape.layer_params() + shape.vocab * shape.hidden
        if pp == 1 and not shape.tied:
            stage += shape.vocab * shape.hidden
        per_rank = stage / tp
        mb = self.v["train.micro_batch_size"]
        layer = footprint.megatron_layer_activation_bytes(mb, self.max_len, shape.hidden, shape.heads,
                                                          shape.intermediate, tp)
        in_flight = pp  # 1F1B: the first stage holds PP micro-batches before its first backward
        rmb = self.v["rollout.micro_batch_size"]
        forward = (footprint.megatron_layer_activation_bytes(rmb, self.max_len, shape.hidden, shape.heads,
                                                             shape.intermediate, tp)
                   + footprint.logits_forward_bytes(rmb * self.max_len, shape.vocab) / tp)
        return [Item(f"actor states (Megatron TP {tp} PP {pp} DP {dp})", (2 + 4 + 12 / dp) * per_rank),
                Item(f"actor activations (1F1B {in_flight} x {mb} x {self.max_len})",
                     in_flight * shape.layers // pp * layer, frozenset({self.update_phase["actor"]})),
                Item(f"actor forward ({rmb} x {self.max_len})", forward, frozenset({EXPERIENCE}), True)]

    def frozen(self, name: str, shape: Shape, group: str, lm: bool) -> list[Item]:
        """The reference or OpenRLHF's reward model: ZeRO-3 inference over its group's GPUs (whole
        below --ds.zero_stage 3; on the host with --ref.offload / --reward.offload)."""
        n = _gpus(self.v, group)
        stage3 = self.v["ds.zero_stage"] >= 3
        weights = 2 * shape.params(lm_head=lm) / (n if stage3 else 1)
        where = f"ZeRO-3, 1/{n}" if stage3 else "whole"
        if self.v[f"{group}.offload"]:
            weights = 0.0
            where = f"--{group}.offload: on the host"
        return [Item(f"{name} ({where})", weights), self._forward(name, shape, lm=lm, live=stage3)]

    def streamed(self, name: str, shape: Shape, here: int, lm: bool, beside: float) -> list[Item]:
        """`here` streaming actors on one GPU: the whole model each, its KV budget (given, or with none
        0.5 of what is free when it loads: alone on its GPU, what the weights and `beside` leave), the
        batched forward's KV copies and one layer's working set (a reference actor's LM head: 1,024
        rows of logits at a time)."""
        weights = self.dtype_bytes * shape.params(lm_head=lm)
        per_token = shape.kv_bytes_per_token(self.dtype_bytes)
        budget = self.cfg.streaming.kv_budget_tokens
        if budget:
            kv = budget * per_token
            kv_what = f"{budget:,} tokens"
        else:
            kv = 0.5 * max(0.0, self.capacity - here * weights - beside)
            kv_what = "automatic"
        tokens = footprint.STREAM_MAX_BATCH_TOKENS
        forward = 2 * tokens * per_token + footprint.layer_forward_bytes(tokens, shape.hidden, shape.intermediate)
        if lm:
            forward += footprint.logits_forward_bytes(1024, shape.vocab)
        times = f" x {here}" if here > 1 else ""
        return [Item(f"streaming {name} weights{times}", here * weights),
                Item(f"streaming {name} KV{times} ({kv_what})", here * kv),
                Item(f"streaming {name} forward{times}", here * forward)]

    def sync_buffer(self, shape: Shape) -> list[Item]:
        """The background weight sync's copy of the actor's weights (`--oppo.staleness.background_sync`)."""
        if self.cfg is None or not self.cfg.staleness.background_sync:
            return []
        actor = shape.params()
        n = _gpus(self.v, "actor")
        buffer = self.cfg.staleness.background_sync_buffer
        if buffer == "shards":
            return [Item(f"sync partitions (shards, 1/{n})", self.dtype_bytes * actor / n)]
        if buffer == "host":
            largest = footprint.largest_param(shape.hidden, shape.intermediate, shape.vocab)
            return [Item("sync staging (host: one parameter)", self.dtype_bytes * largest)]
        return [Item("sync buffer (device: the actor)", self.dtype_bytes * actor)]


def _reserve(processes: int) -> Item:
    extra = max(0, processes - 1)
    return Item(f"reserve (+{extra} context{'s' if extra != 1 else ''})",
                footprint.RESERVE_BYTES + extra * footprint.CUDA_CONTEXT_BYTES)


def _vllm(v: dict[str, Any], capacity: float) -> Item:
    util = v["vllm.gpu_memory_utilization"]
    phases = frozenset({GENERATING}) if v["vllm.enable_sleep"] else None
    return Item(f"vLLM (gpu_memory_utilization {util:g})", util * capacity, phases)


# ------------------------------------------------------------------------------ the layout


def count(v: dict[str, Any], cfg: OppoConfig | None, device: Device) -> Count:
    """Every GPU kind of the run as OpenRLHF 0.11.2 places it, and what each holds per phase."""
    models = _models(v)
    items = _Items(v, cfg, models, device.memory_bytes)
    engines = v["vllm.num_engines"] or 0
    tp = v["vllm.tensor_parallel_size"]
    colocate_all = bool(v["train.colocate_all"])
    vllm_apart = engines > 0 and not (colocate_all and not v["train.async_enable"])
    with_ref = v["algo.kl.init_coef"] > 0
    critic = models.critic is not None or v["algo.advantage.estimator"] == "gae"
    reward = not v["reward.remote_url"]
    kinds: list[GpuKind] = []
    if vllm_apart:
        beyond = Item("beyond vLLM's share", footprint.VLLM_BEYOND_SHARE_BYTES)
        kinds.append(GpuKind(f"vLLM ({engines} engine{'s' if engines > 1 else ''} x TP {tp})", engines * tp,
                             (_vllm(v, device.memory_bytes), beyond)))
    # the groups on each kind of training GPU, as OpenRLHF places them
    if colocate_all:
        groups = [["actor", "ref", "critic", "reward"]]
    else:
        groups = [["actor", "ref"] if v["train.colocate_actor_ref"] else ["actor"]]
        if with_ref and not v["train.colocate_actor_ref"]:
            groups.append(["ref"])
        if critic and v["train.colocate_critic_reward"]:
            groups.append(["critic", "reward"])
        else:
            groups += [["critic"], ["reward"]]
    in_run = {"actor": True, "ref": with_ref, "critic": critic, "reward": reward}
    for on in groups:
        present = [g for g in on if in_run[g]]
        if not present:
            continue
        kind = _training_kind(v, cfg, models, items, present, with_vllm=colocate_all and not vllm_apart and engines > 0)
        if kind is not None:
            kinds.append(kind)
    notes = list(models.sources)
    if engines:
        notes += _kv_room(v, cfg, models, device.memory_bytes)
    if models.actor is not None and models.actor.max_positions and v["data.max_len"] > models.actor.max_positions:
        notes.append(f"--data.max_len {v['data.max_len']} is past the actor's max_position_embeddings "
                     f"{models.actor.max_positions}")
    return Count(device=device, phases=items.phases, kinds=tuple(kinds), uncounted=models.uncounted,
                 notes=tuple(notes))


def _training_kind(v: dict[str, Any], cfg: OppoConfig | None, models: _Models, items: _Items, groups: list[str],
                   with_vllm: bool) -> GpuKind | None:
    """The GPUs of the first group in `groups` with every group in `groups` on them (and vLLM with
    `with_vllm`)."""
    gpus = _gpus(v, groups[0])
    out: list[Item] = [_vllm(v, items.capacity)] if with_vllm else []
    names = []
    processes = 0
    streamed: list[tuple[str, Shape, int, bool]] = []  # placed last: an automatic budget sees the others
    for group in groups:
        here = math.ceil(_gpus(v, group) / gpus)  # this group's actors on each of these GPUs
        if group == "actor" and models.actor is not None:
            if cfg is not None and cfg.megatron.enable:
                out += items.megatron(models.actor)
                names.append("actor (Megatron)")
            else:
                out += items.trained("actor", models.actor)
                names.append("actor")
            out += items.sync_buffer(models.actor)
            processes += 1
        elif group == "ref" and models.actor is not None:
            if streams_reference(cfg):
                streamed.append(("reference", models.actor, here, True))
            else:
                out += items.frozen("reference", models.actor, "ref", lm=True)
                names.append("reference")
                processes += 1
        elif group == "critic" and models.critic is not None:
            out += items.trained("critic", models.critic)
            names.append("critic")
            processes += 1
        elif group == "reward" and models.reward is not None:
            if streams_reward(v, cfg):
                streamed.append(("reward", models.reward, here, False))
            else:
                out += items.frozen("reward model", models.reward, "reward", lm=False)
                names.append("reward model")
                processes += 1
    processes += sum(here for _, _, here, _ in streamed)
    reserve = _reserve(processes)
    for name, shape, here, lm in streamed:
        beside = sum(i.bytes for i in out if i.phases is None and not i.in_turn) + reserve.bytes
        out += items.streamed(name, shape, here, lm, beside)
        names.append(f"streaming {name} actor" + (f" x {here}" if here > 1 else ""))
    if not out:
        return None
    if with_vllm:
        engines = v["vllm.num_engines"]
        names.insert(0, f"vLLM ({engines} engine{'s' if engines > 1 else ''} x TP {v['vllm.tensor_parallel_size']})")
    return GpuKind(", ".join(names), gpus, (*out, reserve))


def _kv_room(v: dict[str, Any], cfg: OppoConfig | None, models: _Models, capacity: float) -> list[str]:
    """What vLLM's share leaves its KV cache against what one step's sequences take."""
    if models.actor is None:
        return []
    engines = v["vllm.num_engines"]
    tp = v["vllm.tensor_parallel_size"]
    share = v["vllm.gpu_memory_utilization"] * capacity
    weights = 2 * models.actor.params() / tp
    kv = share - weights - VLLM_WORKING_BYTES
    per_token = models.actor.kv_bytes_per_token(2) / tp
    groups = v["rollout.batch_size"] + (cfg.delta.max if cfg is not None and cfg.delta.enable else 0)
    sequences = math.ceil(groups * v["rollout.n_samples_per_prompt"] / engines)
    line = (f"vLLM's KV room: {share / GB:.1f} GB share - {weights / GB:.1f} GB weights - "
            f"{VLLM_WORKING_BYTES / GB:.0f} GB working = {max(kv, 0) / GB:.1f} GB, "
            f"{max(kv, 0) / per_token:,.0f} tokens an engine; a step's {sequences} sequences an engine x "
            f"--data.max_len {v['data.max_len']} = {sequences * v['data.max_len']:,} tokens")
    return [line]


# ------------------------------------------------------------------------------- the check


def check(v: dict[str, Any], cfg: OppoConfig | None, environ: Mapping[str, str] | None = None,
          preset: Device | None = None, strict: bool = False) -> Count | None:
    """Print the table; ValueError naming the flags when a layout cannot fit its GPUs (or, with
    `strict`, when a model could not be counted). None where there is no device memory to count."""
    device = device_memory(environ, preset)
    # where the launcher printed this check already (`openrlhf-oppo train`), its child refuses only
    quiet = (os.environ if environ is None else environ).get(run_env.CHECKED) == "1"
    note = _note if not quiet else (lambda message: None)
    if device is None:
        note("no CUDA device on this host and no device memory given: nothing counted (a CPU run; on a GPU "
             f"cluster whose launching host has no GPU, set {run_env.DEVICE_MEMORY_GB})")
        return None
    _check_budgets(v, cfg)
    result = count(v, cfg, device)
    table = result.table()
    note(table[0])
    for line in table[1:] if not quiet else ():
        print(f"  {line}", flush=True)
    if result.kinds and result.tightest()[2] > device.memory_bytes:  # what is counted already overflows
        raise ValueError(_refusal(v, cfg, result))
    if not result.counted:
        message = (f"the layout is uncounted: {'; '.join(result.uncounted)} (the table above leaves "
                   f"{'it' if len(result.uncounted) == 1 else 'them'} out)")
        if strict:
            raise ValueError(message)
        note(f"warning: {message}")
    elif result.margin() < MIN_MARGIN:
        note(f"warning: under {MIN_MARGIN:.0%} of the device left in the tightest phase; lower "
              "--vllm.gpu_memory_utilization, the micro-batch sizes or --oppo.streaming.kv_budget_tokens")
    return result


def _check_budgets(v: dict[str, Any], cfg: OppoConfig | None) -> None:
    """A streaming actor that shares its GPU needs an explicit KV budget (see the module doc)."""
    if cfg is None or cfg.streaming.kv_budget_tokens:
        return
    beside = []
    if streams_reward(v, cfg) and v["train.colocate_all"]:
        beside.append("a streaming reward actor under --train.colocate_all")
    elif streams_reward(v, cfg) and v["train.colocate_critic_reward"] and v["algo.advantage.estimator"] == "gae":
        beside.append("a streaming reward actor beside the critic (--train.colocate_critic_reward)")
    if streams_reference(cfg) and v["algo.kl.init_coef"] > 0:
        if v["train.colocate_all"]:
            beside.append("a streaming reference actor under --train.colocate_all")
        elif v["train.colocate_actor_ref"]:
            beside.append("a streaming reference actor beside the actor (--train.colocate_actor_ref)")
    if beside:
        raise ValueError(
            f"{' and '.join(beside)} needs an explicit --oppo.streaming.kv_budget_tokens: the automatic one takes "
            "half of the GPU's free memory when the actor loads, while the models beside it may still be loading "
            "or allocating (vLLM, the actor's ZeRO-3 initialisation, the critic) and before they peak. Give a "
            "budget (this check then counts it)")


def _refusal(v: dict[str, Any], cfg: OppoConfig | None, result: Count) -> str:
    cap = result.device.memory_bytes
    kind, phase, total = result.tightest()
    present = [i for i in kind.items if kind.present(i, phase)]
    parts = ", ".join(f"{i.what} {i.bytes / GB:.1f}" for i in present if i.bytes > 0)
    fits = []
    vllm = next((i.bytes for i in present if i.what.startswith("vLLM (")), None)
    if vllm is not None:  # vLLM is on the device in the phase that overflows
        max_util = math.floor((cap - total + vllm) / cap * 100) / 100
        if max_util > 0:
            fits.append(f"--vllm.gpu_memory_utilization {max_util:.2f} or lower (vLLM's weights and KV cache must "
                        "fit in it)")
    kv = sum(i.bytes for i in present if i.what.startswith("streaming ") and " tokens)" in i.what)
    if kv > 0 and total - kv <= cap:
        per_token = kv / cfg.streaming.kv_budget_tokens
        fits.append(f"--oppo.streaming.kv_budget_tokens {int((cap - total + kv) // per_token)} or lower")
    if any(i.in_turn for i in present) or any(" activations " in i.what for i in present):
        fits.append("smaller --rollout.micro_batch_size / --train.micro_batch_size (the forwards' and updates' "
                    "activations)")
    colocated_vllm = v["train.colocate_all"] and not v["train.async_enable"]
    if colocated_vllm and not (v["vllm.enable_sleep"] and v["ds.enable_sleep"]):
        fits.append("--vllm.enable_sleep --ds.enable_sleep (OpenRLHF's hybrid engine: vLLM sleeps while the models "
                    "train, the optimizer states leave the GPU while vLLM generates)")
    fits.append("more GPUs for the group (--actor/--critic/--ref/--reward .num_gpus_per_node, vLLM's engines x TP)")
    n = result.kinds.index(kind) + 1
    return (f"memory: GPU kind [{n}] ({kind.name}) would need {total / GB:.1f} GB {phase}, over its "
            f"{cap / GB:.1f} GB ({result.device.source}): {parts}. What would fit: " + "; or ".join(fits))
