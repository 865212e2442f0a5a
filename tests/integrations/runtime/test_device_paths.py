"""GPU paths walked without a GPU (STYLE.md 27): the streaming scorers and actors, and the DeepSpeed
actor's experience and training inputs, with the models' weights on a fake `cuda:0`
(`compat.fake_cuda`), where a CPU tensor that reaches a CUDA op fails as it would on a GPU.

- the scorers (`models/streaming.py`, `prefill.py`, `padded_batch.py`): open, batched extends
  past the KV budget (eviction and re-prefill), an out-of-memory retry, finish; the reward,
  reference and critic scorers;
- the streaming reward and reference actors (`integrations/runtime/scorer.py`): load from disk,
  the size check, the move to the device the process sees, `process`;
- the DeepSpeed actor: OpenRLHF 0.11.2's `PolicyModelActor.forward` on OPPO's length-bucketed
  experience micro-batches (`micro_batches.bucket_experience_making`), and OpenRLHF's
  `ActorPPOTrainer.ppo_train` over OPPO's bucketed training micro-batches
  (`micro_batches.wrap_iter_grad_accum`) with OPPO's streamed reference log-probs
  (`reference.action_logprobs`), up to `strategy.backward`.

What cannot run under fake tensors, and how each path stands without it:
- values: `.item()` / `.tolist()` read data that fake tensors do not hold; `_reads_ones` answers
  them with ones (the checks are about devices, not numbers: the CPU tests of each module check
  the numbers);
- pinned memory: fake tensors have no `aten._pin_memory`, so the training check runs with
  OpenRLHF's `pin_memory` off; the pinning of bucketed micro-batches is
  `test_micro_batches.py::test_on_a_gpu_bucketed_micro_batches_are_pinned_as_openrlhfs_loader_pins_them`
  (GPU tier);
- a one-element CPU tensor made under `torch.inference_mode()` cannot be moved to the fake device
  (the fake mode propagates it as a constant and asks the CPU build for a CUDA copy): the
  reference scorer's checks score at least two tokens a call; that move is the same one the
  checks make with more tokens;
- safetensors' `load_file` (the OpenRLHF-layout loader's read) makes real tensors inside the fake
  mode, which `Module.to` then cannot swap for fake ones: the actor check loads a transformers-
  layout checkpoint (the same move and scorer); the OpenRLHF layout's parts on the device are the
  critic scorer's check (`OpenRLHFCriticModel`);
- autograd, DeepSpeed's engine (ZeRO-3 partitions, the optimizer) and collectives do not run:
  `strategy` is a stand-in whose `backward` receives the loss, whose device the check reads.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorDeviceMismatchError
from torch.overrides import TorchFunctionMode
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

from openrlhf_oppo.compat.fake_cuda import CUDA, fake_cuda, is_fake_cuda
from openrlhf_oppo.integrations.runtime import micro_batches, reference
from openrlhf_oppo.models import (
    OpenRLHFCriticModel,
    StreamingCriticScorer,
    StreamingReferenceScorer,
    StreamingRewardScorer,
)
from openrlhf_oppo.models.device_memory import OutOfMemoryError

VOCAB = 64
GIB = 2**30


def _config() -> Qwen2Config:
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=0, num_labels=1)
    config._attn_implementation = "sdpa"
    return config


def _reward_model() -> Qwen2ForSequenceClassification:
    torch.manual_seed(0)
    return Qwen2ForSequenceClassification(_config()).eval()


def _causal_lm() -> Qwen2ForCausalLM:
    torch.manual_seed(1)
    return Qwen2ForCausalLM(_config()).eval()


def _critic() -> OpenRLHFCriticModel:
    torch.manual_seed(2)
    config = _config()
    config.mean, config.std = 0.5, 2.0
    return OpenRLHFCriticModel(config, value_head_prefix="value_head", normalize_reward=True).eval()


def _nested(shape: tuple[int, ...], value):
    return value if not shape else [_nested(shape[1:], value) for _ in range(shape[0])]


class _ReadsOnes(TorchFunctionMode):
    """Inside `fake_cuda`: a fake tensor's `.item()` / `.tolist()` read as ones of its shape (see the
    module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.item, torch.Tensor.tolist) and isinstance(args[0], FakeTensor):
            one = 1.0 if args[0].is_floating_point() else 1
            return one if func is torch.Tensor.item else _nested(tuple(args[0].shape), one)
        return func(*args, **kwargs)


