"""Streamed scoring equals a one-shot forward, for any chunking, batching and KV budget.

Real tiny Qwen2 / Llama models built from a config in code (fp32, no hub); the
one-shot reference is the model's own forward on the whole sequence, and for a
transformers reward model under the default pooling OpenRLHF's own reward
model loading it (`openrlhf_reward_forward` in conftest.py), whose rule that is.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openrlhf_oppo.models import (
    CriticVersionError,
    SequenceStateError,
    StreamingCriticScorer,
    StreamingReferenceScorer,
    StreamingRewardScorer,
    TokenIdError,
    UnknownSequenceError,
)

VOCAB = 97  # tests/models/conftest.py
TOL = 1e-4
SETTINGS = dict(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Case:
    """One sequence and how its response is cut: chunks[:-1] go to extend, chunks[-1] to finish."""

    prompt: list[int]
    chunks: list[list[int]]

    @property
    def response(self) -> list[int]:
        return [t for c in self.chunks for t in c]


@st.composite
def cases(draw, min_response: int = 0, max_response: int = 40, min_first_chunk: int = 0) -> Case:
    """A random sequence and chunking; with `min_first_chunk`, chunk 0 has that many tokens and is not the last."""
    # token 0 is the pad id: drawn too, so responses ending in it exercise both poolings
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
    min_response = max(min_response, min_first_chunk + 1)
    response = draw(st.lists(st.integers(0, VOCAB - 1), min_size=min_response, max_size=max_response))
    cuts = sorted(draw(st.lists(st.integers(0, len(response)), max_size=6)))
    if min_first_chunk:
        cuts = sorted(
            [draw(st.integers(min_first_chunk, len(response) - 1)), *(c for c in cuts if c >= min_first_chunk)]
        )
    bounds = [0, *cuts, len(response)]
    return Case(prompt, [response[a:b] for a, b in zip(bounds, bounds[1:])])


def stream_many(scorer, batch: dict[int, Case], rng: random.Random, all_first: bool = False):
    """Drive a scorer as the actor would: each round a random subset of sequences sends its next chunk.

    With `all_first`, the first round extends every sequence. Returns (finish
    results, concatenated extend+finish-chunk outputs) per seq_id.
    """
    for seq_id, case in batch.items():
        scorer.open(seq_id, case.prompt)
    next_chunk = {seq_id: 0 for seq_id in batch}
    finished, per_chunk = {}, {seq_id: [] for seq_id in batch}
    first_round = all_first
    while next_chunk:
        ready = [s for s in next_chunk if first_round or rng.random() < 0.6] or [next(iter(next_chunk))]
        first_round = False
        extend, finish = {}, {}
        for seq_id in ready:
            k = next_chunk[seq_id]
            chunks = batch[seq_id].chunks
            (finish if k == len(chunks) - 1 else extend)[seq_id] = chunks[k]
            next_chunk[seq_id] = k + 1
        out = scorer.extend_many(extend)
        for seq_id, vals in (out or {}).items():
            per_chunk[seq_id].extend(vals)
        for seq_id, result in scorer.finish_many(finish).items():
            finished[seq_id] = result
            del next_chunk[seq_id]
        for seq_id in finish:
            if isinstance(finished[seq_id], list):
                n_last = len(batch[seq_id].chunks[-1])
                per_chunk[seq_id].extend(finished[seq_id][len(finished[seq_id]) - n_last :])
    return finished, per_chunk


# ---- one-shot references: the models' own forward -----------------------------------------


@torch.no_grad()
def one_shot_reward(model, ids: list[int]) -> float:
    out = model(torch.tensor([ids]))
    return float(out.logits[0, 0] if hasattr(out, "logits") else out[0])


@torch.no_grad()
def one_shot_logprobs(lm, prompt: list[int], response: list[int]) -> list[float]:
    logits = lm(torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    p = len(prompt)
    return [float(logp[p - 1 + k, t]) for k, t in enumerate(response)]


@torch.no_grad()
def one_shot_values(critic, prompt: list[int], response: list[int]) -> list[float]:
    ids = torch.tensor([prompt + response])
    return critic(ids, action_mask=torch.ones(1, len(response)))[0].tolist()


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    if want:
        assert max(abs(a - b) for a, b in zip(got, want)) <= TOL, (got, want)


# ---- equivalence ---------------------------------------------------------------------------


@settings(**SETTINGS)
@given(case=cases())
def test_streamed_reward_equals_openrlhfs_one_shot_for_any_chunking(
    hf_reward_model, hf_reward_forward_in_openrlhf, case
):
    """Default pooling ('last'): as OpenRLHF's reward model reads this checkpoint, pad ids drawn anywhere."""
    scorer = StreamingRewardScorer(hf_reward_model)
    scorer.open(7, case.prompt)
    for chunk in case.chunks[:-1]:
        scorer.extend(7, chunk)
    reward = scorer.finish(7, case.chunks[-1])
    assert abs(reward - hf_reward_forward_in_openrlhf(case.prompt + case.response)) <= TOL


