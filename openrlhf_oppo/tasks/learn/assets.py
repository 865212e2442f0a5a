"""What `build` makes and where: the asset version, `LearnSpec` (the build's numbers),
`LearnAssets` (the paths of a built directory), JSONL I/O and the splits written without a
model (`write_data`). Above `task`, below everything else of `openrlhf_oppo.tasks.learn`."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from openrlhf_oppo.tasks import tiny
from openrlhf_oppo.tasks.learn.task import (
    MISTAKES,
    RESPONSE_CAP,
    LengthLaw,
    preference_pairs,
    prompt_records,
    sft_records,
)

ASSET_VERSION = "learn-v3"
DEFAULT_ASSETS_DIR = tiny.DEFAULT_ASSETS_DIR.with_name("learn")
# Parameter dtype of the trainers: "fp32" runs OpenRLHF's trainer with fp32 parameters
# (`fp32_trainer_main`), "bf16" as OpenRLHF ships it (see openrlhf_oppo.tasks.learn's docstring).
TRAIN_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class LearnSpec:
    """What `build` makes. Defaults: the `learn` variant (see VARIANTS)."""

    actor: tiny.TinyModelSpec = tiny.TinyModelSpec(vocab_size=384, hidden_size=128, intermediate_size=256,
                                                   num_attention_heads=4, num_key_value_heads=4,
                                                   max_position_embeddings=256)
    """Shape of the actor; the reward model has it too (it starts from the SFT policy). 2 layers,
    hidden 128, 4 heads of head_dim 32 (vLLM CPU's smallest): ~0.4 M parameters. With tiny's
    hidden 64 the reward model stayed at 0.82-0.85 held-out accuracy in bf16 after 32-48 k
    pairs; hidden 128 reached 0.92 after 32 k. The EOS / trap fields are unused here."""
    lengths: LengthLaw = LengthLaw(p_mid=0.30, p_long=0.10)
    """List lengths (words) of the RL prompts and of the reward model's held-out pairs: 60 %
    1-6 words, 30 % 7-14, 10 % 15-40."""
    train_lengths: LengthLaw = LengthLaw()
    """List lengths of the training data, SFT records and reward-model training pairs: 85 % 1-6
    words, 10 % 7-14, 5 % 15-40. Mostly short lists: OpenRLHF's SFT loss is a mean over tokens,
    which long lists dominate, and with `lengths`' law short lists were still half wrong after
    450 SFT steps; a reward model trained on `lengths`' law judged held-out mid / long pairs
    worse (0.76 / 0.50) than one trained on this law (0.91 / 0.79). The SFT policy then fails
    on most lists longer than it mostly saw, which the RL prompts hold 40 % of."""
    seed: int = 1234
    """Seed of the data (each split offsets it), the tokenizer corpus, the initial actor and the trainers."""
    sft_samples: int = 9600
    """SFT records, one epoch: sft_samples / sft_batch_size optimizer steps (300: the policy
    reverses most short lists and no long one, so RL has something to gain)."""
    sft_batch_size: int = 32
    """SFT samples per optimizer step (--train.batch_size = --train.micro_batch_size)."""
    sft_lr: float = 3e-3
    """SFT peak learning rate (cosine to 10 %, 3 % warm-up)."""
    rm_train_pairs: int = 96000
    """Hand-made training pairs (gold vs a plausible mistake), one epoch, beside the SFT
    policy's own mistakes (`rm_policy_prompts`). The reward model learns to check mid-length
    lists late: held-out accuracy (bf16) was 0.812 after 48,000 hand-made pairs and 9,321 of
    the policy's (0.645 on 7-14 words), 0.889 after 96,000 and 9,321 (0.806), one build each.
    Batches grouped by length (`length_grouped_order`) keep the 96,000 within the build's
    time."""
    rm_kind_weights: tuple[tuple[str, float], ...] = (
        ("swap", 3.0), ("substitute", 3.0), ("unreversed", 2.0), ("drop", 1.0), ("repeat", 1.0), ("truncate", 1.0),
        ("run_on", 1.0))
    """Mistake kinds of the training pairs, by weight: the local mistakes (a swap, a substituted
    word), which the policy's own samples are full of, are the hardest to learn. The held-out
    pairs weigh every kind the same."""
    rm_policy_prompts: int = 8192
    """Prompts (the RL prompts' length law, their own seed) that the SFT policy samples
    `rm_policy_samples` times each once SFT is done; every wrong sample becomes a training pair
    against the gold answer (kind "policy"). Trained on hand-made mistakes only, the reward
    model scored the gold answer above the SFT policy's own wrong samples 64 % of the time,
    and PPO raised the learned reward while exact match fell; with 2 samples per prompt
    79 %, with 3 84 %. 0: no such pairs."""
    rm_policy_samples: int = 3
    """Samples per prompt of `rm_policy_prompts` (temperature 1, as PPO samples)."""
    rm_heldout_pairs: int = 512
    """Held-out pairs (their own seed): the accuracy `build` reports, and OpenRLHF's eval set (reward mean / std)."""
    rm_batch_size: int = 64
    """Pairs per reward-model optimizer step."""
    rm_lr: float = 1e-3
    """Reward-model peak learning rate."""
    rl_prompts: int = 1024
    """Rows of prompts.jsonl (the RL prompts, with the ground truth as `label`)."""
    eval_prompts: int = 256
    """The first eval_prompts RL prompts are sampled once each from the SFT policy by `build`."""
    max_new_tokens: int = RESPONSE_CAP
    """Cap when sampling the SFT policy to measure it (the run config's rollout.max_new_tokens),
    and the length a `loop` mistake of the reward model's pairs runs to."""
    sample_batch_size: int = 64
    """Prompts per `generate` call when sampling the SFT policy (its mistakes, its measurements,
    its baseline). A batch decodes until its longest response ends: with a long tail, most
    batches run to the cap, and a bigger batch is that much cheaper per sample (256: 2.5x
    faster than 64 on learn-longtail)."""
    rm_policy_max_new_tokens: int = RESPONSE_CAP
    """Cap when sampling the SFT policy's mistakes for the reward model's pairs
    (`rm_policy_prompts`): a sample that does not stop is cut there (a wrong pair all the same)."""
    max_len: int = 160
    """Trainers' --data.max_len (tokens): prompt (<= 43) + response (<= 41), with room; with
    `loop` pairs (a loop runs to max_new_tokens), prompt + max_new_tokens."""
    loop_share: float = 0.0
    """Share of SFT records whose answer loops on without an end (`task.loop_response`): the
    SFT policy then loops after about as many of its answers, to the response cap, which is
    the long tail of `learn-longtail`. 0: no such records (`learn`)."""
    loop_repeats: int = 24
    """Times the last word repeats in a looping SFT record (which has no end). OpenRLHF's SFT
    loss is a mean over tokens: longer loops take that much of it from the answers."""
    train_dtype: str = "fp32"
    """Trainers' parameter dtype, one of TRAIN_DTYPES ("bf16": OpenRLHF's trainers as shipped)."""

    def __post_init__(self):
        if self.train_dtype not in TRAIN_DTYPES:
            raise ValueError(f"train_dtype must be one of {', '.join(TRAIN_DTYPES)}, got {self.train_dtype!r}")
        for name, batch in (("sft_samples", "sft_batch_size"), ("rm_train_pairs", "rm_batch_size")):
            if not 1 <= getattr(self, batch) <= getattr(self, name):
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= {batch} ({getattr(self, batch)}) >= 1: "
                                 "OpenRLHF trains on whole batches only")
        if not 1 <= self.eval_prompts <= self.rl_prompts:
            raise ValueError(f"eval_prompts must be in [1, rl_prompts = {self.rl_prompts}], got {self.eval_prompts}")
        weights = dict(self.rm_kind_weights)
        if set(weights) - set(MISTAKES) or not all(w >= 0 for w in weights.values()) or not any(weights.values()):
            raise ValueError(f"rm_kind_weights must weigh kinds of {', '.join(MISTAKES)} with weights >= 0, "
                             f"not all 0; got {self.rm_kind_weights}")
        if self.rm_policy_prompts < 0 or self.rm_policy_samples < 1:
            raise ValueError(f"rm_policy_prompts must be >= 0 and rm_policy_samples >= 1, got "
                             f"{self.rm_policy_prompts} and {self.rm_policy_samples}")
        if not 0.0 <= self.loop_share < 1.0 or self.loop_repeats < 1:
            raise ValueError(f"loop_share must be in [0, 1) and loop_repeats >= 1, got {self.loop_share} and "
                             f"{self.loop_repeats}")
        if self.loop_share and self.train_dtype != "fp32":
            raise ValueError("loop_share needs train_dtype 'fp32': the build's trainer entry point keeps a looping "
                             "SFT record from learning the EOS OpenRLHF appends to it")
        if self.rm_heldout_pairs < 1:
            raise ValueError(f"rm_heldout_pairs must be >= 1, got {self.rm_heldout_pairs}")


LONGTAIL_CAP = 512
"""learn-longtail's response cap (configs/learn-longtail-cpu.yaml's rollout.max_new_tokens)."""
VARIANTS = {
    "learn": LearnSpec(),
    # The learn task with a long tail: a share of the SFT policy's answers loop on to the cap
    # (task.loop_response), and the reward model ranks a loop below the answer; PPO learns to stop.
    "learn-longtail": LearnSpec(
        actor=replace(LearnSpec().actor, max_position_embeddings=1024),  # prompt (<= 43) + the cap
        sft_samples=19200, loop_share=0.08, loop_repeats=16, sample_batch_size=256,
        max_new_tokens=LONGTAIL_CAP, max_len=LONGTAIL_CAP + 64,
        rm_kind_weights=(*LearnSpec().rm_kind_weights, ("loop", 0.15))),
}


@dataclass(frozen=True)
class LearnAssets:
    """Paths of a built asset directory (same attributes as tiny.TinyAssets where shared)."""

    root: Path

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def init_actor(self) -> Path:
        return self.root / "init_actor"

    @property
    def actor(self) -> Path:
        return self.root / "actor"

    @property
    def reward(self) -> Path:
        return self.root / "reward"

    @property
    def critic(self) -> Path:
        return self.root / "reward"

    @property
    def prompts(self) -> Path:
        return self.root / "prompts.jsonl"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def sft_baseline(self) -> Path:
        return self.root / "data" / "sft_baseline.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    def is_built(self, spec: LearnSpec) -> bool:
        marker = self.root / "BUILD_OK"
        return marker.exists() and marker.read_text().strip() == build_marker(spec)


def build_marker(spec: LearnSpec) -> str:
    return f"{ASSET_VERSION} {spec!r}"


def default_root(variant: str = "learn") -> Path:
    return DEFAULT_ASSETS_DIR if variant == "learn" else DEFAULT_ASSETS_DIR.with_name(variant)



def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def read_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def write_data(assets: LearnAssets, spec: LearnSpec, eos_token: str, rm_training_pairs: bool = True) -> None:
    """The four splits made without a model, each from its own seed (see the module docstring);
    without the reward model's hand-made training pairs if not `rm_training_pairs`."""
    write_jsonl(assets.data / "sft.jsonl", sft_records(spec.sft_samples, spec.seed, eos_token, spec.train_lengths,
                                                       spec.loop_share, spec.loop_repeats))
    kinds = dict(spec.rm_kind_weights)
    if rm_training_pairs:
        write_jsonl(assets.data / "rm_mistakes.jsonl", preference_pairs(
            spec.rm_train_pairs, spec.seed + 10, eos_token, spec.train_lengths, kinds, spec.max_new_tokens))
    write_jsonl(assets.data / "rm_heldout.jsonl", preference_pairs(  # every kind the reward model trains on, alike
        spec.rm_heldout_pairs, spec.seed + 20, eos_token, spec.lengths, dict.fromkeys(kinds, 1.0), spec.max_new_tokens))
    write_jsonl(assets.prompts, prompt_records(spec.rl_prompts, spec.seed + 30, spec.lengths))
