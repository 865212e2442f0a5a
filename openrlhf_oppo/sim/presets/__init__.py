"""Simulator presets: frozen dataclasses read from the YAML files beside this module.

A preset (`openrlhf_oppo/sim/presets/<name>.yaml`) names a hardware entry
(`hardware.yaml`), model shapes (`models.yaml`), a length distribution, a GPU split,
efficiencies, the workload and OPPO's own settings (`openrlhf_oppo.config`). The files
ship inside the package and are found with `importlib.resources`, so an installed
wheel simulates as a checkout does. `--set key=value` edits the merged mapping before
it is built (by the codec of `openrlhf_oppo.settings`), so a bad key or value fails
like a bad flag: a `ValueError` naming the key and what is allowed. PyYAML is
imported lazily.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from openrlhf_oppo import config as oppo_config
from openrlhf_oppo import settings
from openrlhf_oppo.config import OppoConfig
from openrlhf_oppo.footprint import decoder_params, kv_bytes
from openrlhf_oppo.settings import setting as _f
from openrlhf_oppo.sim.presets.split import Split

# A package on the file system (a checkout, or an installed wheel) gives a real directory.
PRESET_DIR = Path(str(resources.files(__name__)))
CATALOG_KEYS = {"hardware": "hardware.yaml", "actor": "models.yaml", "reward": "models.yaml", "critic": "models.yaml"}
OPPO_SECTIONS = ("delta", "chunk", "staleness", "streaming", "train")  # `--set delta.max=8` means `oppo.delta.max`
# Preset values come typed from YAML; a message names the key as `--set` spells it.
CODEC = settings.Codec(
    leaf="--set {key}:",
    section="--set {path}:",
    unknown="--set {where}{key}: unknown key; allowed: {qualified}",
    text=settings.YAML,
)
_require = CODEC.require


@dataclass(frozen=True)
class Hardware:
    """One accelerator kind (dense bf16, no sparsity)."""

    name: str = _f("", "Catalog name.")
    peak_bf16_flops: float = _f(0.0, "Peak dense bf16 FLOP/s of one device.")
    hbm_bytes: float = _f(0.0, "Device memory in bytes.")
    hbm_bytes_per_s: float = _f(0.0, "Device memory bandwidth in bytes/s.")
    nvlink_bytes_per_s: float = _f(0.0, "Intra-node device-to-device bandwidth (one direction) in bytes/s.")
    network_bytes_per_s: float = _f(0.0, "Inter-node bandwidth per node in bytes/s.")
    pcie_bytes_per_s: float = _f(32.0e9, "Host-device bandwidth of one device (one direction) in bytes/s: the "
                                         "hybrid engine's sleep moves (`split.sleep`) and parameter and optimizer "
                                         "offload (default: PCIe Gen4 x16).")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (Qwen2.5 family: GQA, SwiGLU MLP)."""

    name: str = _f("", "Catalog name.")
    layers: int = _f(0, "Transformer blocks.")
    hidden: int = _f(0, "Hidden size d.")
    heads: int = _f(0, "Attention heads.")
    kv_heads: int = _f(0, "Key/value heads (GQA).")
    intermediate: int = _f(0, "MLP intermediate size.")
    vocab: int = _f(0, "Vocabulary size.")
    tied_embeddings: bool = _f(False, "Input and output embeddings share weights.")

    @property
    def params(self) -> int:
        return decoder_params(self.layers, self.hidden, self.heads, self.kv_heads, self.intermediate, self.vocab,
                              lm_head=not self.tied_embeddings)

    @property
    def weight_bytes(self) -> int:
        return 2 * self.params  # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes(self.layers, self.kv_heads, self.hidden // self.heads, 2)  # bf16


