"""Seeded rollouts (--train.full_determinism_enable): the seed function and the
patches of `seeding.PATCHES` on OpenRLHF 0.11.2's real classes, installed as the site hook
installs them on any hardware, with the engine and Ray calls
replaced by recorders (no vLLM engine is started here; the end-to-end equality with
`--schedule sync` is in tests/cli/test_train_oppo_on_cpu.py)."""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

import pytest

from openrlhf_oppo import compat
from openrlhf_oppo.hooks import install_hooks
from openrlhf_oppo.integrations.runtime import seeding
from openrlhf_oppo.integrations.runtime.seeding import SEED_KEY, request_seed

compat.apply()  # the flash-attn stand-in, where CUDA is absent
install_hooks(seeding.PATCHES)

samples_generator = pytest.importorskip("openrlhf.trainer.ppo_utils.samples_generator")
vllm_engine = pytest.importorskip("openrlhf.trainer.ray.vllm_engine")


def test_every_seeding_patch_names_its_upstream_version_and_why():
    for patch in seeding.PATCHES:
        assert "openrlhf 0.11.2" in patch.upstream
        doc = inspect.getdoc(patch.fn)
        assert doc and "0.11.2" in doc, patch.name


def test_seeding_patches_apply_where_cuda_is_present_too():
    """Not a CPU workaround: unlike compat's patches, none is gated on CUDA absence."""
    from unittest import mock

    import torch

    ns = SimpleNamespace(prepare_datasets=lambda strategy, tokenizer: None)
    original = ns.prepare_datasets
    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        seeding.seeded_prompt_order(ns)
    assert ns.prepare_datasets is not original
    assert not any(hasattr(p.fn, "__wrapped__") for p in seeding.PATCHES)


def test_request_seed_is_a_pure_function_of_every_coordinate():
    base = request_seed(42, 3, 1, "prompt", 0)
    assert base == request_seed(42, 3, 1, "prompt", 0) and 0 <= base < 2**63
    others = {request_seed(7, 3, 1, "prompt", 0), request_seed(42, 4, 1, "prompt", 0),
              request_seed(42, 3, 2, "prompt", 0), request_seed(42, 3, 1, "other", 0),
              request_seed(42, 3, 1, "prompt", 1)}
    assert base not in others and len(others) == 5


def test_upstream_dispatch_and_generate_responses_have_the_patched_shapes():
    cls = samples_generator.SamplesGenerator
    dispatch = inspect.getsource(cls._dispatch_prompts_to_vllm.__wrapped__)
    assert "sampling_params = SamplingParams(" in dispatch and "generate_responses.remote(" in dispatch
    params = list(inspect.signature(cls._dispatch_prompts_to_vllm.__wrapped__).parameters)
    assert params == ["self", "prompts", "labels", "images", "generate_kwargs"]
    actor_cls = vllm_engine.RolloutRayActor.__ray_metadata__.modified_class
    original = actor_cls.__mro__[1].generate_responses.__wrapped__
    assert [p for p in inspect.signature(original).parameters if p != "_ray_trace_ctx"] == [
        "self", "prompt", "label", "sampling_params", "max_length", "hf_tokenizer", "num_samples", "images"]
    assert "for _ in range(num_samples)" in inspect.getsource(original)
    # what a Ray actor of OpenRLHF's class runs is the patched method
    assert actor_cls.generate_responses is actor_cls.__mro__[1].generate_responses is not original


class _Recorder:
    def __init__(self, fn):
        self.remote = fn


def _driver(monkeypatch, deterministic: bool):
    calls = []
    engine = SimpleNamespace(
        generate_responses=_Recorder(lambda **kw: calls.append(kw) or len(calls)),
        get_num_unfinished_requests=_Recorder(lambda: 0),
    )
    monkeypatch.setattr(samples_generator.ray, "get", lambda refs: refs)
    gen = object.__new__(samples_generator.SamplesGenerator)
    gen.vllm_engines, gen.tokenizer = [engine], None
    gen.args = SimpleNamespace(
        train=SimpleNamespace(full_determinism_enable=deterministic, seed=42),
        rollout=SimpleNamespace(n_samples_per_prompt=2),
        algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level="off")),
    )
    gen._oppo_step = 3
    return gen, calls


