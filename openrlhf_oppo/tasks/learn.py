"""A learnable task with a learned reward model, built in code and cached on disk.

The task: reverse a list of words ("reverse: red cat blue dog =>" -> " dog blue cat red").
List lengths are heavy-tailed (RL prompts: 60 % 1-6 words, 30 % 7-14, 10 % 15-40), and a
response is one token per word plus EOS, so response lengths have a long tail, as in real
RLHF. The training data (SFT records, the reward model's hand-made pairs) holds mostly short
lists (85 % 1-6 words), so the SFT policy reverses short lists and fails on most longer ones:
RL has something to gain, on the long prompts. The reward model also trains on the SFT
policy's own wrong samples (on prompts with the RL prompts' lengths), the mistakes PPO starts
from.

    prompt   "reverse: red cat blue dog =>"
    answer   "dog blue cat red"            (the `label` in prompts.jsonl)
    response " dog blue cat red<|eos|>"    (what SFT teaches; `exact_match` checks it)

Built by `build` (also `openrlhf-oppo prepare --variant learn`, and on first use by a
run config with `task: {variant: learn}`), with OpenRLHF's own trainers run as
subprocesses through the CPU compat layer:

    tokenizer/        byte-level BPE (every word of the vocabulary is one token)
    init_actor/       randomly initialised Qwen2ForCausalLM, SFT's starting point
    actor/            the SFT policy (`python -m openrlhf.cli.train_sft`): actor and reference
    reward/           Bradley-Terry reward model (`python -m openrlhf.cli.train_rm`), initialised
                      from the SFT policy; OpenRLHF's layout (`--reward.model_name_or_path`), and
                      the critic's initialisation, as OpenRLHF does by default
    data/sft.jsonl          {"input", "output"}: prompt, response (with EOS)
    data/rm_mistakes.jsonl  {"prompt", "chosen", "rejected", "kind"}: gold vs one plausible mistake
    data/rm_policy.jsonl    same, gold vs a wrong sample of the SFT policy (kind "policy")
    data/rm_train.jsonl     the reward model's training pairs: both of the above
    data/rm_heldout.jsonl   same, another seed, the RL prompts' length law (RM held-out accuracy)
    prompts.jsonl     {"input", "label"}: RL prompts with the ground-truth answer
    summary.json      what `build` measured (losses, accuracies, lengths, stage times)
    BUILD_OK          written last; the asset version and the spec

Splits: SFT, RM-train, RM-held-out and RL prompts are each drawn from their own seed.
Lists of 1-2 words (930 possible) inevitably repeat across splits; longer ones
practically never do. Measurements on "unseen" prompts leave out those in the SFT set.

Trainer precision (`LearnSpec.train_dtype`): OpenRLHF 0.11.2's trainers accept
`--ds.param_dtype` bf16 or fp16 only. On a CPU without AVX512-BF16 / AMX (the 2-core
development machine has neither) bf16 matmuls are emulated: a forward + backward of the
actor took 7-11x as long as in fp32, and a whole OpenRLHF SFT step 2-3x. By default the
trainers therefore run with fp32 parameters (`tasks.learn_trainers.fp32_trainer_main`: the
same trainers, with train_rm's batches also grouped by length); `train_dtype="bf16"` runs
them exactly as OpenRLHF ships them. The saved models are fp32; PPO loads them in bf16, and
`build` measures them in bf16 as PPO runs them.
"""

from __future__ import annotations

import json
import random
import resource
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from openrlhf_oppo.tasks import tiny

ASSET_VERSION = "learn-v3"
DEFAULT_ASSETS_DIR = tiny.DEFAULT_ASSETS_DIR.with_name("learn")

# The words the lists are made of (one BPE token each after a space).
WORDS = tuple(
    "red green blue black white cat dog bird fish cow one two three four five six seven eight nine ten "
    "sun moon star tree rock hat box cup pen map".split()
)
OP = "reverse"
ARROW = " =>"  # ends every prompt; the response starts with a space
# Parameter dtype of the trainers: "fp32" runs OpenRLHF's trainer with fp32 parameters
# (`fp32_trainer_main`), "bf16" as OpenRLHF ships it (see the module docstring).
TRAIN_DTYPES = ("fp32", "bf16")


# ---- the task ------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthLaw:
    """Mixture of uniform bands of list lengths (words): short with the rest of the
    probability, `p_mid` in the middle band, `p_long` in the long band."""

    short: tuple[int, int] = (1, 6)
    mid: tuple[int, int] = (7, 14)
    long: tuple[int, int] = (15, 40)
    p_mid: float = 0.10
    p_long: float = 0.05

    def sample(self, rng: random.Random) -> int:
        u = rng.random()
        band = self.long if u < self.p_long else self.mid if u < self.p_long + self.p_mid else self.short
        return rng.randint(*band)