@dataclass(frozen=True)
class Lengths:
    """Response lengths in tokens (the prompt length is a constant)."""

    kind: str = _f("lognormal", "'lognormal' (fitted to mean/std, clipped at cap), 'quantiles', 'empirical' "
                                "(drawn from the list) or 'replay' (the list in order: response j of prompt p "
                                "is entry p x n + j, wrapping; a simulated run replays a measured one).")
    mean_tokens: float = _f(300.0, "lognormal: mean of the unclipped distribution (tokens).")
    std_tokens: float = _f(300.0, "lognormal: standard deviation of the unclipped distribution (tokens).")
    cap_tokens: int = _f(1024, "Maximum new tokens; longer responses stop here (finish reason 'length').")
    min_tokens: int = _f(1, "Shortest response (tokens).")
    quantiles: tuple[tuple[float, float], ...] = _f((), "quantiles: (probability, tokens) points of the CDF, "
                                                        "interpolated log-linearly.")
    path: str = _f("", "empirical, replay: a run's rollouts.jsonl, or a JSON list of response lengths "
                       "(relative paths: to openrlhf_oppo/sim/presets/).")
    prompt_tokens: int = _f(128, "Prompt length (tokens); rollouts.jsonl lengths subtract it.")


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak and fixed costs; sources in the preset's comments."""

    decode_bandwidth: float = _f(0.7, "Fraction of HBM bandwidth a decode step achieves.")
    decode_mfu: float = _f(0.5, "FLOP utilisation of a decode step's compute floor.")
    prefill_mfu: float = _f(0.5, "FLOP utilisation of a prefill forward.")
    attention_mfu: float = _f(0.0, "FLOP utilisation of a streaming scorer's attention in a prefill (4 x layers "
                                   "x hidden a query-key pair; 0: prefill_mfu).")
    forward_mfu: float = _f(0.4, "FLOP utilisation of the training devices' forwards (make_experience).")
    train_mfu: float = _f(0.35, "FLOP utilisation of forward+backward (ZeRO-3).")
    link_efficiency: float = _f(0.7, "Fraction of link bandwidth a weight broadcast achieves.")
    decode_step_overhead_s: float = _f(0.002, "Per engine iteration: scheduling, sampling, launch.")
    forward_overhead_s: float = _f(0.01, "Per prefill call on a reward server: launch and gather.")
    chunk_overhead_s: float = _f(0.0005, "Per chunk in a prefill call: KV-cache bookkeeping, transfer.")
    phase_overhead_s: float = _f(0.5, "Per make_experience / train / sync phase: Ray round trips, "
                                      "ZeRO-3 gathers.")
    generate_overhead_s: float = _f(0.2, "Per generate call: request submission and result gathering.")
    experience_overhead_s: float = _f(0.0, "Per make_experience beyond phase_overhead_s: dispatching to the "
                                           "actor, critic, reference and reward groups (`python -m oppo_lab "
                                           "calibrate`).")
    weight_sync_base_s: float = _f(0.2, "Fixed cost of a weight sync (pause, NCCL set-up).")
    advantage_loop_s_per_token: float = _f(0.0, "Per padded response position of each make_experience micro-batch: "
                                                "OpenRLHF 0.11.2's Python loop for GAE advantages (or REINFORCE "
                                                "returns), in the trainer's process after the forwards (`python -m "
                                                "oppo_lab advantages`; 0: not modelled).")
    advantage_vectorized_s_per_token: float = _f(0.0, "The same for OPPO's whole-tensor version "
                                                      "(`train.vectorized_advantages`).")
    decode_slowdown_shared: float = _f(1.0, "Decode step time factor while another role computes on the "
                                            "same host (1: none; a CPU host's shared cores: above 1).")
    train_slowdown_shared: float = _f(1.0, "Train/forward time factor while engines decode on the same host.")
    decode_slowdown_scoring: float = _f(0.0, "Streaming scorers beside the engines (`split.score_gpus` 0): 0, an "
                                             "engine stops while its scorer prefills (one device, they take turns); "
                                             "above 0, a CPU host's shared cores: it decodes on, each iteration this "
                                             "many times longer (`python -m oppo_lab calibrate`).")
    sync_overhead_s: float = _f(-1.0, "The fixed cost of a weight sync to the trainer, beyond `weight_sync_base_s` "
                                      "and the transfers: the Ray call on every actor rank and its walk over every "
                                      "parameter (a ZeRO-3 gather each). Every sync's trainer pays it, in the "
                                      "foreground or before a background sync lets it go on (`costs.sync_fixed_s`). "
                                      "-1: phase_overhead_s; a measured preset: 0, its weight_sync_s is the whole "
                                      "sync.")


