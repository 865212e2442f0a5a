"""The tiny task's variants: `longtail`'s actor has the trap's next-token law it is
specified to have (a plain transformers forward on the built, bf16 actor), and the
default `tiny` spec is the one the OpenRLHF comparisons were made on."""

from __future__ import annotations

import random

import pytest
import torch

from openrlhf_oppo.tasks import tiny

LONGTAIL = tiny.VARIANTS["longtail"]


@pytest.fixture(scope="module")
def longtail_assets(tmp_path_factory) -> tiny.TinyAssets:
    return tiny.build(tmp_path_factory.mktemp("longtail"), LONGTAIL)


@torch.no_grad()
def next_token_probs(assets: tiny.TinyAssets) -> tuple[torch.Tensor, torch.Tensor]:
    """(P(EOS), P(trap)) of the next token at response positions of a few contexts
    (prompt, ordinary tokens, a trap run, ordinary tokens), split by whether the current
    token is the trap: ((N_ordinary, 2), (N_trap, 2))."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets.actor)
    actor = AutoModelForCausalLM.from_pretrained(assets.actor, dtype=torch.bfloat16)
    (trap,) = tokenizer.encode(LONGTAIL.trap_token)
    eos = tokenizer.eos_token_id
    ordinary = [t for t in range(len(tiny.SPECIAL_TOKENS), LONGTAIL.vocab_size) if t != trap]
    rng = random.Random(0)  # not the fit's seed: fresh contexts
    after_ordinary, after_trap = [], []
    for record, run in zip(tiny.prompt_records()[:4], (3, 40, 300, 1000)):
        prompt = tokenizer(record["input"])["input_ids"]
        ids = prompt + rng.choices(ordinary, k=60) + [trap] * run + rng.choices(ordinary, k=20)
        probs = torch.softmax(actor(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
        probs, current = probs[len(prompt) - 1 :][:, [eos, trap]], torch.tensor(ids[len(prompt) - 1 :])
        after_ordinary.append(probs[current != trap])
        after_trap.append(probs[current == trap])
    return torch.cat(after_ordinary), torch.cat(after_trap)


def test_longtail_actor_enters_the_trap_rarely_and_stays_in_it(longtail_assets):
    after_ordinary, after_trap = next_token_probs(longtail_assets)
    spec = LONGTAIL
    # After an ordinary token: EOS ~eos_prob and the trap ~trap_entry_prob, in the mean
    # and within a factor 2 at every position (the fit is linear, not exact).
    for column, wanted in ((0, spec.eos_prob), (1, spec.trap_entry_prob)):
        p = after_ordinary[:, column]
        assert abs(p.mean().item() / wanted - 1) < 0.15, (column, p.mean().item(), wanted)
        assert wanted / 2 < p.min().item() and p.max().item() < wanted * 2, (column, p.min().item(), p.max().item())
    # After the trap: the trap repeats with trap_stay_prob (mean run ~1 / (1 - stay)) and
    # EOS is rare, at every position of runs up to 1000 tokens.
    stay, eos = after_trap[:, 1], after_trap[:, 0]
    assert (stay - spec.trap_stay_prob).abs().max().item() < 0.0008, (stay.min().item(), stay.max().item())
    assert spec.trap_eos_prob / 1.5 < eos.min().item() and eos.max().item() < spec.trap_eos_prob * 1.5


def test_a_directory_built_for_one_variant_is_not_taken_for_another(longtail_assets):
    assert longtail_assets.is_built(LONGTAIL)
    assert not longtail_assets.is_built(tiny.VARIANTS["tiny"])


def test_default_tiny_spec_is_the_one_openrlhf_runs_were_compared_on():
    spec = tiny.VARIANTS["tiny"]
    assert spec == tiny.TinyModelSpec()
    assert (spec.vocab_size, spec.hidden_size, spec.intermediate_size, spec.num_hidden_layers) == (512, 64, 128, 2)
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.max_position_embeddings) == (2, 2, 512)
    assert (spec.seed, spec.eos_prob, spec.trap_token) == (1234, 0.01, None)  # no trap: only fit_eos_probability
    assert tiny.default_root("tiny") == tiny.DEFAULT_ASSETS_DIR


def test_unknown_task_variant_names_the_key_and_the_allowed_variants():
    from openrlhf_oppo.integrations.launch.train_run import _task_flags

    with pytest.raises(ValueError, match=r"task\.variant: unknown variant 'longtial'; allowed: tiny, longtail"):
        _task_flags({}, None, "longtial")
