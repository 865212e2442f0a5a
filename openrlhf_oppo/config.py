"""OPPO's configuration: frozen dataclasses, one source for defaults, help and flags.

Every field carries its help text in ``metadata["help"]``; CLI flags are generated
from the fields (``--oppo.delta.init 8``, matching OpenRLHF's dotted flags), and YAML
is read into the same dataclasses, both by the codec of :mod:`openrlhf_oppo.settings`
(this module holds the schema and its validation). Validation raises ``ValueError``
naming the field (as its flag) and the allowed values. A user's value is never
rewritten silently.

Stdlib only (PyYAML is imported lazily when YAML is read), so the scheduler core
can depend on it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from openrlhf_oppo import settings
from openrlhf_oppo.settings import setting as _f

FLAG_PREFIX = "oppo"
DELTA_RULES = ("system", "eq4", "alg1")
CORRECTIONS = ("auto", "none", "tis", "icepop")  # staleness.correction
SYNC_BUFFERS = ("device", "host", "shards")  # staleness.background_sync_buffer
CARRIED_IN_TRAINING = ("auto", "decode", "hold")  # staleness.carried_in_training
OLD_LOGPROBS = ("rollout", "recompute")  # train.old_logprobs
# staleness.correction 'auto' under async admission: on the learn task no correction beat another or none
# beyond the seed spread (docs/evidence.md#time-to-reward-and-learning); TIS, OpenRLHF's token-level
# clip, is the conservative pick
AUTO_CORRECTION = "tis"
# the async schedules' policy lag bound: on the learn task 2 learned as sync does, 3 and 4 did not
# (docs/evidence.md#policy-lag)
ASYNC_POLICY_LAG = 2
REWARD_POOLING = ("last", "non_pad")  # streaming.reward_pooling: OpenRLHF's rule, transformers' rule

# YAML and flags read alike: a flag's text converts when lossless ("8", "true", "64,128").
CODEC = settings.Codec(
    leaf=f"--{FLAG_PREFIX}.{{key}}",
    section=f"{FLAG_PREFIX}{{dotted}}",
    unknown=f"unknown key '{FLAG_PREFIX}.{{where}}{{key}}'; allowed: {{names}}",
    text=settings.ARGV,
    prefix=FLAG_PREFIX,
)
_require = CODEC.require


@dataclass(frozen=True)
class DeltaConfig:
    """Inter-step overlap: overcommit Δ prompt groups beyond the batch size B."""

    enable: bool = _f(True, "Admit B+Δ prompt groups per step, train on the first B that finish, carry the rest.")
    init: int = _f(4, "Initial overcommit Δ (prompt groups).")
    min: int = _f(0, "Lower bound Δ_min (prompt groups).")
    max: int = _f(16, "Upper bound Δ_max (prompt groups); at most the rollout batch size B.")
    window_steps: int = _f(4, "Window W (steps) of the Δ controller: rewards (eq4, alg1) or trained lengths (system).")
    inc: int = _f(1, "δ_inc: eq. 4 raises Δ by this while the reward slope is positive.")
    dec: int = _f(1, "δ_dec: eq. 4 lowers Δ by this while the reward slope is not positive.")
    rule: str = _f(
        "system",
        "Δ update rule: 'system' (sized every step from B and the length tail of the groups trained "
        "over W steps: enough groups that B of them are not stragglers; default), 'eq4' (paper eq. 4, "
        "reward slope over W steps) or 'alg1' (paper Algorithm 1 lines 21-27, which moves Δ the "
        "opposite way).",
        choices=DELTA_RULES,
    )
    adaptive: bool = _f(True, "Adapt Δ online (by the rule); off keeps Δ = init.")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("init", "min", "max", "inc", "dec"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 0, f"delta.{name}", "an integer >= 0", value)
        _require(self.min <= self.max, "delta.min", f"<= --{FLAG_PREFIX}.delta.max ({self.max})", self.min)
        _require(
            self.min <= self.init <= self.max,
            "delta.init",
            f"within [--{FLAG_PREFIX}.delta.min, --{FLAG_PREFIX}.delta.max] = [{self.min}, {self.max}]",
            self.init,
        )
        _require(self.window_steps >= 2, "delta.window_steps", "an integer >= 2", self.window_steps)
        _require(self.rule in DELTA_RULES, "delta.rule", "one of " + ", ".join(map(repr, DELTA_RULES)), self.rule)


@dataclass(frozen=True)
class ChunkConfig:
    """Intra-step overlap: how many generated tokens make one streamed chunk (C)."""

    size_tokens: int = _f(256, "Chunk size C in tokens (fixed, or the start value when adaptive).")
    adaptive: bool = _f(False, "Choose C online by trying each candidate every period_steps steps.")
    candidates: tuple[int, ...] = _f((128, 256, 512), "Candidate chunk sizes (tokens) tried when adaptive.")
    period_steps: int = _f(50, "Steps between the starts of two rounds of chunk-size trials.")
    trial_steps: int = _f(2, "Steps each candidate is tried for in a round.")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _require(self.size_tokens >= 1, "chunk.size_tokens", "an integer >= 1", self.size_tokens)
        _require(
            len(self.candidates) >= 1 and all(isinstance(c, int) and c >= 1 for c in self.candidates),
            "chunk.candidates",
            "a non-empty list of integers >= 1",
            self.candidates,
        )
        _require(
            len(set(self.candidates)) == len(self.candidates),
            "chunk.candidates",
            "free of duplicates",
            self.candidates,
        )
        _require(self.trial_steps >= 1, "chunk.trial_steps", "an integer >= 1", self.trial_steps)
        round_steps = len(self.candidates) * self.trial_steps
        _require(
            self.period_steps >= round_steps,
            "chunk.period_steps",
            f">= len(candidates) * trial_steps = {round_steps}",
            self.period_steps,
        )


@dataclass(frozen=True)
class StalenessConfig:
    """How long a carried sample may wait and how off-policy tokens are treated."""

    max_deferral_steps: int = _f(
        3, "A prompt group carried this many steps must finish (and is trained) in the current step."
    )
    max_policy_lag: int = _f(
        0,
        "Async admission. 0: a step's new groups are admitted when it begins, after the weight sync. "
        "N >= 1: the next step's groups are admitted as soon as the trainer takes a batch and decode "
        "while it trains (for vLLM on its own GPUs); no trained token is more than N policy versions "
        "older than the weights it trains: a group that could exceed N is forced into the next batch "
        "(the batch waits for it). N = 1 leaves no room to carry a group: it needs delta.enable false.",
    )
    correction: str = _f(
        "auto",
        "Off-policy correction with the recorded rollout logprobs, by OpenRLHF's importance-sampling "
        f"correction: 'none', 'tis' (token-level clip), 'icepop' (token-level mask) or 'auto' ('{AUTO_CORRECTION}' "
        "with async admission, max_policy_lag >= 1, else 'none'; OpenRLHF's own --algo.advantage.is_correction_* "
        "flags, when given, win).",
        choices=CORRECTIONS,
    )
    background_sync: bool = _f(
        False,
        "With async admission (max_policy_lag >= 1, vLLM on GPUs of its own): the trainer waits for the "
        "weight sync only while the actor's weights are gathered into a buffer on its first rank (a whole "
        "copy of them on that GPU); the broadcast to the engines, which stay paused until they have "
        "loaded it, runs beside the next step's experience making, and the next sync waits for it.",
    )
    background_sync_buffer: str = _f(
        "device",
        "Where the background sync keeps the weights it sends (GPU runs; a CPU run packs them in host memory "
        "either way): 'device' (a whole copy of the actor's weights on its first GPU: the trainer waits for "
        "the gather only), 'host' (pinned host memory on that node, the GPU holding one parameter at a "
        "time as it is sent: for models whose copy does not fit beside the ZeRO-3 states; the trainer also "
        "waits for the copies to host, which overlap the gather) or 'shards' (no gather: every DeepSpeed "
        "rank copies its own ZeRO-3 partition and sends it to the engines, which reassemble the parameters; "
        "the trainer waits for that copy only; needs --ds.zero_stage 3).",
        choices=SYNC_BUFFERS,
    )
    carried_in_training: str = _f(
        "auto",
        "Carried groups while the trainer trains (max_policy_lag 0): 'decode' on, 'hold' (paused from the batch to "
        "the weight sync) or 'auto' (hold where engines and trainer share devices: no CUDA, --train.colocate_all).",
        choices=CARRIED_IN_TRAINING,
    )
    keep_kv_cache: bool = _f(
        True,
        "Carried requests keep their vLLM KV cache across a weight sync (pause with clear_cache=False): "
        "no re-prefill, but their later tokens attend to keys/values of the older policy (PPO "
        "recomputes old logprobs on the full sequence either way). False: vLLM re-prefills them.",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _require(
            self.max_deferral_steps >= 1,
            "staleness.max_deferral_steps",
            "an integer >= 1",
            self.max_deferral_steps,
        )
        _require(
            isinstance(self.max_policy_lag, int) and self.max_policy_lag >= 0,
            "staleness.max_policy_lag",
            "an integer >= 0",
            self.max_policy_lag,
        )
        _require(
            self.correction in CORRECTIONS,
            "staleness.correction",
            "one of " + ", ".join(map(repr, CORRECTIONS)),
            self.correction,
        )
        if self.max_policy_lag == 0:
            allowed = CARRIED_IN_TRAINING
        else:
            # async admission: the engines decode the next step's groups through training, nothing is held
            allowed = ("auto", "decode")
        _require(
            self.carried_in_training in allowed,
            "staleness.carried_in_training",
            "'auto', 'decode' or (lag 0) 'hold'",
            self.carried_in_training,
        )
        _require(
            self.background_sync_buffer in SYNC_BUFFERS,
            "staleness.background_sync_buffer",
            "one of " + ", ".join(map(repr, SYNC_BUFFERS)),
            self.background_sync_buffer,
        )

    @property
    def resolved_correction(self) -> str:
        """'none', 'tis' or 'icepop': what 'auto' means for this lag."""
        if self.correction != "auto":
            return self.correction
        return AUTO_CORRECTION if self.max_policy_lag >= 1 else "none"


@dataclass(frozen=True)
class StreamingConfig:
    """Which scorers prefill chunks while the actor decodes."""

    enable: bool = _f(True, "Stream chunks into the scorers during generation (intra-step overlap).")
    reward: bool = _f(True, "Stream into the reward model.")
    reference: bool = _f(
        False,
        "Stream into the reference model: OpenRLHF's reference group (built when --algo.kl.init_coef > 0, "
        "placed as OpenRLHF places it) is made of streaming reference actors, each holding the whole frozen "
        "reference, and their per-token log-probs replace OpenRLHF's reference forward in experience making.",
    )
    critic: bool = _f(
        False,
        "Stream into the critic (its cache is valid within one step only). Not routed by the "
        "OpenRLHF integration yet.",
    )
    reward_pooling: str = _f(
        "last",
        "Where the streamed reward head reads: 'last' = the last token of prompt+response, as "
        "OpenRLHF's reward model reads it (any checkpoint layout); 'non_pad' = the rightmost token that "
        "is not the pad id, as a transformers *ForSequenceClassification forward reads it (differs when "
        "a response ends in the pad id, e.g. EOS with pad == eos).",
        choices=REWARD_POOLING,
    )
    kv_budget_tokens: int = _f(
        0,
        "KV-cache budget per streaming reward actor in tokens (past it, the least recently extended "
        "sequences' caches are evicted and re-prefilled when next extended); 0 = derived from the "
        "device's memory once the model is loaded: 0.5 of the GPU's free memory, or on a CPU host "
        "0.1 of the available memory split among the reward actors, over the model's KV bytes per "
        "token (2 x layers x kv_heads x head_dim x dtype bytes).",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _require(self.kv_budget_tokens >= 0, "streaming.kv_budget_tokens", "an integer >= 0", self.kv_budget_tokens)
        _require(
            self.reward_pooling in REWARD_POOLING,
            "streaming.reward_pooling",
            f"one of {REWARD_POOLING}",
            self.reward_pooling,
        )

    def scorers(self) -> tuple[str, ...]:
        """Names of the scorers that receive chunks, in a fixed order."""
        if not self.enable:
            return ()
        return tuple(n for n in ("reward", "reference", "critic") if getattr(self, n))


@dataclass(frozen=True)
class MegatronConfig:
    """The actor's training backend."""

    enable: bool = _f(
        False,
        "Train the actor with Megatron-Core (tensor and pipeline parallel) instead of DeepSpeed: the actor "
        "group's --actor.num_nodes x --actor.num_gpus_per_node ranks are split into tensor x pipeline x "
        "data parallel groups; the model is mapped from the Hugging Face checkpoint (Qwen2 and Llama "
        "families); OpenRLHF's PPO and KL losses, Adam and its learning-rate schedule; checkpoints under "
        "--ckpt.path/_actor (with OPPO's carried groups) and the trained actor saved as a Hugging Face "
        "checkpoint. The critic, reference and reward models stay on DeepSpeed.",
    )
    tensor_parallel_size: int = _f(1, "Tensor-parallel size of the Megatron actor.")
    pipeline_parallel_size: int = _f(1, "Pipeline-parallel size of the Megatron actor (it must divide the layers).")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, f"megatron.{name}", "an integer >= 1", value)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class TrainConfig:
    """How the actor and critic are fed their batches, and the advantage step between."""

    length_buckets: bool = _f(
        True,
        "Group each optimizer step's samples into training micro-batches by length, and each batch's samples "
        "into experience making's micro-batches (the old log-prob, value, reference and reward forwards), so a "
        "long sample pads only beside other long ones; the loss is one mean over the step's tokens (OpenRLHF "
        "0.11.2) and each sample keeps its place for group baselines, so the gradient is unchanged. No effect "
        "with --ds.packing_samples (training) or --train.dynamic_batch_enable.",
    )
    vectorized_advantages: bool = _f(
        True,
        "Compute GAE advantages and REINFORCE returns in whole-tensor operations in place of OpenRLHF 0.11.2's "
        "Python loop over the response positions of each make_experience micro-batch, which runs in the "
        "trainer's process while the training devices wait; the same values to float rounding.",
    )
    old_logprobs: str = _f(
        "rollout",
        "PPO's old log-probs (the ratio's anchor and the KL-in-reward term's policy side): 'rollout' takes a "
        "sample's rollout log-probs where every token of it was decoded by the weights the actor holds when "
        "experience is made (exact up to inference numerics: OpenRLHF computes old log-probs once, before any "
        "update) and sends only samples holding older tokens (carried, admitted early) through the actor's "
        "forward; 'recompute': OpenRLHF's forward over every sample. 'rollout' asks vLLM for processed "
        "(temperature-scaled) log-probs and falls back to 'recompute', with a start-up warning, under "
        "--rollout.top_p < 1.",
        choices=OLD_LOGPROBS,
    )
    old_logprobs_audit_steps: int = _f(
        10,
        "With old_logprobs 'rollout': every N-th step (the first included) sends every sample through the "
        "actor's forward anyway and reports how far the rollout log-probs of the fresh ones lie from it "
        "(oppo/old_logprobs/mismatch_kl, OpenRLHF's vllm_kl: the mean of rollout minus recomputed); 0: never.",
    )

    def validate(self) -> None:
        for name in ("length_buckets", "vectorized_advantages"):
            value = getattr(self, name)
            _require(isinstance(value, bool), f"train.{name}", "true or false", value)
        _require(self.old_logprobs in OLD_LOGPROBS, "train.old_logprobs",
                 "one of " + ", ".join(map(repr, OLD_LOGPROBS)), self.old_logprobs)
        steps = self.old_logprobs_audit_steps
        _require(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0,
                 "train.old_logprobs_audit_steps", "an integer >= 0", steps)