@dataclass(frozen=True)
class Workload:
    """The PPO run being simulated."""

    batch_groups: int = _f(112, "B: prompt groups trained per step (rollout batch size).")
    samples_per_group: int = _f(1, "n: samples per prompt.")
    steps: int = _f(14, "Steps simulated per run (warm-up included).")
    dataset_steps: bool = _f(False, "The dataset holds `steps` x B prompts and ends with the run (as a short "
                                    "real run's): OpenRLHF's async generator stops, nothing decodes beside the "
                                    "last batch. False: the steps are a window of a longer run.")
    warmup_steps: int = _f(3, "Steps left out of step latency and tokens/s (the pipelines fill).")
    seeds: int = _f(3, "Runs per schedule, each with its own seed; the table gives median [min-max].")
    seed: int = _f(0, "First seed.")
    max_num_seqs: int = _f(256, "Sequences an engine decodes at once (vLLM's max_num_seqs).")
    kv_cache_fraction: float = _f(0.9, "Device memory for weights + KV cache (vLLM's gpu_memory_utilization).")
    critic: bool = _f(True, "PPO with a critic (GAE): critic forward and training (shape: the `critic` model).")
    reference: bool = _f(True, "A reference-model forward for the KL penalty.")
    score_chunks_per_call: int = _f(0, "Chunks a reward server prefills in one forward (0: every chunk queued "
                                       "for it, from any sequence; 1: one chunk a call, an unbatched scorer).")
    micro_batch_size: int = _f(4, "Samples per training micro-batch (padding is per micro-batch without packing).")
    packing: bool = _f(True, "Samples packed in training (no padding).")
    reward_tau_steps: float = _f(20.0, "Synthetic reward curve 1 - exp(-step/tau) (drives the adaptive Δ).")
    reward_noise: float = _f(0.02, "Standard deviation of the per-step mean reward's noise.")
    reward_model: bool = _f(True, "A reward model scores each sample (False: a rule reward, no reward forward).")
    offload_params: bool = _f(False, "Training weights live on the host between phases (verl's FSDP param_offload): "
                                     "each phase that uses a model loads and offloads its weights over PCIe.")
    offload_optimizer: bool = _f(False, "Optimizer states live on the host between updates (verl's FSDP "
                                        "optimizer_offload): each update loads and offloads them over PCIe.")
    gradient_checkpointing: bool = _f(False, "Activations are recomputed in the backward pass "
                                             "(8 N instead of 6 N flops per trained token).")


@dataclass(frozen=True)
class Costs:
    """Measured costs that replace the roofline's (0 or less: derive from hardware and model)."""

    decode_step_s: float = _f(0.0, "Engine iteration time at batch 1, short context.")
    decode_per_seq_s: float = _f(0.0, "Added per sequence in the batch (compute bound).")
    decode_per_context_token_s: float = _f(0.0, "Added per token of context held by the batch (KV reads).")
    prefill_call_s: float = _f(0.0, "Fixed cost of a reward-model call.")
    prefill_per_token_s: float = _f(0.0, "Reward-model prefill per token.")
    forward_per_token_s: float = _f(0.0, "One make_experience forward (reference, critic or old logprobs) per token.")
    train_per_token_s: float = _f(0.0, "Actor + critic training per token.")
    weight_sync_s: float = _f(0.0, "One weight sync.")

    @property
    def measured_decode(self) -> bool:
        """Whether the engine's decode costs are measured (a fit may put either term at 0)."""
        return self.decode_step_s > 0 or self.decode_per_seq_s > 0


@dataclass(frozen=True)
class PaperTargets:
    """Per-step speedups over sync that the paper reports (time-to-reward), for the calibration table."""

    intra: float = _f(0.0, "Intra-step overlap only (oppo-intra).")
    inter: float = _f(0.0, "Inter-step overlap only (oppo-inter).")
    both: float = _f(0.0, "Both (oppo).")
    source: str = _f("", "Where the figures come from.")