@settings(**SETTINGS)
@given(case=cases())
def test_streamed_non_pad_reward_equals_its_forward_for_any_chunking(hf_reward_model, case):
    scorer = StreamingRewardScorer(hf_reward_model, pooling="non_pad")
    scorer.open(7, case.prompt)
    for chunk in case.chunks[:-1]:
        scorer.extend(7, chunk)
    reward = scorer.finish(7, case.chunks[-1])
    assert abs(reward - one_shot_reward(hf_reward_model, case.prompt + case.response)) <= TOL


@pytest.mark.parametrize(
    "prompt, chunks",
    [
        ([0, 5, 0], [[0], [0]]),  # rightmost non-pad is in the prompt
        ([0, 0], [[0], []]),  # no non-pad token at all: transformers reads position 0
        ([7, 0], [[0, 9], [0, 0], []]),
    ],  # a non-pad token inside an earlier chunk
)
def test_transformers_reward_reads_rightmost_non_pad_token_like_its_forward(hf_reward_model, prompt, chunks):
    scorer = StreamingRewardScorer(hf_reward_model, pooling="non_pad")
    scorer.open(0, prompt)
    for chunk in chunks[:-1]:
        scorer.extend(0, chunk)
    reward = scorer.finish(0, chunks[-1])
    ids = prompt + [t for c in chunks for t in c]
    assert abs(reward - one_shot_reward(hf_reward_model, ids)) <= TOL


@settings(**SETTINGS)
@given(case=cases())
def test_streamed_openrlhf_reward_equals_one_shot_with_normalisation(openrlhf_reward_model, case):
    scorer = StreamingRewardScorer(openrlhf_reward_model)
    assert scorer.parts.normalize and scorer.parts.layout == "openrlhf"
    scorer.open(0, case.prompt)
    for chunk in case.chunks[:-1]:
        scorer.extend(0, chunk)
    reward = scorer.finish(0, case.chunks[-1])
    assert abs(reward - one_shot_reward(openrlhf_reward_model, case.prompt + case.response)) <= TOL


@settings(**SETTINGS)
@given(case=cases())
def test_streamed_reference_logprobs_equal_one_shot_for_any_chunking(causal_lm, case):
    ref = StreamingReferenceScorer(causal_lm)
    ref.open(3, case.prompt)
    streamed = []
    for chunk in case.chunks[:-1]:
        got = ref.extend(3, chunk)
        assert len(got) == len(chunk)
        streamed.extend(got)
    final = ref.finish(3, case.chunks[-1])
    want = one_shot_logprobs(causal_lm, case.prompt, case.response)
    assert_close(final, want)
    assert_close(streamed, want[: len(streamed)])


def test_reference_temperature_divides_logits(causal_lm):
    prompt, response = [5, 6, 7], [8, 9, 10, 11]
    ref = StreamingReferenceScorer(causal_lm, temperature=0.7)
    ref.open(0, prompt)
    got = ref.finish(0, response)
    with torch.no_grad():
        logits = causal_lm(torch.tensor([prompt + response])).logits[0] / 0.7
    logp = torch.log_softmax(logits, -1)
    assert_close(got, [float(logp[2 + k, t]) for k, t in enumerate(response)])