def make_prompt(words: list[str]) -> str:
    return f"{OP}: {' '.join(words)}{ARROW}"


def parse_prompt(prompt: str) -> list[str]:
    """The word list of a prompt made by `make_prompt` (ValueError otherwise)."""
    head = f"{OP}:"
    if not (prompt.startswith(head) and prompt.endswith(ARROW)):
        raise ValueError(f"not a {OP} prompt: {prompt!r}")
    return prompt[len(head) : -len(ARROW)].split()


def answer_words(prompt: str) -> list[str]:
    return parse_prompt(prompt)[::-1]


def answer(prompt: str) -> str:
    """The ground truth (the `label` of prompts.jsonl)."""
    return " ".join(answer_words(prompt))


def exact_match(prompt: str, response: str, eos_token: str = "<|eos|>") -> bool:
    """Whether `response` is the reversed list, ignoring surrounding whitespace and an EOS
    token's text (vLLM / transformers decode with or without special tokens)."""
    text = response.split(eos_token, 1)[0] if eos_token in response else response
    return text.split() == answer_words(prompt)


def prompt_records(n: int, seed: int, lengths: LengthLaw = LengthLaw()) -> list[dict]:
    """n RL prompt records {"input", "label"}, deterministic for a seed."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        prompt = make_prompt([rng.choice(WORDS) for _ in range(lengths.sample(rng))])
        records.append({"input": prompt, "label": answer(prompt)})
    return records


# Plausible mistakes: each maps (gold answer words, prompt words, rng) -> a wrong answer, or
# None where it does not apply (e.g. nothing to swap in a one-word list).
def _swap(gold: list[str], source: list[str], rng: random.Random) -> list[str] | None:
    spots = [i for i in range(len(gold) - 1) if gold[i] != gold[i + 1]]
    if not spots:
        return None
    i = rng.choice(spots)
    out = list(gold)
    out[i], out[i + 1] = out[i + 1], out[i]
    return out


def _drop(gold: list[str], source: list[str], rng: random.Random) -> list[str] | None:
    if len(gold) < 2:
        return None
    i = rng.randrange(len(gold))
    return gold[:i] + gold[i + 1 :]


def _repeat(gold: list[str], source: list[str], rng: random.Random) -> list[str] | None:
    i = rng.randrange(len(gold))
    return gold[: i + 1] + gold[i:]


def _substitute(gold: list[str], source: list[str], rng: random.Random) -> list[str] | None:
    i = rng.randrange(len(gold))
    return gold[:i] + [rng.choice([w for w in WORDS if w != gold[i]])] + gold[i + 1 :]


def _unreversed(gold: list[str], source: list[str], rng: random.Random) -> list[str] | None:
    return list(source) if source != gold else None  # copied in prompt order


def _truncate(gold: list[str], source: list[str], rng: random.Random) -> list[str] | None:
    if len(gold) < 2:
        return None
    return gold[: rng.randint(1, len(gold) - 1)]


RESPONSE_CAP = 64
"""configs/learn-cpu.yaml's rollout.max_new_tokens (and LearnSpec.max_new_tokens): a response
that does not stop ends there, without EOS."""


def _run_on(gold: list[str], source: list[str], rng: random.Random) -> list[str] | None:
    """The answer, then more words (the list's and others); half of them run on to the
    response cap, where a sample that does not stop ends. PPO against a reward model that
    never saw such a response learned to ramble to the cap."""
    room = RESPONSE_CAP - len(gold)
    if room < 1:
        return None
    extra = room if rng.random() < 0.5 else rng.randint(1, room)
    return gold + [rng.choice(source + list(WORDS)) for _ in range(extra)]


MISTAKES = {
    "swap": _swap,
    "drop": _drop,
    "repeat": _repeat,
    "substitute": _substitute,
    "unreversed": _unreversed,
    "truncate": _truncate,
    "run_on": _run_on,
}


def mistake(kind: str, prompt: str, rng: random.Random) -> str | None:
    """A wrong answer of the given kind for `prompt`, or None where the kind does not apply."""
    source = parse_prompt(prompt)
    wrong = MISTAKES[kind](source[::-1], source, rng)
    return None if wrong is None else " ".join(wrong)


def preference_pairs(n: int, seed: int, eos_token: str, lengths: LengthLaw = LengthLaw(),
                     kind_weights: dict[str, float] | None = None) -> list[dict]:
    """n pairs {"prompt", "chosen", "rejected", "kind"}: the gold response against one
    plausible mistake of a kind drawn from those that apply, with `kind_weights`
    (default: uniform)."""
    weights = {kind: 1.0 for kind in MISTAKES} if kind_weights is None else kind_weights
    rng = random.Random(seed)
    pairs = []
    for rec in prompt_records(n, seed + 1, lengths):
        prompt = rec["input"]
        options = {kind: mistake(kind, prompt, rng) for kind in MISTAKES}
        applicable = sorted(k for k, v in options.items() if v is not None and weights.get(k, 0) > 0)
        if not applicable:  # a one-word list admits only repeat and substitute
            raise ValueError(f"kind_weights {weights} give no applicable mistake for {prompt!r}")
        kind = rng.choices(applicable, weights=[weights[k] for k in applicable])[0]
        pairs.append({
            "prompt": prompt,
            "chosen": f" {rec['label']}{eos_token}",
            "rejected": f" {options[kind]}{'' if len(options[kind].split()) >= RESPONSE_CAP else eos_token}",
            "kind": kind,
        })
    return pairs


def policy_pairs(actor: Path, records: list[dict], samples: int, max_new_tokens: int, seed: int) -> list[dict]:
    """Pairs {"prompt", "chosen", "rejected", "kind": "policy"}: the gold answer against each
    wrong one of `samples` samples per record of the policy at `actor` (a sample that runs
    into `max_new_tokens` without EOS is wrong and kept as it is)."""
    from transformers import AutoTokenizer

    from openrlhf_oppo.tasks.learn_eval import sample_policy

    tokenizer = AutoTokenizer.from_pretrained(actor)
    prompts = [r["input"] for r in records for _ in range(samples)]
    _, responses = sample_policy(actor, prompts, max_new_tokens, seed)
    pairs = []
    for prompt, text in zip(prompts, tokenizer.batch_decode(responses)):  # EOS stays in the text
        if not exact_match(prompt, text, tokenizer.eos_token):
            pairs.append({"prompt": prompt, "chosen": f" {answer(prompt)}{tokenizer.eos_token}",
                          "rejected": text, "kind": "policy"})
    return pairs


def sft_records(n: int, seed: int, eos_token: str, lengths: LengthLaw = LengthLaw()) -> list[dict]:
    """n SFT records {"input", "output"}: the response ends with EOS (so OpenRLHF's
    SFTDataset adds no " " + EOS of its own)."""
    return [{"input": r["input"], "output": f" {r['label']}{eos_token}"} for r in prompt_records(n, seed, lengths)]


# ---- assets ---------------------------------------------------------------------------


def build_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0):
    """Byte-level BPE (tiny.build_tokenizer's recipe) trained on task text, so that every
    word, after a space, is one token. Saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=tiny.SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [r["input"] + " " + r["label"] for r in prompt_records(2000, seed)]
    tok.train_from_iterator(corpus, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>"
    )
    hf_tok.padding_side = "left"
    split = [w for w in WORDS if len(hf_tok.encode(" " + w)) != 1]
    if split:
        raise RuntimeError(f"tokenizer splits words {split}: raise vocab_size")
    hf_tok.save_pretrained(out_dir)
    return hf_tok


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
    """Cap when sampling the SFT policy (configs/learn-cpu.yaml's rollout.max_new_tokens)."""
    max_len: int = 160
    """Trainers' --data.max_len (tokens): prompt (<= 43) + response (<= 41), with room."""
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
        if self.rm_heldout_pairs < 1:
            raise ValueError(f"rm_heldout_pairs must be >= 1, got {self.rm_heldout_pairs}")


VARIANTS = {"learn": LearnSpec()}


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


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _read_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def write_data(assets: LearnAssets, spec: LearnSpec, eos_token: str) -> None:
    """The four splits made without a model, each from its own seed (see the module docstring)."""
    _write_jsonl(assets.data / "sft.jsonl", sft_records(spec.sft_samples, spec.seed, eos_token, spec.train_lengths))
    _write_jsonl(assets.data / "rm_mistakes.jsonl", preference_pairs(spec.rm_train_pairs, spec.seed + 10, eos_token,
                                                                  spec.train_lengths, dict(spec.rm_kind_weights)))
    _write_jsonl(assets.data / "rm_heldout.jsonl",
                 preference_pairs(spec.rm_heldout_pairs, spec.seed + 20, eos_token, spec.lengths))
    _write_jsonl(assets.prompts, prompt_records(spec.rl_prompts, spec.seed + 30, spec.lengths))


def write_rm_train(assets: LearnAssets, spec: LearnSpec) -> int:
    """data/rm_policy.jsonl (the SFT policy's mistakes; `policy_pairs` on prompts of their own
    seed) and data/rm_train.jsonl, the hand-made and the policy's pairs together (train_rm
    shuffles them); returns the number of training pairs."""
    records = prompt_records(spec.rm_policy_prompts, spec.seed + 50, spec.lengths)
    policy = policy_pairs(assets.actor, records, spec.rm_policy_samples, spec.max_new_tokens, spec.seed + 50)
    _write_jsonl(assets.data / "rm_policy.jsonl", policy)
    train = _read_jsonl(assets.data / "rm_mistakes.jsonl") + policy
    _write_jsonl(assets.data / "rm_train.jsonl", train)
    return len(train)


def init_actor(assets: LearnAssets, spec: LearnSpec, tokenizer) -> int:
    """A randomly initialised Qwen2ForCausalLM (bf16) with the tokenizer; returns its parameter count."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(spec.seed)
    actor = Qwen2ForCausalLM(tiny._qwen2_config(spec.actor, tokenizer)).to(torch.bfloat16)
    actor.save_pretrained(assets.init_actor)
    tokenizer.save_pretrained(assets.init_actor)
    return sum(p.numel() for p in actor.parameters())


# ---- build (the measurements: openrlhf_oppo.tasks.learn_eval) ---------------------------


def _cpu_seconds() -> float:
    """CPU time (user + system) of this process and of its waited-for children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclass
class _Stages:
    """Wall and CPU time of each build stage (s), in order. CPU time is what the stage
    would take alone on the machine (the trainers run one thread each); wall time
    includes waiting for cores that other jobs hold."""

    seconds: dict[str, float] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)

    def run(self, name: str, fn, log=print):
        log(f"learn: [{len(self.seconds) + 1}] {name} ...")
        start, cpu_start = time.perf_counter(), _cpu_seconds()
        result = fn()
        self.seconds[name] = time.perf_counter() - start
        self.cpu_seconds[name] = _cpu_seconds() - cpu_start
        log(f"learn: [{len(self.seconds)}] {name}: {self.seconds[name]:.1f} s ({self.cpu_seconds[name]:.1f} s CPU)")
        return result


def build(root: Path | str | None = None, spec: LearnSpec = LearnSpec(), force: bool = False,
          log=print) -> LearnAssets:
    """Build the assets under `root` (default ~/.cache/openrlhf_oppo/learn) unless already
    built with this spec: data and tokenizer, SFT (OpenRLHF's train_sft), reward model
    (OpenRLHF's train_rm), then measurements; prints a summary table and writes summary.json."""
    assets = LearnAssets(Path(root).expanduser() if root else DEFAULT_ASSETS_DIR)
    if assets.is_built(spec) and not force:
        return assets
    assets.root.mkdir(parents=True, exist_ok=True)
    (assets.root / "BUILD_OK").unlink(missing_ok=True)
    for stale in ("logs", "ckpt"):  # a former build's TensorBoard events would mix into the losses
        shutil.rmtree(assets.root / stale, ignore_errors=True)
    stages = _Stages()

    def prepare():
        tokenizer = build_tokenizer(assets.tokenizer, spec.actor.vocab_size, spec.seed + 40)
        write_data(assets, spec, tokenizer.eos_token)
        init_actor(assets, spec, tokenizer)

    from openrlhf_oppo.tasks.learn_trainers import rm_argv, run_trainer, sft_argv

    stages.run("data, tokenizer, initial actor", prepare, log)
    stages.run("SFT (openrlhf.cli.train_sft)", lambda: run_trainer(sft_argv(assets, spec), assets.root, log), log)
    pairs = stages.run("SFT policy's mistakes (reward-model pairs)", lambda: write_rm_train(assets, spec), log)
    stages.run("reward model (openrlhf.cli.train_rm)",
               lambda: run_trainer(rm_argv(assets, spec, pairs), assets.root, log), log)
    from openrlhf_oppo.tasks import learn_eval

    summary = learn_eval.measure(assets, spec, stages, log)
    assets.summary.write_text(json.dumps(summary, indent=2) + "\n")
    log(learn_eval.summary_table(summary))
    (assets.root / "BUILD_OK").write_text(build_marker(spec))
    return assets