def _reads_ones() -> _ReadsOnes:
    return _ReadsOnes()


# ---- the streaming scorers ----------------------------------------------------------------------


def _walk(scorer, extra: dict | None = None) -> dict:
    """Open three sequences, extend them twice past an 8-token KV budget (evictions, then
    re-prefills), retry one forward after a device out-of-memory, finish them; returns `finish`'s."""
    extra = extra or {}
    scorer.open(1, [5, 6, 7], **extra)
    scorer.open(2, [8, 9], **extra)
    scorer.open(3, [10], **extra)
    scorer.extend_many({1: [11, 12], 2: [13, 14, 15], 3: [16, 17]}, **extra)
    forward = scorer._engine.backbone.forward
    failures = []

    def out_of_memory_once(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise OutOfMemoryError("CUDA out of memory (injected)")
        return forward(*args, **kwargs)

    scorer._engine.backbone.forward = out_of_memory_once
    try:
        scorer.extend_many({1: [18, 19], 2: [20, 21], 3: [22, 23]}, **extra)
    finally:
        del scorer._engine.backbone.forward
    stats = scorer.stats()
    assert stats.evictions > 0 and stats.reprefilled_tokens > 0 and stats.oom_retries == 1, stats
    return scorer.finish_many({1: [24, 25], 2: [26, 27], 3: [28, 29]}, **extra)


@pytest.mark.parametrize("kind", ["reward", "reference", "critic"])
def test_the_scorers_run_with_their_weights_on_the_device(kind):
    models = {"reward": _reward_model, "reference": _causal_lm, "critic": _critic}
    model = models[kind]()
    scorers = {"reward": StreamingRewardScorer, "reference": StreamingReferenceScorer, "critic": StreamingCriticScorer}
    scorer = scorers[kind](model, kv_budget_tokens=8)  # built first: the critic reads its mean/std values
    with fake_cuda(model), _reads_ones():
        out = _walk(scorer)
        assert all(is_fake_cuda(p) for p in model.parameters())
    if kind == "reward":
        assert out == {1: 1.0, 2: 1.0, 3: 1.0}
    else:  # one number per response token: 2 + 2 + 2
        assert {seq_id: len(values) for seq_id, values in out.items()} == {1: 6, 2: 7, 3: 6}


def test_a_cpu_tensor_planted_in_a_scorer_fails_the_check():
    """The check can fail: a value head left on the CPU meets the device's hidden states."""
    model = _reward_model()
    scorer = StreamingRewardScorer(model, kv_budget_tokens=8)
    head = model.score
    model.score = torch.nn.Identity()  # the head stays out of the fake conversion: CPU weights
    scorer.parts = scorer.parts.__class__(**{**scorer.parts.__dict__, "value_head": head})
    with fake_cuda(model), _reads_ones():
        with pytest.raises(FakeTensorDeviceMismatchError, match="cpu"):
            _walk(scorer)


# ---- the streaming reward and reference actors ----------------------------------------------------


@pytest.fixture
def a_gpu(monkeypatch):
    """What `torch.cuda.mem_get_info` says inside `fake_cuda` (which leaves it alone): 70 of 80 GiB free."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (70 * GIB, 80 * GIB))


def test_the_streaming_reward_actor_loads_moves_and_scores_on_the_device(tmp_path, a_gpu):
    from openrlhf_oppo.integrations.runtime.scorer import StreamingRewardActor

    _reward_model().save_pretrained(tmp_path)
    with fake_cuda(), _reads_ones():
        actor = StreamingRewardActor(str(tmp_path), 0, True, "score", param_dtype="bf16")
        parts = actor.scorer.parts
        assert all(is_fake_cuda(p) for p in parts.backbone.parameters()) and is_fake_cuda(parts.value_head.weight)
        actor.open_many({1: [5, 6, 7], 2: [8, 9]})
        actor.process({1: [10, 11], 2: [12, 13]}, {})
        reply = actor.process({}, {1: [14, 15], 2: [16, 17]})
    assert set(reply.scores) == {1, 2} and reply.kv_tokens == 0


def test_the_streaming_reference_actor_loads_moves_and_scores_on_the_device(tmp_path, a_gpu):
    from openrlhf_oppo.integrations.runtime.scorer import StreamingReferenceActor

    _causal_lm().save_pretrained(tmp_path)
    with fake_cuda(), _reads_ones():
        actor = StreamingReferenceActor(str(tmp_path), 0, 0.7, param_dtype="bf16")
        assert all(is_fake_cuda(p) for p in actor.scorer.parts.backbone.parameters())
        actor.open_many({1: [5, 6, 7], 2: [8, 9]})
        actor.process({1: [10, 11], 2: [12, 13]}, {})
        reply = actor.process({}, {1: [14, 15], 2: [16, 17]})
    assert {seq_id: len(values) for seq_id, values in reply.scores.items()} == {1: 4, 2: 4}


# ---- the DeepSpeed actor's experience and training inputs ---------------------------------------


def _openrlhf_actor(lm):
    from openrlhf.models import Actor

    actor = Actor(lm)  # OpenRLHF's wrapper around a model it is handed (as its tests build it)
    actor.packing_samples = False
    return actor


def _rollout(lengths: list[int], prompt_tokens: int = 3) -> list:
    """Single-sample experiences as OPPO's generator hands them to experience making (CPU tensors),
    with OPPO's streamed reference log-probs attached."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    gen = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(lengths):
        sequences = torch.randint(1, VOCAB, (1, prompt_tokens + n), generator=gen)
        action_mask = torch.ones(1, n, dtype=torch.bool)
        streamed = reference.action_logprobs(action_mask[0], [-1.0] * n)
        out.append(Experience(sequences=sequences, attention_mask=torch.ones_like(sequences), action_mask=action_mask,
                              base_action_log_probs=streamed[None], info={}, prompts=[f"p{i // 2}"], labels=["l"]))
    return out


def _bucketing_maker():
    """OpenRLHF 0.11.2's `RemoteExperienceMaker` with what `bucket_experience_making` reads."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    ns = SimpleNamespace
    maker = object.__new__(RemoteExperienceMaker)
    maker.strategy = ns(args=ns(train=ns(dynamic_batch_enable=False), rollout=ns(micro_batch_size=2)))
    maker.tokenizer = ns(pad_token_id=0)
    maker.actor_model_group = ns(_actor_handlers=["rank0"], duplicate_actors=1)
    micro_batches.bucket_experience_making(maker)
    return maker


def test_the_actors_experience_forward_runs_on_the_device_on_bucketed_micro_batches():
    """OpenRLHF's `PolicyModelActor.forward` (the old log-probs of experience making) moves the
    inputs the driver sends; OPPO's bucketed micro-batches are such inputs."""
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    PolicyModelActor = PolicyModelActor.__ray_metadata__.modified_class  # the class under Ray's actor wrapper
    batches = _bucketing_maker().split_rollout_samples(_rollout([3, 9, 2, 7, 5]))
    assert all(b.sequences.device.type == "cpu" for b in batches)  # as the driver sends them
    lm = _causal_lm()
    actor = object.__new__(PolicyModelActor)
    actor.actor = _openrlhf_actor(lm)
    actor.strategy = SimpleNamespace(ring_attn_group=None)
    with fake_cuda(lm), _reads_ones():
        for batch in batches:
            log_probs = actor.forward(batch.sequences, batch.action_mask, batch.attention_mask)
            assert log_probs.shape == batch.action_mask.shape and log_probs.device.type == "cpu"


def _trainer(lm, experiences: list):
    """OpenRLHF 0.11.2's `ActorPPOTrainer` with what `ppo_train` and `training_step` read; the
    DeepSpeed strategy a stand-in that receives each loss (no autograd under fake tensors)."""
    from openrlhf.models import PolicyLoss
    from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    ns = SimpleNamespace
    buffer = NaiveReplayBuffer(sample_batch_size=2, cpu_offload=True)
    buffer.items.extend(experiences)
    losses = []
    trainer = object.__new__(ActorPPOTrainer)
    trainer.args = ns(train=ns(dynamic_batch_enable=False), ds=ns(tensor_parallel_size=1), actor=ns(entropy_coef=None),
                      algo=ns(kl=ns(use_loss=True, init_coef=0.01, estimator="k3", unbiased_gradient=False)))
    trainer.strategy = ns(ring_attn_group=None, accumulated_gradient=2, backward=lambda loss, *a: losses.append(loss),
                          optimizer_step=lambda *a, **k: None, get_grad_norm=lambda model: 0.0,
                          all_reduce=lambda status: status, is_rank_0=lambda: False)
    trainer.replay_buffer = buffer
    trainer.max_epochs = 1
    trainer.dataloader_pin_memory = False  # no pinned memory under fake tensors (module doc)
    trainer.actor = _openrlhf_actor(lm)
    trainer.actor_loss_fn = PolicyLoss()
    trainer.actor_optim = None
    trainer.actor_scheduler = ns(get_last_lr=lambda: [0.0])
    trainer.aux_loss = False
    trainer.ema_model = None
    return trainer, losses


def _replay_items(lengths: list[int]) -> list:
    """Replay-buffer items (one sample each, CPU) as `make_experience` leaves them: OpenRLHF's
    fields, the reference log-probs OPPO streamed."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    gen = torch.Generator().manual_seed(1)
    items = []
    for n in lengths:
        t = 3 + n
        items.append(Experience(
            sequences=torch.randint(1, VOCAB, (t,), generator=gen), attention_mask=torch.ones(t, dtype=torch.long),
            action_mask=torch.ones(n, dtype=torch.bool), advantages=torch.randn(n, generator=gen),
            action_log_probs=-torch.rand(n, generator=gen),
            base_action_log_probs=reference.action_logprobs(torch.ones(n), [-0.5] * n),
            total_length=torch.tensor(t), response_length=torch.tensor(n)))
    return items


@pytest.fixture
def bucketed_ppo_actor(monkeypatch):
    """OpenRLHF's `ppo_actor` module with OPPO's length buckets installed (undone after)."""
    from openrlhf.trainer.ray import ppo_actor

    monkeypatch.setattr(ppo_actor, "iter_grad_accum_global_norm", ppo_actor.iter_grad_accum_global_norm)
    micro_batches.wrap_iter_grad_accum(ppo_actor)
    return ppo_actor


def test_the_actors_training_step_runs_on_the_device_on_bucketed_micro_batches(bucketed_ppo_actor):
    lm = _causal_lm()
    trainer, losses = _trainer(lm, _replay_items([3, 9, 2, 7, 5, 4, 8, 1]))
    with fake_cuda(lm), _reads_ones():
        status = trainer.ppo_train(kl_ctl=0.01)
    assert len(losses) == 4 and all(loss.device == CUDA and loss.shape == () for loss in losses)
    assert micro_batches.PADDING_SAVED in status  # the micro-batches were OPPO's


def test_a_cpu_tensor_planted_in_the_training_inputs_fails_the_check(bucketed_ppo_actor, monkeypatch):
    """The check can fail: advantages that stay on the CPU meet the device's log-probs in the loss."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    to_device = Experience.to_device

    def all_but_advantages(self, device):
        advantages = self.advantages
        to_device(self, device)
        self.advantages = advantages
        return self

    monkeypatch.setattr(Experience, "to_device", all_but_advantages)
    lm = _causal_lm()
    trainer, losses = _trainer(lm, _replay_items([3, 9, 2, 7]))
    with fake_cuda(lm), _reads_ones():
        with pytest.raises(FakeTensorDeviceMismatchError, match="cpu"):
            trainer.ppo_train(kl_ctl=0.01)
    assert losses == []

