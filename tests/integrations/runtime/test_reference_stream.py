"""The streamed reference (`--oppo.streaming.reference true`): a streaming reference actor's
per-token log-probs, chunk by chunk, placed in OpenRLHF's padded micro-batches
(`integrations.runtime.reference`), equal what OpenRLHF's reference `Actor.forward` computes on
the same micro-batches, truncation included; and `make_experience` gets them where it would
dispatch the reference group's forward."""

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

from openrlhf_oppo.integrations.runtime import reference  # noqa: E402
from openrlhf_oppo.integrations.runtime.openrlhf_executor import response  # noqa: E402
from openrlhf_oppo.integrations.runtime.scorer import StreamingReferenceActor  # noqa: E402

TEMPERATURE = 0.7  # --rollout.temperature: both sides divide the logits by it
MAX_LEN = 14  # --rollout.max_len: the last sample's response is truncated to it
# (prompt ids, response ids): lengths 1 to 11, and two samples with equal tokens
SAMPLES = [
    ([5, 6, 7], [8]),
    ([9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19, 20]),
    ([21, 22], [23, 24, 25, 2]),
    ([5, 6, 7], [8]),
    ([30, 31, 32, 33], [34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44]),
]


@pytest.fixture(scope="module")
def checkpoint(tiny_qwen2):
    return tiny_qwen2


def streamed(checkpoint, chunk: int) -> dict[int, list[float]]:
    """Every sample's log-probs from one streaming reference actor, its response sent `chunk`
    tokens at a time (each chunk a `process` call for all samples, the last with `finishes`)."""
    actor = StreamingReferenceActor(str(checkpoint), kv_budget_tokens=4096, temperature=TEMPERATURE)
    assert torch.is_grad_enabled()  # a scorer leaves the process's autograd alone (tests share one process)
    actor.open_many({sid: prompt for sid, (prompt, _) in enumerate(SAMPLES)})
    results: dict[int, list[float]] = {}
    sent = 0
    while len(results) < len(SAMPLES):
        extends, finishes = {}, {}
        for sid, (_, resp) in enumerate(SAMPLES):
            if sid in results:
                continue
            part = resp[sent:sent + chunk]
            (finishes if sent + chunk >= len(resp) else extends)[sid] = part
        results.update(actor.process(extends, finishes).scores)
        sent += chunk
    return results


def experiences() -> list[Experience]:
    """One single-sample Experience per sample, made by OpenRLHF's own code from what OPPO's
    generator hands it."""
    out = []
    for sid, (prompt_ids, resp) in enumerate(SAMPLES):
        sample = SimpleNamespace(token_ids=resp, finish_reason="stop", rollout_logprobs=[])
        r = response(f"prompt {sid}", "", prompt_ids, sample, {"reward": 0.0}, False)
        out.append(SamplesGenerator._process_response_into_experience(None, r, max_len=MAX_LEN))
    return out


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_streamed_reference_log_probs_equal_openrlhfs_reference_forward_in_its_micro_batches(checkpoint, chunk):
    model = Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa").eval()
    ref = Actor(model, temperature=TEMPERATURE)
    ref.packing_samples = False  # OpenRLHF 0.11.2's Actor(model object) leaves it unset
    results = streamed(checkpoint, chunk)
    exps = experiences()
    assert int(exps[-1].action_mask.sum()) == MAX_LEN - len(SAMPLES[-1][0]) < len(SAMPLES[-1][1])  # truncated
    kept: dict = {}
    for sid, exp in enumerate(exps):
        reference.keep(kept, exp, results[sid])
    assert len(kept) == len(SAMPLES) - 1  # two samples with equal tokens share one entry
    for batch in (exps[:2], exps[2:]):  # OpenRLHF's micro-batches: right-padded
        mb = Experience.concat_experiences(batch, pad_token_id=0)
        with torch.no_grad():
            expected = ref(mb.sequences, mb.action_mask, mb.attention_mask)
        got = reference.rows_for(kept, mb.sequences, mb.attention_mask, mb.action_mask)
        assert got.shape == expected.shape
        assert torch.allclose(got, expected.float(), atol=2e-6, rtol=0), (got - expected).abs().max()
        assert (got[~mb.action_mask.bool()] == 0).all()