def test_driver_tags_each_prompt_with_its_slot_under_full_determinism(monkeypatch):
    gen, calls = _driver(monkeypatch, deterministic=True)
    refs = gen._dispatch_prompts_to_vllm(["p0", "p1"], ["l0", "l1"], max_new_tokens=8)
    refs += gen._dispatch_prompts_to_vllm(["p2"], ["l2"], max_new_tokens=8)  # e.g. a filtered prompt's replacement
    assert refs == [1, 2, 3]
    assert [c["prompt"] for c in calls] == ["p0", "p1", "p2"]
    assert [c["sampling_params"].extra_args[SEED_KEY] for c in calls] == [[42, 3, 0], [42, 3, 1], [42, 3, 2]]
    assert calls[0]["sampling_params"].max_tokens == 8 and calls[0]["num_samples"] == 2
    assert samples_generator.SamplingParams.__name__ == "SamplingParams"  # restored after the call


def test_driver_dispatches_as_upstream_without_full_determinism(monkeypatch):
    gen, calls = _driver(monkeypatch, deterministic=False)
    gen._dispatch_prompts_to_vllm(["p0", "p1"], ["l0", "l1"], max_new_tokens=8)
    assert len(calls) == 2 and calls[0]["sampling_params"] is calls[1]["sampling_params"]
    assert calls[0]["sampling_params"].extra_args is None and calls[0]["sampling_params"].seed is None


def _engine_run(sampling_params, num_samples: int) -> list:
    async def execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        return {"seed": sampling_params.seed, "extra_args": sampling_params.extra_args}

    engine = vllm_engine.RolloutRayActor.__ray_metadata__.modified_class.__mro__[1]
    fake = SimpleNamespace(executor=SimpleNamespace(execute=execute))
    return asyncio.run(engine.generate_responses(fake, "p", "l", sampling_params, 64, None, num_samples))


def test_engine_runs_a_tagged_groups_samples_with_their_own_seeds():
    from vllm import SamplingParams

    out = _engine_run(SamplingParams(extra_args={SEED_KEY: [42, 3, 1]}), num_samples=3)
    assert [o["seed"] for o in out] == [request_seed(42, 3, 1, "p", j) for j in range(3)]
    assert all(o["extra_args"] is None for o in out)  # the tag does not reach vLLM


def test_engine_leaves_untagged_requests_to_the_engine_rng():
    from vllm import SamplingParams

    assert [o["seed"] for o in _engine_run(SamplingParams(), num_samples=2)] == [None, None]


def test_prompt_order_seed_comes_from_train_seed_under_full_determinism():
    import torch

    def prepare(strategy, tokenizer):  # as OpenRLHF's RandomSampler draws its shuffle seed
        return int(torch.empty((), dtype=torch.int64).random_().item())

    def strategy(deterministic):
        train = SimpleNamespace(full_determinism_enable=deterministic, seed=42)
        return SimpleNamespace(args=SimpleNamespace(train=train))

    ns = SimpleNamespace(prepare_datasets=prepare)
    seeding.seeded_prompt_order(ns)
    torch.manual_seed(1)
    first = ns.prepare_datasets(strategy(True), None)
    after = torch.rand(1)
    torch.manual_seed(2)
    assert ns.prepare_datasets(strategy(True), None) == first  # whatever the process drew before
    torch.manual_seed(1)
    assert ns.prepare_datasets(strategy(False), None) != first  # upstream behaviour without the flag
    torch.manual_seed(1)
    ns.prepare_datasets(strategy(True), None)
    assert torch.equal(torch.rand(1), after)  # the global RNG stream is left as it was