@dataclass(frozen=True)
class PublishedRun:
    """A published run's time per step and stage split, for `python -m oppo_lab published` (0: not published)."""

    step_s: float = _f(0.0, "Time per step.")
    generation_s: float = _f(0.0, "Generation (verl's timing_s/gen: includes the weight resharding).")
    old_logprobs_s: float = _f(0.0, "Old-logprob forward.")
    reference_s: float = _f(0.0, "Reference forward.")
    values_s: float = _f(0.0, "Critic forward.")
    reward_s: float = _f(0.0, "Scoring (a reward model's forward, or a rule reward on the host).")
    update_s: float = _f(0.0, "Actor (and critic) update.")
    weight_sync_s: float = _f(0.0, "Weight sync to the engines, where reported apart.")
    experience_s: float = _f(0.0, "Generation and make_experience's forwards as one figure "
                                  "(OpenRLHF's benchmark 'Generation' latency).")
    source: str = _f("", "Where the figures come from.")


@dataclass(frozen=True)
class Projections:
    """Designs the simulator projects that no run can use yet (`--set projections.<name>=true`):
    what they would buy, before they are built. Each applies to OPPO's schedules."""

    reference_actors: bool = _f(False, "Stream the reference into streaming reference actors that hold the whole "
                                       "frozen reference model, on devices of their own or beside the engines (as "
                                       "the streaming reward actors hold the reward model), instead of the training "
                                       "devices' ZeRO-3 copy; applies where a schedule streams the reference "
                                       "(streaming.reference).")
    experience_ahead: bool = _f(False, "Forward each group through make_experience's models (old log-probs, values, "
                                       "reference) as soon as it is certain to be in the step's batch, whole, on the "
                                       "weights the step trains from, while the training devices wait for the "
                                       "batch; make_experience then forwards only what is left.")


@dataclass(frozen=True)
class SimConfig:
    """A whole simulated setup."""

    name: str = _f("", "Preset name.")
    hardware: Hardware | None = _f(None, "Accelerator (None: `costs` gives every cost).")
    actor: ModelShape | None = _f(None, "Actor (and reference) shape.")
    reward: ModelShape | None = _f(None, "Reward model shape.")
    critic: ModelShape | None = _f(None, "Critic shape (None: the reward model's).")
    lengths: Lengths = _f(Lengths(), "Response length distribution.")
    split: Split = _f(Split(), "Device split.")
    efficiency: Efficiency = _f(Efficiency(), "Efficiencies and fixed costs.")
    workload: Workload = _f(Workload(), "The PPO run.")
    costs: Costs = _f(Costs(), "Measured costs (override the roofline's).")
    oppo: OppoConfig = _f(OppoConfig(), "OPPO's settings (openrlhf_oppo.config).")
    oppo_set: tuple[str, ...] = _f((), "OPPO settings given with --set (keys under oppo): they win over "
                                       "each schedule's own (`schedule_oppo`).")
    paper: PaperTargets = _f(PaperTargets(), "The paper's ablation figures (calibration presets).")
    published: PublishedRun = _f(PublishedRun(), "A published run's figures (`python -m oppo_lab published`).")
    projections: Projections = _f(Projections(), "Designs not built yet, simulated (`Projections`).")


# ---------------------------------------------------------------------------- loading


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml") if p.stem not in ("hardware", "models"))


def _yaml(path: Path) -> dict:
    return settings.read_yaml(str(path))


def load_preset(name: str, sets: list[str] | tuple[str, ...] = ()) -> SimConfig:
    """The preset `name` (a name under openrlhf_oppo/sim/presets/ or a YAML path) with `--set key=value` edits."""
    path = Path(name)
    if not (path.suffix in (".yaml", ".yml") and path.exists()):
        path = PRESET_DIR / f"{name}.yaml"
        if not path.exists():
            raise ValueError(f"--preset: unknown preset '{name}'; allowed: {', '.join(preset_names())} "
                             "(or a path to a YAML file)")
    raw = _yaml(path)
    raw.setdefault("name", path.stem)
    lengths = raw.get("lengths")
    if isinstance(lengths, dict) and lengths.get("path") and not Path(lengths["path"]).is_absolute():
        lengths["path"] = str(path.parent / lengths["path"])  # a preset's own files sit beside it
    given: dict[str, None] = {}  # OPPO keys, in order
    for item in sets:
        key, value = parse_set(item)
        raw = apply_set(raw, key, value)
        if canonical_key(key).startswith("oppo."):
            given[canonical_key(key)[len("oppo."):]] = None
    return dataclasses.replace(build(raw), oppo_set=tuple(given))