@settings(**SETTINGS)
@given(batch=st.lists(cases(), min_size=2, max_size=5), rng=st.randoms(use_true_random=False))
def test_extend_many_mixing_cached_lengths_equals_one_shot(
    hf_reward_model, hf_reward_forward_in_openrlhf, causal_lm, batch, rng
):
    batch = dict(enumerate(batch))
    rewards, _ = stream_many(StreamingRewardScorer(hf_reward_model), batch, rng)
    logprobs, per_chunk = stream_many(StreamingReferenceScorer(causal_lm), batch, random.Random(rng.random()))
    for seq_id, case in batch.items():
        assert abs(rewards[seq_id] - hf_reward_forward_in_openrlhf(case.prompt + case.response)) <= TOL
        want = one_shot_logprobs(causal_lm, case.prompt, case.response)
        assert_close(logprobs[seq_id], want)
        assert_close(per_chunk[seq_id], want)


@settings(**SETTINGS)
@given(
    batch=st.lists(cases(min_first_chunk=3), min_size=3, max_size=5),
    rng=st.randoms(use_true_random=False),
    budget=st.integers(1, 11),
)
def test_tiny_kv_budget_evicts_and_reprefills_without_changing_results(
    openrlhf_reward_model, causal_lm, batch, rng, budget
):
    # The first round caches >= 3 * (1 + 3) = 12 tokens > budget: some sequence is evicted, and
    # re-prefilled when its next chunk comes (each has one).
    batch = dict(enumerate(batch))
    scorer = StreamingRewardScorer(openrlhf_reward_model, kv_budget_tokens=budget)
    ref = StreamingReferenceScorer(causal_lm, kv_budget_tokens=budget)
    rewards, _ = stream_many(scorer, batch, rng, all_first=True)
    logprobs, per_chunk = stream_many(ref, batch, random.Random(rng.random()), all_first=True)
    for seq_id, case in batch.items():
        assert abs(rewards[seq_id] - one_shot_reward(openrlhf_reward_model, case.prompt + case.response)) <= TOL
        want = one_shot_logprobs(causal_lm, case.prompt, case.response)
        assert_close(logprobs[seq_id], want)
        assert_close(per_chunk[seq_id], want)
    for s in (scorer, ref):
        stats = s.stats()
        assert stats.evictions > 0 and stats.reprefilled_tokens > 0
        assert stats.cached_tokens == 0  # everything finished: caches freed


def test_kv_budget_counts_evictions_and_reprefilled_tokens(causal_lm):
    # Two 10-token sequences under an 12-token budget: extending one evicts the other.
    ref = StreamingReferenceScorer(causal_lm, kv_budget_tokens=12)
    ref.open(0, [1] * 10)
    ref.open(1, [2] * 10)
    ref.extend(0, [3])  # seq 0 cached: 11 tokens
    ref.extend(1, [4])  # seq 1 needs 11: seq 0 (least recently extended) is evicted
    stats = ref.stats()
    assert stats.evictions == 1 and stats.reprefilled_tokens == 0 and stats.cached_tokens == 11
    got = ref.finish(0, [5, 6])  # seq 0 re-prefilled from its recorded 11 tokens, then 2 new
    stats = ref.stats()
    assert stats.evictions == 2 and stats.reprefilled_tokens == 11
    assert_close(got, one_shot_logprobs(causal_lm, [1] * 10, [3, 5, 6]))


def test_extend_many_is_one_batched_forward(causal_lm):
    ref = StreamingReferenceScorer(causal_lm)
    for seq_id, n in enumerate([3, 8, 1, 12]):
        ref.open(seq_id, list(range(1, n + 1)))
    ref.extend_many({0: [5], 1: [6, 7, 8], 2: [9, 9], 3: []})
    ref.extend_many({0: [1, 2, 3, 4], 1: [5], 2: [6, 6, 6], 3: [7]})  # different cached lengths now
    assert ref.stats().forward_calls == 2


@settings(**SETTINGS)
@given(batch=st.lists(cases(min_response=1), min_size=1, max_size=4), rng=st.randoms(use_true_random=False))
def test_streamed_critic_values_equal_one_shot(openrlhf_critic_model, batch, rng):
    batch = dict(enumerate(batch))
    critic = StreamingCriticScorer(openrlhf_critic_model, version=5, kv_budget_tokens=16)
    values, per_chunk = stream_many(critic, batch, rng)
    for seq_id, case in batch.items():
        want = one_shot_values(openrlhf_critic_model, case.prompt, case.response)
        assert_close(values[seq_id], want)
        assert_close(per_chunk[seq_id], want)


