"""Tiny PPO task assets, built in code and cached on disk.

Layout under the assets directory (all standard transformers layout, so OpenRLHF,
vLLM and plain transformers load them unchanged):

    tokenizer/   byte-level BPE made with `tokenizers`, saved as a transformers tokenizer
    actor/       Qwen2ForCausalLM (+ tokenizer): actor and reference
    reward/      Qwen2ForSequenceClassification, num_labels=1 (+ tokenizer). Its keys
                 are `model.*` + `score.weight`, exactly OpenRLHF's reward/critic layout
                 (`get_llm_for_sequence_regression`, value_head_prefix "score"); the
                 critic is initialised from it, as OpenRLHF does by default.
    prompts.jsonl  {"input": ..., "label": ...} per line
    BUILD_OK     written last; its content is the asset version and the spec

Sizes: hidden 64, 2 heads (head_dim 32, the smallest vLLM CPU attention supports),
2 layers: a few hundred thousand parameters, so a PPO step takes well under a second.

Response lengths: a randomly initialised actor almost never samples EOS, so every
response would run to `max_new_tokens` and no step would have stragglers. The
actor's EOS row of `lm_head` is fitted so EOS has probability ~`eos_prob` at each
position: lengths are then geometric (mostly short, a long tail), as in real RLHF.

Variants (`VARIANTS`): `tiny` is the above. A constant EOS hazard is memoryless, so
P(length > 10 x median) is only ~0.1 %; `longtail` adds a degenerate-repetition "trap"
(" the the the ...") as in real LMs, a per-sample state that makes the tail heavy.
Embedding coordinate 0 is a constant shared by all tokens (like the massive-activation
dimensions of real LMs: a row of `lm_head` can then give a logit that does not drift
with position) and coordinate 1 is nonzero only for the trap token, so "the current
token is the trap" is linear in the final hidden state. The EOS and trap rows of
`lm_head` are least-squares fitted so that after an ordinary token EOS has probability
`eos_prob` and the trap `trap_entry_prob`, and after the trap the trap repeats with
`trap_stay_prob` and EOS has `trap_eos_prob`: the few samples that enter the trap run
for hundreds of tokens (mean run 1 / (1 - trap_stay_prob)), up to `max_new_tokens`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from openrlhf_oppo import run_env

ASSET_VERSION = "tiny-v3"
DEFAULT_ASSETS_DIR = run_env.assets_dir()

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>"]
WORDS = (
    "the a one two three four five six seven eight nine ten red green blue cat dog bird fish "
    "sum count add list say name word answer question why how what is are of to and or not yes no"
).split()
NUM_PROMPTS = 256


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny Qwen2 models. head_dim = hidden_size // num_attention_heads
    must be one of vLLM CPU's supported head sizes (>= 32)."""

    vocab_size: int = 512  # tokenizer vocab is trained to at most this size
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    seed: int = 1234
    eos_prob: float = 0.01  # per-token EOS probability the actor is fitted to: mean length ~1/eos_prob
    # Degenerate-repetition trap (see the module docstring); None: no trap, only `eos_prob`.
    trap_token: str | None = None  # text that is one token, e.g. " the"; eos_prob then holds after other tokens
    trap_entry_prob: float = 0.0  # P(next is the trap | current token is not): per-token chance to enter
    trap_stay_prob: float = 0.0  # P(next is the trap | current is the trap): mean run 1 / (1 - stay)
    trap_eos_prob: float = 0.0  # P(EOS | current is the trap); the rest leaves the trap to ordinary tokens
    shared_feature: float = 0.5  # with a trap: embedding coordinate 0 of every token (a constant feature)
    trap_feature: float = 2.0  # with a trap: embedding coordinate 1 of the trap token (0 for the others)


@dataclass(frozen=True)
class TinyAssets:
    """Paths of a built asset directory."""

    root: Path

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

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

    def is_built(self, spec: TinyModelSpec) -> bool:
        marker = self.root / "BUILD_OK"
        return marker.exists() and marker.read_text().strip() == build_marker(spec)


