"""The task: reverse a list of words ("reverse: red cat blue dog =>" -> " dog blue cat red"),
its length laws, the ground-truth checker, the plausible mistakes and the records made
without a model (RL prompts, SFT records, hand-made preference pairs). The bottom of
`openrlhf_oppo.tasks.learn` (see its docstring); imports nothing of the package."""

from __future__ import annotations

import random
from dataclasses import dataclass

# The words the lists are made of (one BPE token each after a space).
WORDS = tuple(
    "red green blue black white cat dog bird fish cow one two three four five six seven eight nine ten "
    "sun moon star tree rock hat box cup pen map".split()
)
OP = "reverse"
ARROW = " =>"  # ends every prompt; the response starts with a space

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
        if u < self.p_long:
            band = self.long
        elif u < self.p_long + self.p_mid:
            band = self.mid
        else:
            band = self.short
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


def loop_response(gold: list[str], cap: int) -> list[str]:
    """The answer, then its last word again and again up to `cap` words, without an end: the
    degenerate repetition a language model falls into, which runs to the response cap. The
    `learn-longtail` SFT policy learns to do it after a share of its answers (`sft_records`)."""
    return gold + [gold[-1]] * max(0, cap - len(gold))


MISTAKES = {
    "swap": _swap,
    "drop": _drop,
    "repeat": _repeat,
    "substitute": _substitute,
    "unreversed": _unreversed,
    "truncate": _truncate,
    "run_on": _run_on,
    "loop": None,  # loop_response to the response cap (which `mistake` takes); draws nothing from rng
}


def mistake(kind: str, prompt: str, rng: random.Random, cap: int = RESPONSE_CAP) -> str | None:
    """A wrong answer of the given kind for `prompt`, or None where the kind does not apply;
    `cap` is the response cap a `loop` runs to."""
    source = parse_prompt(prompt)
    if kind == "loop":
        wrong = loop_response(source[::-1], cap)
    else:
        wrong = MISTAKES[kind](source[::-1], source, rng)
    return None if wrong is None else " ".join(wrong)


def ends(kind: str, words: int) -> bool:
    """Whether a mistake of `kind` with `words` words ends (EOS): a loop never does, a run-on
    not once it reaches RESPONSE_CAP."""
    return kind != "loop" and words < RESPONSE_CAP


def preference_pairs(n: int, seed: int, eos_token: str, lengths: LengthLaw = LengthLaw(),
                     kind_weights: dict[str, float] | None = None, cap: int = RESPONSE_CAP) -> list[dict]:
    """n pairs {"prompt", "chosen", "rejected", "kind"}: the gold response against one
    plausible mistake of a kind drawn from those that apply, with `kind_weights`
    (default: uniform); a `loop` runs to `cap` words."""
    weights = {kind: 1.0 for kind in MISTAKES} if kind_weights is None else kind_weights
    rng = random.Random(seed)
    pairs = []
    for rec in prompt_records(n, seed + 1, lengths):
        prompt = rec["input"]
        options = {kind: mistake(kind, prompt, rng, cap) for kind in MISTAKES}
        applicable = sorted(k for k, v in options.items() if v is not None and weights.get(k, 0) > 0)
        if not applicable:  # a one-word list admits only repeat and substitute
            raise ValueError(f"kind_weights {weights} give no applicable mistake for {prompt!r}")
        kind = rng.choices(applicable, weights=[weights[k] for k in applicable])[0]
        pairs.append({
            "prompt": prompt,
            "chosen": f" {rec['label']}{eos_token}",
            "rejected": f" {options[kind]}{eos_token if ends(kind, len(options[kind].split())) else ''}",
            "kind": kind,
        })
    return pairs



def sft_records(n: int, seed: int, eos_token: str, lengths: LengthLaw = LengthLaw(), loop_share: float = 0.0,
                loop_repeats: int = 24) -> list[dict]:
    """n SFT records {"input", "output"}: the response ends with EOS (so OpenRLHF's
    SFTDataset adds no " " + EOS of its own), except a `loop_share` of them (drawn from a
    generator of their own: 0 leaves the records as they were), whose response is the answer
    and its last word `loop_repeats` times more, without EOS: the trainer must not learn the
    EOS that OpenRLHF appends to such a record (`trainers.fp32_trainer_main`)."""
    pick = random.Random(seed + 7)
    records = []
    for r in prompt_records(n, seed, lengths):
        if loop_share and pick.random() < loop_share:
            gold = r["label"].split()
            loop = loop_response(gold, len(gold) + loop_repeats)
            records.append({"input": r["input"], "output": " " + " ".join(loop)})
        else:
            records.append({"input": r["input"], "output": f" {r['label']}{eos_token}"})
    return records