def test_critic_cache_is_valid_for_one_version(tiny):
    critic_v1 = tiny.openrlhf_model("critic", seed=10)
    critic = StreamingCriticScorer(critic_v1, version=1)
    critic.open(0, [4, 5, 6], version=1)
    critic.extend(0, [7, 8], version=1)
    with pytest.raises(CriticVersionError, match="version 1.*called with version 2"):
        critic.extend(0, [9], version=2)
    # The trainer updated the critic in place: its old caches are now wrong, reset drops them.
    critic_v1.load_state_dict(tiny.openrlhf_model("critic", seed=11).state_dict())
    critic.reset(2)
    with pytest.raises(UnknownSequenceError, match="reset from version 1 to 2"):
        critic.extend(0, [9])
    critic.open(0, [4, 5, 6], version=2)
    got = critic.finish(0, [7, 8, 9], version=2)
    assert_close(got, one_shot_values(critic_v1, [4, 5, 6], [7, 8, 9]))


# ---- errors -------------------------------------------------------------------------------


@pytest.fixture(params=["reward", "reference", "critic"])
def any_scorer(request, hf_reward_model, causal_lm, openrlhf_critic_model):
    if request.param == "reward":
        return StreamingRewardScorer(hf_reward_model)
    if request.param == "reference":
        return StreamingReferenceScorer(causal_lm)
    return StreamingCriticScorer(openrlhf_critic_model)


def test_unknown_seq_id_is_a_clear_error(any_scorer):
    for call in (
        lambda: any_scorer.extend(42, [1]),
        lambda: any_scorer.finish(42, []),
        lambda: any_scorer.drop(42),
        lambda: any_scorer.extend_many({42: [1]}),
    ):
        with pytest.raises(UnknownSequenceError, match="unknown seq_id 42"):
            call()


def test_extend_after_finish_is_a_clear_error(any_scorer):
    any_scorer.open(1, [1, 2])
    any_scorer.finish(1, [3])
    with pytest.raises(SequenceStateError, match="seq_id 1 is finished"):
        any_scorer.extend(1, [4])
    with pytest.raises(SequenceStateError, match="seq_id 1 is finished"):
        any_scorer.finish(1, [])
    any_scorer.drop(1)  # dropping a finished sequence is how its id is released
    any_scorer.open(1, [1, 2])


def test_open_twice_is_a_clear_error(any_scorer):
    any_scorer.open(1, [1, 2])
    with pytest.raises(SequenceStateError, match="seq_id 1 is already open"):
        any_scorer.open(1, [3])


@pytest.mark.parametrize("bad", [[VOCAB], [-1], [3, 10**6], [1.5], ["a"]])
def test_token_id_out_of_vocab_is_a_clear_error(any_scorer, bad):
    with pytest.raises(TokenIdError, match="seq_id 1"):
        any_scorer.open(1, bad)
    any_scorer.open(1, [1, 2])
    with pytest.raises(TokenIdError, match=r"outside the vocabulary \[0, 97\)|not an int token id"):
        any_scorer.extend(1, bad)


def test_empty_prompt_is_refused(any_scorer):
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        any_scorer.open(1, [])


def test_a_bad_entry_in_extend_many_changes_no_sequence(causal_lm):
    ref = StreamingReferenceScorer(causal_lm)
    ref.open(0, [1, 2])
    ref.open(1, [3, 4])
    with pytest.raises(TokenIdError):
        ref.extend_many({0: [5, 6], 1: [VOCAB + 1]})
    assert ref.stats().prefilled_tokens == 0
    assert_close(ref.finish(0, [5, 6]), one_shot_logprobs(causal_lm, [1, 2], [5, 6]))


def test_model_in_training_mode_is_refused(tiny):
    model = tiny.reward_model().train()
    with pytest.raises(ValueError, match="model.eval"):
        StreamingRewardScorer(model)


def test_causal_lm_is_not_a_reward_model(causal_lm):
    with pytest.raises(TypeError, match="ForSequenceClassification"):
        StreamingRewardScorer(causal_lm)