# Named specs: the YAML's `task.variant` and `openrlhf-oppo prepare --variant` pick one.
VARIANTS = {
    "tiny": TinyModelSpec(),
    # Median ~26 tokens; ~7 % of samples enter the trap and run ~500 tokens (until
    # max_new_tokens): the straggler-bound workload of configs/longtail-cpu.yaml.
    "longtail": TinyModelSpec(
        max_position_embeddings=2048,  # covers prompt + a cap of up to ~2000 tokens
        eos_prob=0.025,
        trap_token=" the",
        trap_entry_prob=0.0025,
        trap_stay_prob=0.998,
        trap_eos_prob=0.001,
    ),
}


def build_marker(spec: TinyModelSpec) -> str:
    """BUILD_OK's content: the asset version and the spec, so a directory built from
    another spec (variant) is rebuilt rather than reused."""
    return f"{ASSET_VERSION} {spec!r}"


def default_root(variant: str) -> Path:
    """A variant's cache dir when none is given: DEFAULT_ASSETS_DIR for tiny, a sibling
    directory named after the variant otherwise (variants never overwrite each other)."""
    return DEFAULT_ASSETS_DIR if variant == "tiny" else DEFAULT_ASSETS_DIR.with_name(variant)


def _corpus(rng: random.Random, n_lines: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n_lines)]


def prompt_records(seed: int = 0, n: int = NUM_PROMPTS) -> list[dict]:
    """Small deterministic prompt set: 'question: <words> answer:'."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
        records.append({"input": "question: " + " ".join(words) + " answer:", "label": str(len(words))})
    return records


def build_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0):
    """Byte-level BPE trained on a generated corpus, saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _corpus(random.Random(seed), 2000) + [r["input"] for r in prompt_records()]
    tok.train_from_iterator(corpus, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>"
    )
    hf_tok.padding_side = "left"
    hf_tok.save_pretrained(out_dir)
    return hf_tok


def _qwen2_config(spec: TinyModelSpec, tokenizer, **extra):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
        **extra,
    )


def fit_eos_probability(actor, tokenizer, eos_prob: float) -> None:
    """Set the EOS row of `lm_head` so that, on corpus-like contexts, EOS has
    probability ~`eos_prob` at every position (least squares on the final hidden
    states: logit_eos = logit(eos_prob) + logsumexp(other logits))."""
    import math

    import torch

    texts = _corpus(random.Random(7), 256)
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        hidden = actor.model(**batch).last_hidden_state[batch["attention_mask"].bool()].float()  # (N, H)
        weight = actor.lm_head.weight  # (V, H)
        others = torch.cat([weight[: tokenizer.eos_token_id], weight[tokenizer.eos_token_id + 1 :]])
        target = math.log(eos_prob / (1 - eos_prob)) + torch.logsumexp(hidden @ others.T, dim=-1)  # (N,)
        row = torch.linalg.lstsq(hidden, target.unsqueeze(-1)).solution.squeeze(-1)
        weight[tokenizer.eos_token_id] = row.to(weight.dtype)


TRAP_RUNS = (1, 4, 16, 64, 256, 1024)  # trap run lengths the fit sees, from entry to near a long cap