@dataclass(frozen=True)
class TimeoutsConfig:
    """Bounds on the waits across processes on the GPU path (a weight broadcast, an engine's wake, the
    calls around them): a wait past its bound ends the run with a message naming what was waited for,
    to resume from its last checkpoint (`--ckpt.load_enable`) as after a crash."""

    weight_sync_s: float = _f(
        900.0,
        "Seconds the weight sync may take: the actor group's gather and send, the engines' loads (with "
        "--oppo.staleness.background_sync, their landing and the actor's wait for its last sender), and "
        "the creation of the sharded sync's group; several times what a 72B model's 145 GB take over a "
        "1 GB/s link.",
    )
    engine_call_s: float = _f(
        300.0,
        "Seconds any other call to a rollout engine may take: its wake (weights back from host memory, "
        "the KV cache mapped) and sleep, a pause, a resume, a start, a poll's answer (due within a second).",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("weight_sync_s", "engine_call_s"):
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                     f"timeouts.{name}", "a number of seconds > 0", value)


@dataclass(frozen=True)
class OppoConfig:
    """Everything OPPO adds to an OpenRLHF PPO run."""

    delta: DeltaConfig = field(default_factory=DeltaConfig, metadata={"help": "Overcommit Δ (inter-step overlap)."})
    chunk: ChunkConfig = field(default_factory=ChunkConfig, metadata={"help": "Chunk size C (intra-step overlap)."})
    staleness: StalenessConfig = field(default_factory=StalenessConfig, metadata={"help": "Deferral and off-policy."})
    streaming: StreamingConfig = field(default_factory=StreamingConfig, metadata={"help": "Streamed scorers."})
    megatron: MegatronConfig = field(
        default_factory=MegatronConfig, metadata={"help": "Megatron-Core training backend for the actor."}
    )
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "Training micro-batches and advantages."})
    timeouts: TimeoutsConfig = field(
        default_factory=TimeoutsConfig, metadata={"help": "Bounded waits on the GPU path (a stall ends the run)."}
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for section in (self.delta, self.chunk, self.staleness, self.streaming, self.megatron, self.train,
                        self.timeouts):
            section.validate()
        # lag 1: a group admitted while the trainer trains holds tokens one version old, so it
        # must be trained in the very next step; a carried group would be two versions old
        _require(
            self.staleness.max_policy_lag != 1 or not self.delta.enable or self.delta.max == 0,
            "staleness.max_policy_lag",
            f"0 or >= 2 while --{FLAG_PREFIX}.delta.enable is true (a group admitted during training "
            f"cannot be carried within lag 1: set --{FLAG_PREFIX}.delta.enable false, or the lag to 2)",
            self.staleness.max_policy_lag,
        )


# ------------------------------------------------------------------- loading and CLI


def from_dict(data: Mapping[str, Any] | None) -> OppoConfig:
    """Build and validate an :class:`OppoConfig` from a nested mapping (the YAML's ``oppo:``)."""
    return CODEC.build(OppoConfig, data or {})


def load_yaml(path: str) -> OppoConfig:
    """Read the ``oppo:`` section of a YAML file (a file with no such key gives defaults)."""
    return from_dict(settings.read_yaml(path).get(FLAG_PREFIX))


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain-dict form (tuples become lists), for YAML, JSON and checkpoints."""
    return settings.to_dict(cfg)


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """Add one ``--oppo.<section>.<field>`` flag per config field (default: unset)."""
    CODEC.add_flags(parser, OppoConfig, "OPPO", "pipeline overlap (defaults shown; unset flags keep YAML/defaults)")


def from_cli(args: argparse.Namespace | Mapping[str, Any], base: OppoConfig | None = None) -> OppoConfig:
    """Overlay the ``--oppo.*`` flags that were given on ``base`` (YAML or defaults)."""
    values = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    base = base or OppoConfig()
    top, start = values.get(f"{FLAG_PREFIX}.delta.max"), f"{FLAG_PREFIX}.delta.init"
    if (values.get(start) is None and str(top).isdigit() and int(top) < base.delta.init == DeltaConfig.init):
        values = {**values, start: int(top)}  # Δ's default start within the user's bound, not blamed on it
    return CODEC.overlay(values, base)


def fit_delta(cfg: OppoConfig, batch_groups: int, given: Mapping[str, Any]) -> tuple[OppoConfig, str | None]:
    """Δ's defaults fitted to a rollout batch of `batch_groups` prompt groups smaller than them:
    `delta.max` (and `delta.init` above it) left at their defaults, i.e. not in `given` (the
    `delta.*` keys the user set), are lowered to the batch, with the note saying so. A value the
    user set is left for the checks to refuse, naming it."""
    d = cfg.delta
    if not d.enable or not 1 <= batch_groups < d.max or "max" in given:
        return cfg, None
    fitted = {"max": batch_groups}
    if d.init > batch_groups and "init" not in given:
        fitted["init"] = batch_groups
    note = (f"--{FLAG_PREFIX}.delta.max {d.max} (the default) lowered to --rollout.batch_size ({batch_groups}): at "
            f"most B prompt groups can be carried" + (f"; --{FLAG_PREFIX}.delta.init {d.init} too" if "init" in fitted
                                                      else ""))
    return dataclasses.replace(cfg, delta=dataclasses.replace(d, **fitted)), note


def to_cli_args(cfg: OppoConfig) -> list[str]:
    """Every field as ``--oppo.<section>.<field> value`` flags (the inverse of :func:`from_cli`)."""
    return CODEC.to_argv(cfg)


def flags_markdown() -> str:
    """docs/flags.md: every ``--oppo.*`` flag by section, with type, default and help
    (``openrlhf-oppo config --flags-md > docs/flags.md``)."""
    lines = [
        "# `--oppo.*` flags",
        "",
        "Generated from `openrlhf_oppo/config.py` by `openrlhf-oppo config --flags-md > docs/flags.md`",
        "(CI fails when this file is stale). Every flag is also a key under `oppo:` in a YAML config",
        "(`--oppo.delta.init 8` is `oppo: {delta: {init: 8}}`); flags given on the command line override",
        "the YAML. Every other flag of `python -m openrlhf_oppo.cli.train_ppo_ray` is OpenRLHF 0.11.2's.",
    ]
    return "\n".join(lines + CODEC.flag_tables(OppoConfig)) + "\n"


def field_help() -> dict[str, str]:
    """``{"delta.init": "...", ...}``: the help text of every leaf field."""
    return settings.field_help(OppoConfig)


__all__ = [
    "ChunkConfig",
    "DeltaConfig",
    "MegatronConfig",
    "OppoConfig",
    "StalenessConfig",
    "StreamingConfig",
    "TimeoutsConfig",
    "TrainConfig",
    "add_cli_flags",
    "field_help",
    "flags_markdown",
    "from_cli",
    "from_dict",
    "load_yaml",
    "to_cli_args",
    "to_dict",
]
