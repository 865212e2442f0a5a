"""Old log-probs from the rollout where they are exact (`--oppo.train.old_logprobs rollout`,
`integrations.runtime.old_logprobs`): which samples go through the actor's forward (any token of
older weights, hand-built versions), and OpenRLHF 0.11.2's own `make_experience` run with the
actor's forward being OpenRLHF's `Actor` on a tiny model: fresh rows take the rollout's values,
stale rows exactly what OpenRLHF's forward gives them in its own micro-batches, the forward sees
only stale sequences, each once, in a multiple of the data-parallel ranks. How far vLLM's CPU
kernels lie from the DeepSpeed actor is measured by the end-to-end run (`tests/e2e`), which audits
its first step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="OpenRLHF's trainer imports Ray (scripts/gpu_checks.sh carries none)")
import torch

from openrlhf_oppo import compat

compat.apply()  # before OpenRLHF's models: they import CUDA-only kernels otherwise

from openrlhf.models import Actor  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # noqa: E402
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402
from transformers import Qwen2ForCausalLM  # noqa: E402

from openrlhf_oppo.core import TrainSample  # noqa: E402
from openrlhf_oppo.integrations.runtime import old_logprobs  # noqa: E402
from openrlhf_oppo.integrations.runtime.openrlhf_executor import response  # noqa: E402

TEMPERATURE = 0.7
MAX_LEN = 14  # the last sample's response is truncated to it
VERSION = 3  # the batch's policy version: the weights the actor holds
MARK = 0.5  # fresh samples' "rollout" log-probs = the forward's + MARK, to tell the sources apart
# (prompt ids, response ids, version runs); samples 0 and 3 hold equal tokens, 3 of them stale
SAMPLES = [
    ([5, 6, 7], [8], [(0, VERSION)]),
    ([9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19, 20], [(0, VERSION)]),
    ([21, 22], [23, 24, 25, 2], [(0, VERSION - 1), (3, VERSION)]),  # one older token: recomputed
    ([5, 6, 7], [8], [(0, VERSION - 1)]),
    ([30, 31, 32, 33], [34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44], [(0, VERSION)]),
    ([3, 4], [40, 41, 42], [(0, VERSION - 2)]),
    ([50, 51, 52], [53, 54], [(0, VERSION)]),
    ([55], [56, 57, 58, 59, 60], [(0, VERSION)]),
]
STALE = {2, 3, 5, 0}  # 0: fresh, but its tokens are also a stale sample's


def sample(sid: int, logprobs: list[float] | None = None) -> TrainSample:
    _, resp, runs = SAMPLES[sid]
    lps = logprobs if logprobs is not None else [-1.0] * len(resp)
    return TrainSample(sid, sid, "stop", [resp], [lps], runs)


@pytest.fixture(scope="module")
def actor(tiny_qwen2):
    model = Qwen2ForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32, attn_implementation="sdpa").eval()
    out = Actor(model, temperature=TEMPERATURE)
    out.packing_samples = False  # OpenRLHF 0.11.2's Actor(model object) leaves it unset
    return out


def experiences() -> list[Experience]:
    """One single-sample Experience per sample, made by OpenRLHF's own code from what OPPO's generator hands it."""
    out = []
    for sid, (prompt_ids, resp, _) in enumerate(SAMPLES):
        s = SimpleNamespace(token_ids=resp, finish_reason="stop", rollout_logprobs=[])
        r = response(f"prompt {sid}", "", prompt_ids, s, {"reward": 0.0}, False)
        exp = SamplesGenerator._process_response_into_experience(None, r, max_len=MAX_LEN)
        exp.index = [sid]
        out.append(exp)
    return out


def forward(actor, exp: Experience) -> torch.Tensor:
    with torch.no_grad():
        return actor(exp.sequences, exp.action_mask, exp.attention_mask).float()


class Group:
    """The actor's `RayActorGroup`: `ranks` data-parallel ranks; its forward is OpenRLHF's `Actor` on
    each micro-batch (results per rank, as `async_run_method_batch` returns them)."""

    def __init__(self, actor, ranks: int) -> None:
        self.actor = actor
        self._actor_handlers = [object()] * ranks
        self.duplicate_actors = 1
        self.calls: list[dict] = []

    def run(self, **kwargs) -> list[list[torch.Tensor]]:
        self.calls.append(kwargs)
        n = len(kwargs["sequences"])
        ranks = len(self._actor_handlers)
        assert n % ranks == 0, "every rank makes as many forward calls (ZeRO-3)"
        per = n // ranks
        outs = []
        for i in range(n):
            with torch.no_grad():
                outs.append(self.actor(kwargs["sequences"][i], kwargs["action_mask"][i],
                                       kwargs["attention_mask"][i]).float())
        return [outs[r * per:(r + 1) * per] for r in range(ranks)]


def maker_for(group: Group, micro_batch_size: int, monkeypatch):
    """A `RemoteExperienceMaker` whose only model is the actor (rewards given, no KL), with Ray's object
    store replaced by the identity (the end-to-end run passes the refs through Ray)."""
    import ray

    monkeypatch.setattr(ray, "put", lambda value: value)
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    args = SimpleNamespace(ds=SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1),
                           train=SimpleNamespace(colocate_all=False, colocate_actor_ref=False,
                                                 colocate_critic_reward=False, dynamic_batch_enable=False),
                           rollout=SimpleNamespace(micro_batch_size=micro_batch_size),
                           algo=SimpleNamespace(kl=SimpleNamespace(use_loss=False, estimator="k1")))
    maker = object.__new__(RemoteExperienceMaker)
    maker.strategy = SimpleNamespace(args=args)
    maker.args = args
    maker.actor_model_group = group
    maker.critic_model_group = maker.initial_model_group = maker.reward_model_group = None
    maker.tokenizer = SimpleNamespace(pad_token_id=0)
    maker._dispatch_forward = lambda g, sync, **kw: g.run(**kw)
    return maker


def rollout_values(actor, exps) -> dict:
    """The generator's table for the batch: fresh samples' rollout log-probs (the forward's + MARK)."""
    table: dict = {}
    for sid, exp in enumerate(exps):
        values = (forward(actor, exp)[0][exp.action_mask[0].bool()] + MARK).tolist()
        values += [0.0] * (len(SAMPLES[sid][1]) - len(values))  # tokens past --rollout.max_len
        old_logprobs.keep(table, exp, sample(sid, values), VERSION)
    return table


def test_a_sample_is_fresh_only_when_every_token_is_the_batchs_version_and_has_a_log_prob():
    assert old_logprobs.is_fresh(sample(0), VERSION)
    assert not old_logprobs.is_fresh(sample(0), VERSION + 1)
    assert not old_logprobs.is_fresh(sample(2), VERSION)  # its first token is one version older
    assert not old_logprobs.is_fresh(sample(1, logprobs=[]), VERSION)  # not recorded
    assert not old_logprobs.is_fresh(TrainSample(9, 9, "stop", [[]], [[]], []), VERSION)  # no token


def test_the_table_keeps_rollout_values_of_fresh_samples_and_none_for_tokens_a_stale_sample_holds(actor):
    exps = experiences()
    table = rollout_values(actor, exps)
    keys = [old_logprobs.key(e.sequences[0], e.attention_mask[0]) for e in exps]
    assert len(table) == len(SAMPLES) - 1  # samples 0 and 3 share their tokens
    for sid, k in enumerate(keys):
        assert (table[k] is None) == (sid in STALE), sid
    # truncated to --rollout.max_len as OpenRLHF truncated the experience: the first action tokens
    assert table[keys[4]].numel() == int(exps[4].action_mask.sum()) == MAX_LEN - 4


@pytest.mark.parametrize("ranks,micro_batch_size", [(1, 2), (2, 2), (2, 3), (4, 1)])
def test_make_experience_takes_fresh_rows_from_the_rollout_and_stale_rows_from_the_forward(
        actor, monkeypatch, ranks, micro_batch_size):
    exps = experiences()
    group = Group(actor, ranks)
    maker = maker_for(group, micro_batch_size, monkeypatch)
    hook = old_logprobs.OldLogprobs(maker, rollout_values(actor, exps), audit_due=lambda: False)
    samples_list = [Experience.concat_experiences(exps[i:i + 2], 0) for i in range(0, len(exps), 2)]
    expected = [forward(actor, mb) for mb in samples_list]  # OpenRLHF's forward on its own micro-batches
    for mb in samples_list:
        mb.rewards = torch.zeros(mb.sequences.shape[0])
    RemoteExperienceMaker.make_experience(maker, samples_list)

    sent = [tuple(s[a.bool()].tolist()) for call in group.calls for seqs, attn in
            zip(call["sequences"], call["attention_mask"]) for s, a in zip(seqs, attn)]
    stale_keys = {old_logprobs.key(exps[i].sequences[0], exps[i].attention_mask[0]) for i in STALE}
    assert len(group.calls) == 1 and len(sent) == len(set(sent))  # each distinct sequence once
    assert stale_keys <= set(sent)
    fills = len(set(sent) - stale_keys)
    assert fills == max(0, ranks - len(stale_keys))  # fresh ones only where a rank would have none
    for mb, want in zip(samples_list, expected):
        got = mb.action_log_probs
        assert got.shape == want.shape and (got[~mb.action_mask.bool()] == 0).all()
        for j, sid in enumerate(mb.index):
            where = mb.action_mask[j].bool()
            k = old_logprobs.key(exps[sid].sequences[0], exps[sid].attention_mask[0])
            if sid in STALE or k in sent:
                assert torch.allclose(got[j, where], want[j, where], atol=2e-6, rtol=0), sid
            else:
                assert torch.allclose(got[j, where], want[j, where] + MARK, atol=2e-6, rtol=0), sid
    stats = hook.take_stats()
    recomputed = sum(1 for e in exps if old_logprobs.key(e.sequences[0], e.attention_mask[0]) in sent)
    assert stats == {old_logprobs.RECOMPUTED_SHARE: recomputed / len(exps),
                     old_logprobs.FRESH_SHARE: (len(exps) - len(STALE)) / len(exps)}
    assert hook.take_stats() == {}


def test_a_batch_without_stale_samples_makes_no_forward_call(actor, monkeypatch):
    exps = [e for sid, e in enumerate(experiences()) if sid not in STALE]
    group = Group(actor, 2)
    maker = maker_for(group, 2, monkeypatch)
    table = {}
    for e in exps:
        sid = e.index[0]
        old_logprobs.keep(table, e, sample(sid, [-0.25] * len(SAMPLES[sid][1])), VERSION)
    hook = old_logprobs.OldLogprobs(maker, table, audit_due=lambda: False)
    samples_list = [Experience.concat_experiences(exps[i:i + 2], 0) for i in range(0, len(exps), 2)]
    for mb in samples_list:
        mb.rewards = torch.zeros(mb.sequences.shape[0])
    RemoteExperienceMaker.make_experience(maker, samples_list)
    assert group.calls == []
    for mb in samples_list:
        assert torch.equal(mb.action_log_probs, -0.25 * mb.action_mask.float())
    assert hook.take_stats()[old_logprobs.RECOMPUTED_SHARE] == 0.0


def test_an_audited_batch_recomputes_everything_and_reports_the_mismatch(actor, monkeypatch):
    exps = experiences()
    group = Group(actor, 2)
    maker = maker_for(group, 2, monkeypatch)
    hook = old_logprobs.OldLogprobs(maker, rollout_values(actor, exps), audit_due=lambda: True)
    samples_list = [Experience.concat_experiences(exps[i:i + 2], 0) for i in range(0, len(exps), 2)]
    expected = [forward(actor, mb) for mb in samples_list]
    for mb in samples_list:
        mb.rewards = torch.zeros(mb.sequences.shape[0])
    RemoteExperienceMaker.make_experience(maker, samples_list)
    assert len(group.calls) == 1 and len(group.calls[0]["sequences"]) == len(samples_list)  # OpenRLHF's own call
    for mb, want in zip(samples_list, expected):
        assert torch.allclose(mb.action_log_probs, want, atol=2e-6, rtol=0)
    stats = hook.take_stats()
    assert stats[old_logprobs.RECOMPUTED_SHARE] == 1.0
    assert stats[old_logprobs.MISMATCH_KL] == pytest.approx(MARK, abs=1e-5)
    assert stats[old_logprobs.MISMATCH_ABS] == pytest.approx(MARK, abs=1e-5)


def test_fewer_distinct_sequences_than_ranks_fall_back_to_openrlhfs_forward(actor, monkeypatch):
    exps = experiences()[:2]
    group = Group(actor, 4)
    maker = maker_for(group, 1, monkeypatch)
    table = {}
    for sid, e in enumerate(exps):
        old_logprobs.keep(table, e, sample(sid), VERSION + 1)  # both stale
    old_logprobs.OldLogprobs(maker, table, audit_due=lambda: False)
    samples_list = [Experience.concat_experiences([e], 0) for e in exps] * 2  # 4 micro-batches, 2 sequences
    for mb in samples_list:
        mb.rewards = torch.zeros(1)
    RemoteExperienceMaker.make_experience(maker, samples_list)
    assert len(group.calls) == 1 and len(group.calls[0]["sequences"]) == 4


@pytest.mark.parametrize("sequences,size,ranks,count", [(3, 2, 1, 2), (3, 2, 2, 2), (5, 2, 2, 4), (7, 4, 4, 4),
                                                         (5, 1, 4, 8), (1, 4, 2, 2), (0, 4, 2, 0)])
def test_the_forward_takes_what_the_micro_batch_size_needs_in_a_multiple_of_the_ranks(sequences, size, ranks, count):
    assert old_logprobs.recompute_count(sequences, size, ranks) == count


def test_recompute_micro_batches_are_sorted_by_length_equal_sized_and_none_empty():
    lengths = [5, 1, 3, 2, 9]
    cuts = old_logprobs.recompute_micro_batches(lengths, 4)
    assert [len(c) for c in cuts] == [2, 1, 1, 1]
    assert sorted(i for c in cuts for i in c) == list(range(len(lengths)))
    flat = [lengths[i] for c in cuts for i in c]
    assert flat == sorted(flat)


def test_fresh_samples_fill_the_micro_batches_every_rank_needs(actor, monkeypatch):
    """3 distinct stale sequences, micro-batches of 1 on 4 ranks: 4 micro-batches, the shortest fresh
    sequence recomputed to fill the fourth."""
    exps = experiences()
    group = Group(actor, 4)
    maker = maker_for(group, 1, monkeypatch)
    hook = old_logprobs.OldLogprobs(maker, rollout_values(actor, exps), audit_due=lambda: False)
    samples_list = [Experience.concat_experiences(exps[i:i + 2], 0) for i in range(0, len(exps), 2)]
    for mb in samples_list:
        mb.rewards = torch.zeros(mb.sequences.shape[0])
    RemoteExperienceMaker.make_experience(maker, samples_list)
    assert [len(s) for s in group.calls[0]["sequences"]] == [1, 1, 1, 1]
    shortest_fresh = min((e for sid, e in enumerate(exps) if sid not in STALE), key=lambda e: e.sequences.shape[1])
    sent = {tuple(s[0][a[0].bool()].tolist()) for s, a in zip(group.calls[0]["sequences"],
                                                               group.calls[0]["attention_mask"])}
    assert old_logprobs.key(shortest_fresh.sequences[0], shortest_fresh.attention_mask[0]) in sent
    assert hook.take_stats()[old_logprobs.RECOMPUTED_SHARE] == 5 / 8  # 0, 2, 3, 5 and the filler


def test_resolve_falls_back_to_the_forward_where_rollout_log_probs_are_not_the_actors():
    def args(top_p=1.0):
        return SimpleNamespace(rollout=SimpleNamespace(top_p=top_p))

    assert old_logprobs.resolve("rollout", args()) == (True, None)
    assert old_logprobs.resolve("recompute", args(top_p=0.9)) == (False, None)
    on, warning = old_logprobs.resolve("rollout", args(top_p=0.9))
    assert not on and "--rollout.top_p 0.9" in warning and "--oppo.train.old_logprobs recompute" in warning