def _generation_like_contexts(tokenizer, spec: TinyModelSpec, trap: int) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per context: a prompt, then what the actor samples
    (near-uniform ordinary tokens), some with a trap run and ordinary tokens after it."""
    rng = random.Random(spec.seed)
    ordinary = [t for t in range(len(SPECIAL_TOKENS), spec.vocab_size) if t != trap]
    prompts = [tokenizer(r["input"])["input_ids"] for r in prompt_records()]
    contexts = []
    for run in (0,) * 8 + TRAP_RUNS:
        prompt = rng.choice(prompts)
        ids = prompt + rng.choices(ordinary, k=rng.randint(1, 256)) + [trap] * run + rng.choices(ordinary, k=32)
        contexts.append((ids, len(prompt)))
    return contexts


def fit_trap(actor, tokenizer, spec: TinyModelSpec) -> None:
    """Long-tail actor (see the module docstring). Embeddings: coordinate 0 is
    `shared_feature` for every token, coordinate 1 is `trap_feature` for the trap and 0
    otherwise. Then the EOS and trap rows of `lm_head` are least-squares fitted on final
    hidden states at response positions to the logits that give spec's probabilities
    in each regime (logit_x = log(p_x / p_rest) + logsumexp(other logits))."""
    import torch

    (trap,) = tokenizer.encode(spec.trap_token)  # must be a single token
    eos = tokenizer.eos_token_id
    weight = actor.lm_head.weight  # (V, H)
    others = torch.ones(weight.shape[0], dtype=torch.bool)
    others[[eos, trap]] = False
    with torch.no_grad():
        # A shared coordinate lets a row give the same logit at every position (random
        # hidden states alone drift with position); the trap coordinate marks the trap.
        emb = actor.model.embed_tokens.weight
        emb[:, 0] = spec.shared_feature
        emb[:, 1] = 0.0
        emb[trap, 1] = spec.trap_feature
        hidden, in_trap = [], []
        for ids, prompt_len in _generation_like_contexts(tokenizer, spec, trap):
            h = actor.model(input_ids=torch.tensor([ids])).last_hidden_state[0].float()
            hidden.append(h[prompt_len - 1 :])  # positions whose next token is part of the response
            in_trap.append(torch.tensor(ids[prompt_len - 1 :]) == trap)
        hidden = torch.cat(hidden)  # (N, H)
        in_trap = torch.cat(in_trap).long()  # (N,) regime 0/1
        # wanted[regime] = (P(EOS), P(trap)) of the next token; regime 1: current token is the trap
        wanted = torch.tensor([[spec.eos_prob, spec.trap_entry_prob], [spec.trap_eos_prob, spec.trap_stay_prob]])
        others_lse = torch.logsumexp(hidden @ weight[others].float().T, dim=-1)  # (N,)
        target = torch.log(wanted / (1 - wanted.sum(-1, keepdim=True)))[in_trap] + others_lse[:, None]  # (N, 2)
        # Both regimes weigh the same, however many positions each has.
        row_weight = (1 / torch.bincount(in_trap, minlength=2).float())[in_trap].sqrt()[:, None]
        rows = torch.linalg.lstsq(hidden * row_weight, target * row_weight).solution  # (H, 2)
        weight[eos], weight[trap] = rows[:, 0].to(weight.dtype), rows[:, 1].to(weight.dtype)


def build(root: Path | str | None = None, spec: TinyModelSpec = TinyModelSpec(), force: bool = False) -> TinyAssets:
    """Build the assets under `root` (default ~/.cache/openrlhf_oppo/tiny) unless
    already built. Deterministic for a given spec."""
    import torch
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

    assets = TinyAssets(Path(root).expanduser() if root else DEFAULT_ASSETS_DIR)
    if assets.is_built(spec) and not force:
        return assets
    assets.root.mkdir(parents=True, exist_ok=True)
    (assets.root / "BUILD_OK").unlink(missing_ok=True)

    tokenizer = build_tokenizer(assets.tokenizer, spec.vocab_size)
    assert len(tokenizer) <= spec.vocab_size, (len(tokenizer), spec.vocab_size)

    torch.manual_seed(spec.seed)
    actor = Qwen2ForCausalLM(_qwen2_config(spec, tokenizer))
    if spec.trap_token is None:
        fit_eos_probability(actor, tokenizer, spec.eos_prob)
    else:
        fit_trap(actor, tokenizer, spec)
    actor = actor.to(torch.bfloat16)
    actor.save_pretrained(assets.actor)
    tokenizer.save_pretrained(assets.actor)

    torch.manual_seed(spec.seed + 1)
    reward = Qwen2ForSequenceClassification(_qwen2_config(spec, tokenizer, num_labels=1)).to(torch.bfloat16)
    reward.save_pretrained(assets.reward)
    tokenizer.save_pretrained(assets.reward)

    with assets.prompts.open("w") as f:
        for rec in prompt_records():
            f.write(json.dumps(rec) + "\n")
    (assets.root / "BUILD_OK").write_text(build_marker(spec))
    return assets