def schedule_oppo(cfg: SimConfig, schedule: str) -> OppoConfig:
    """The OPPO settings `schedule` runs with: the preset's `oppo` section, the schedule's own settings
    over it (`integrations.launch.schedules`), and the keys given with --set over both, so that
    `--set staleness.max_policy_lag=3` reaches `oppo-async-bg`, whose own lag is 2."""
    from openrlhf_oppo.integrations.launch.schedules import oppo_config as schedule_oppo_config

    section = oppo_config.to_dict(cfg.oppo)
    out = schedule_oppo_config(schedule, section)
    if out is None or not cfg.oppo_set:
        return out
    merged = oppo_config.to_dict(out)
    for key in cfg.oppo_set:
        head, leaf = key.rsplit(".", 1)
        src, dst = section, merged
        for part in head.split("."):
            src, dst = src[part], dst[part]
        dst[leaf] = src[leaf]
    return oppo_config.from_dict(merged)


def parse_set(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise ValueError(f"--set: expected key=value, got '{item}'")
    key, value = item.split("=", 1)
    return key.strip(), value.strip()


def canonical_key(key: str) -> str:
    """`delta.max` -> `oppo.delta.max`; every other key as given."""
    return f"oppo.{key}" if key.split(".", 1)[0] in OPPO_SECTIONS else key


def apply_set(raw: dict, key: str, value: Any) -> dict:
    """A copy of `raw` with the dotted `key` set (checked when the config is built)."""
    key = canonical_key(key)
    parts = key.split(".")
    allowed = {f.name for f in dataclasses.fields(SimConfig)}
    if parts[0] not in allowed:
        raise ValueError(f"--set {key}: unknown key '{parts[0]}'; allowed: {', '.join(sorted(allowed))}")
    out = copy.deepcopy(raw)
    node = out
    for p in parts[:-1]:
        child = node.get(p)
        if child is None or isinstance(child, str):  # a catalog name: edit a copy of its entry
            child = _catalog_entry(p, child) if isinstance(child, str) else {}
        node[p] = child
        node = child
    node[parts[-1]] = settings.yaml_value(value)
    return out


def _catalog_entry(key: str, name: str) -> dict:
    catalog = _yaml(PRESET_DIR / CATALOG_KEYS[key])
    if name not in catalog:
        raise ValueError(f"{key}: unknown {CATALOG_KEYS[key].split('.')[0]} '{name}'; allowed: {', '.join(catalog)}")
    return dict(catalog[name], name=name)


def build(raw: Mapping[str, Any]) -> SimConfig:
    data = dict(raw)
    for key in CATALOG_KEYS:
        if isinstance(data.get(key), str):
            data[key] = _catalog_entry(key, data[key])
    # OPPO's section is read by OPPO's own codec, so its messages name `--oppo.*` flags.
    oppo = oppo_config.from_dict(data.pop("oppo", None) or {})
    cfg = CODEC.build(SimConfig, data, skip=("oppo",))
    cfg = dataclasses.replace(cfg, oppo=oppo)
    validate(cfg)
    return cfg


def vllm_tp_fits(model: ModelShape, tp: int) -> bool:
    """vLLM shards attention heads evenly: TP divides the heads, and the KV heads or a multiple of them."""
    return model.heads % tp == 0 and (model.kv_heads % tp == 0 or tp % model.kv_heads == 0)


def validate(cfg: SimConfig) -> None:
    """Whole-config checks, each naming the key."""
    w = cfg.workload
    s = cfg.split
    lengths = cfg.lengths
    _require(w.batch_groups >= 1, "workload.batch_groups", ">= 1", w.batch_groups)
    _require(w.samples_per_group >= 1, "workload.samples_per_group", ">= 1", w.samples_per_group)
    _require(w.steps > w.warmup_steps + 1, "workload.steps", f"> workload.warmup_steps + 1 ({w.warmup_steps + 1})",
             w.steps)
    _require(w.seeds >= 1, "workload.seeds", ">= 1", w.seeds)
    _require(cfg.oppo.delta.max <= w.batch_groups, "delta.max", f"<= workload.batch_groups ({w.batch_groups})",
             cfg.oppo.delta.max)
    _require(lengths.kind in ("lognormal", "quantiles", "empirical", "replay"), "lengths.kind",
             "one of lognormal, quantiles, empirical, replay", lengths.kind)
    _require(lengths.cap_tokens >= lengths.min_tokens >= 1, "lengths.cap_tokens", ">= lengths.min_tokens >= 1",
             lengths.cap_tokens)
    _require(s.nodes >= 1 and s.train_gpus >= 1, "split", "nodes and train_gpus >= 1", (s.nodes, s.train_gpus))
    _require(0 <= s.engine_nodes < s.nodes, "split.engine_nodes", f"0 to split.nodes - 1 ({s.nodes - 1}): the "
             "DeepSpeed models need a node", s.engine_nodes)
    _require(s.generate_gpus >= (0 if s.engine_nodes else 1), "split.generate_gpus",
             ">= 1 (0 only with split.engine_nodes)", s.generate_gpus)
    _require(not (s.engine_nodes and s.colocate), "split.engine_nodes", "0 when split.colocate (every device "
             "is shared)", s.engine_nodes)
    _require(not s.engine_nodes or s.gpus_per_node % s.tensor_parallel == 0, "split.tensor_parallel",
             f"a divisor of split.gpus_per_node ({s.gpus_per_node}) with split.engine_nodes", s.tensor_parallel)
    _require(s.generate_gpus % s.tensor_parallel == 0, "split.tensor_parallel",
             f"a divisor of split.generate_gpus ({s.generate_gpus})", s.tensor_parallel)
    a = cfg.actor
    _require(a is None or vllm_tp_fits(a, s.tensor_parallel), "split.tensor_parallel", "a TP vLLM can shard the "
             f"actor's attention heads by ({a and a.heads} heads, {a and a.kv_heads} KV heads)", s.tensor_parallel)
    _require(s.colocate or not s.sleep, "split.sleep", "false unless split.colocate (vLLM sleeps only where "
             "training shares its devices)", s.sleep)
    _require(s.score_gpus == 0 or not s.reward_with_train, "split.reward_with_train",
             "false when split.score_gpus > 0 (the reward model is on its own devices)", s.reward_with_train)
    _require(not (s.colocate and s.critic_gpus), "split.critic_gpus", "0 when split.colocate (every model "
             "shares the devices)", s.critic_gpus)
    _require(w.critic or not s.critic_gpus, "split.critic_gpus", "0 without a critic (workload.critic false)",
             s.critic_gpus)
    _require(s.reference_gpus >= 0, "split.reference_gpus", ">= 0", s.reference_gpus)
    p = cfg.projections
    _require(not p.reference_actors or (cfg.hardware is not None and cfg.actor is not None),
             "projections.reference_actors", "false unless hardware and actor are set (the reference actors' "
             "costs and memory are the roofline's)", p.reference_actors)
    _require(not (p.experience_ahead and cfg.oppo.streaming.critic), "projections.experience_ahead",
             "false with streaming.critic (both forward the values and old log-probs on the training devices)",
             p.experience_ahead)
    gpus = s.devices_used
    if cfg.hardware is not None:
        _require(gpus <= s.gpus_per_node, "split", f"generate + score + reference (+ train + critic unless "
                 f"colocated) <= split.gpus_per_node ({s.gpus_per_node})", gpus)
    measured = cfg.costs.measured_decode
    reward_ok = cfg.reward is not None or not w.reward_model  # a rule reward needs no reward shape
    _require(measured or (cfg.hardware is not None and cfg.actor is not None and reward_ok),
             "hardware", "set (with actor and reward) unless the decode costs (costs.decode_*) are measured",
             cfg.hardware)
    offload = w.offload_params or w.offload_optimizer
    _require(not offload or (cfg.hardware is not None and cfg.actor is not None), "workload.offload_params",
             "false unless hardware and actor are set (offload is charged over hardware.pcie_bytes_per_s)", offload)

