"""learn-longtail's tail (openrlhf_oppo.tasks.learn): the loop mistake and the looping SFT
records, the trainer's mask of the EOS OpenRLHF gives a record without one, and sampling that
decodes on past the first cap."""

from __future__ import annotations

import random
import types

from openrlhf_oppo.tasks import learn
from openrlhf_oppo.tasks.learn import evaluation
from oppo_lab.learn import builder, trainers

EOS = "<|eos|>"


def test_a_loop_repeats_the_last_word_to_the_cap_without_an_end():
    rng = random.Random(0)
    state = rng.getstate()
    assert learn.mistake("loop", "reverse: red cat blue =>", rng, cap=8) == "blue cat red red red red red red"
    assert rng.getstate() == state  # draws nothing: adding the kind left the other kinds' pairs as they were
    pairs = learn.preference_pairs(300, seed=3, eos_token=EOS, kind_weights={"loop": 1.0, "swap": 1.0}, cap=100)
    loops = [p for p in pairs if p["kind"] == "loop"]
    assert loops and all(len(p["rejected"].split()) == 100 and not p["rejected"].endswith(EOS) for p in loops)
    assert all(p["rejected"].endswith(EOS) for p in pairs if p["kind"] == "swap")


def test_a_share_of_sft_records_loop_without_an_end():
    plain = learn.sft_records(2000, seed=3, eos_token=EOS)
    looped = learn.sft_records(2000, seed=3, eos_token=EOS, loop_share=0.1, loop_repeats=5)
    assert all(r["output"].endswith(EOS) for r in plain)
    loops = [(p, r) for p, r in zip(plain, looped, strict=True) if p != r]
    assert 150 < len(loops) < 250  # ~10 %, the same prompts either way
    for p, r in loops:
        gold = p["output"].removesuffix(EOS).split()
        assert r["input"] == p["input"] and r["output"].split() == gold + [gold[-1]] * 5


def test_a_record_without_an_end_does_not_train_the_eos_openrlhf_gives_it():
    import torch

    eos_id = 9

    class Dataset:  # the part of OpenRLHF's SFTDataset the wrapper reads, and its item layout
        pretrain_mode = False
        tokenizer = types.SimpleNamespace(eos_token=EOS)
        responses = [" cat red" + EOS, " cat red red red"]

        def getitem(self, idx):
            ids = torch.tensor([[1, 2, 3, 4, eos_id]])
            return ids, torch.ones_like(ids), torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])

    wrapped = trainers._unended_records_do_not_end(Dataset.getitem)
    ended, unended = wrapped(Dataset(), 0)[2], wrapped(Dataset(), 1)[2]
    assert ended.tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0]]  # as OpenRLHF makes it
    assert unended.tolist() == [[0.0, 1.0, 1.0, 0.0, 0.0]]  # the loss on the last token (EOS) is off


def test_sampling_decodes_on_past_the_first_cap(tmp_path):
    """A response still going at RESPONSE_CAP tokens decodes on, in a second pass, to
    max_new_tokens: every response ends with EOS or holds exactly max_new_tokens tokens."""
    spec = learn.LearnSpec()
    tok = learn.build_tokenizer(tmp_path / "tokenizer", spec.actor.vocab_size)
    assets = learn.LearnAssets(tmp_path)
    builder.init_actor(assets, spec, tok)  # random weights: EOS is rare, most responses run to the cap
    prompts = [learn.make_prompt(["red"] * n) for n in (1, 3, 9, 20)]
    cap = learn.RESPONSE_CAP + 11
    prompt_ids, responses = evaluation.sample_policy(assets.init_actor, prompts, cap, seed=0, batch_size=2)
    assert prompt_ids == [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    assert all(len(r) == cap or (r[-1] == tok.eos_token_id and len(r) <= cap) for r in responses)
    assert any(len(r) == cap for r in responses)