def test_a_sample_without_streamed_log_probs_is_refused_not_trained_with_zeros(checkpoint):
    exps = experiences()
    mb = Experience.concat_experiences(exps[:2], pad_token_id=0)
    kept: dict = {}
    reference.keep(kept, exps[0], [0.0] * len(SAMPLES[0][1]))
    with pytest.raises(RuntimeError, match=r"row 1 of a micro-batch .* has no streamed reference log-probs"):
        reference.rows_for(kept, mb.sequences, mb.attention_mask, mb.action_mask)
    with pytest.raises(ValueError, match="the streamed reference has 3 log-probs for a sample with 7 action tokens"):
        reference.keep(kept, exps[1], [0.0] * 3)


def test_make_experience_gets_the_rows_where_it_would_dispatch_the_reference_forward(monkeypatch):
    """`_dispatch_forward` for the reference group answers with the streamed rows in the shape
    `_flatten_results` reads (one result per `duplicate_factor` copies); every other group's
    call is OpenRLHF's own. Ray's object store is replaced by the identity here (the end-to-end
    run passes them through Ray)."""
    import ray

    monkeypatch.setattr(ray, "put", lambda value: value)
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    exps = experiences()
    kept: dict = {}
    for exp in exps:
        reference.keep(kept, exp, [-1.0] * 20)
    own = []
    reference_group, critic_group = object(), object()
    args = SimpleNamespace(ds=SimpleNamespace(ring_attn_size=1, tensor_parallel_size=2))
    maker = SimpleNamespace(initial_model_group=reference_group, strategy=SimpleNamespace(args=args),
                            _dispatch_forward=lambda group, sync, **kw: own.append(group) or ["openrlhf"])
    reference.streamed_reference_forward(maker, kept)
    batches = [Experience.concat_experiences(exps[:2], 0), Experience.concat_experiences(exps[2:], 0)]
    kwargs = dict(sequences=[b.sequences for b in batches], action_mask=[b.action_mask for b in batches],
                  attention_mask=[b.attention_mask for b in batches])
    assert maker._dispatch_forward(critic_group, False, **kwargs) == ["openrlhf"] and own == [critic_group]
    refs = maker._dispatch_forward(reference_group, True, **kwargs)
    rows = RemoteExperienceMaker._flatten_results(maker, refs, 2)
    assert own == [critic_group] and len(rows) == 2
    for row, b in zip(rows, batches):
        assert torch.equal(row, -b.action_mask.float())


@pytest.mark.gpu
def test_on_cuda_in_bf16_the_streaming_reference_actor_matches_openrlhfs_reference_forward(checkpoint):
    """What a GPU run does (`--ds.param_dtype bf16`, the actor on the device `_on_device` picks):
    within a few bf16 steps of OpenRLHF's reference `Actor` on the same device; a chunked forward
    rounds in another order than a one-shot one."""
    model = Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, attn_implementation="sdpa")
    ref = Actor(model.to("cuda").eval(), temperature=TEMPERATURE)
    ref.packing_samples = False
    actor = StreamingReferenceActor(str(checkpoint), kv_budget_tokens=4096, temperature=TEMPERATURE,
                                    param_dtype="bf16")
    assert next(actor.scorer.parts.backbone.parameters()).device.type == "cuda"
    actor.open_many({sid: prompt for sid, (prompt, _) in enumerate(SAMPLES)})
    results = {**actor.process({sid: r[:2] for sid, (_, r) in enumerate(SAMPLES) if len(r) > 2}, {}).scores}
    results.update(actor.process({}, {sid: r[2:] if len(r) > 2 else r for sid, (_, r) in enumerate(SAMPLES)}).scores)
    kept: dict = {}
    exps = experiences()
    for sid, exp in enumerate(exps):
        reference.keep(kept, exp, results[sid])
    mb = Experience.concat_experiences(exps, pad_token_id=0)
    with torch.no_grad():
        expected = ref(mb.sequences.cuda(), mb.action_mask.cuda(), mb.attention_mask.cuda()).float().cpu()
    got = reference.rows_for(kept, mb.sequences, mb.attention_mask, mb.action_mask)
    tol = 8 * torch.finfo(torch.bfloat16).eps * expected.abs().clamp(min=1.0)
    assert ((got - expected).abs() <= tol).all(), (got - expected).abs().max()
