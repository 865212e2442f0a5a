"""`task.fixed_lengths`: a sample's response length is a function of (seed, prompt, index in its
group), checked at launch, handed to every process in OPPO_FIXED_LENGTHS and applied by both
request paths: OpenRLHF's engines (the seeding patch, on OpenRLHF 0.11.2's real class with its
executor replaced by a recorder) and OPPO's `GroupPrompts.request`. vLLM decoding exactly that
length is checked end to end in tests/cli/test_train_oppo_on_cpu.py."""

from __future__ import annotations

import asyncio
import math
import statistics
from types import SimpleNamespace

import pytest

from openrlhf_oppo import compat, run_env
from openrlhf_oppo.hooks import install_hooks
from openrlhf_oppo.integrations.runtime import fixed_lengths, seeding
from openrlhf_oppo.integrations.runtime.fixed_lengths import FixedLengths
from openrlhf_oppo.integrations.runtime.seeding import SEED_KEY, request_seed

compat.apply()  # the flash-attn stand-in, where CUDA is absent
install_hooks(seeding.PATCHES)

vllm_engine = pytest.importorskip("openrlhf.trainer.ray.vllm_engine")
LENGTHS = FixedLengths(median_tokens=28, sigma=1.5, seed=42)


def test_a_length_is_a_function_of_seed_prompt_and_index_alone():
    assert LENGTHS.length("p", 0, 1024) == FixedLengths(28, 1.5, 42).length("p", 0, 1024)
    drawn = {LENGTHS.length("p", j, 1024) for j in range(8)} | {LENGTHS.length(f"p{i}", 0, 1024) for i in range(8)}
    assert len(drawn) > 8  # other samples and prompts draw other lengths
    assert {FixedLengths(28, 1.5, s).length("p", 0, 1024) for s in range(8)} != {LENGTHS.length("p", 0, 1024)}
    assert FixedLengths(28, 0.0).length("p", 3, 1024) == 27  # sigma 0: the median (int() of exp(log 28))
    assert FixedLengths(5000, 0.0).length("p", 0, 64) == 64 and FixedLengths(1, 0.0).length("p", 0, 8) == 1


def test_lengths_follow_the_log_normal_the_config_names():
    xs = [LENGTHS.length(f"prompt {i}", j, 1024) for i in range(2000) for j in range(2)]
    assert 25 <= statistics.median(xs) <= 31  # 28; int() floors
    p90 = sorted(xs)[int(0.9 * len(xs))]
    assert 0.8 < p90 / (28 * math.exp(1.2816 * 1.5)) < 1.2  # z(0.9) = 1.2816
    assert max(xs) == 1024 and 0.002 < sum(x == 1024 for x in xs) / len(xs) < 0.012  # P(z > 2.46) = 0.7 %


def test_apply_decodes_exactly_the_length_without_touching_the_callers_params():
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1024, min_tokens=1, seed=7)
    fixed = LENGTHS.apply(params, "p", 1)
    assert fixed.max_tokens == fixed.min_tokens == LENGTHS.length("p", 1, 1024) and fixed.seed == 7
    assert (params.max_tokens, params.min_tokens) == (1024, 1)


def test_the_config_is_checked_naming_the_key():
    flags = {"rollout.max_new_tokens": 1024, "train.seed": 3}
    assert fixed_lengths.from_config({}, flags) is None
    assert fixed_lengths.from_config({"fixed_lengths": {"median_tokens": 28, "sigma": 1.5}}, flags) == \
        FixedLengths(28.0, 1.5, 3)
    for spec, message in [
        ({"median_tokens": 28}, "task.fixed_lengths: a mapping of exactly median_tokens, sigma"),
        ({"median_tokens": 0, "sigma": 1}, "task.fixed_lengths.median_tokens: a number >= 1, got 0"),
        ({"median_tokens": 28, "sigma": -1}, "task.fixed_lengths.sigma: a number >= 0, got -1"),
        ({"median_tokens": "28", "sigma": 1}, "task.fixed_lengths.median_tokens: a number >= 1, got '28'"),
    ]:
        with pytest.raises(ValueError, match=message):
            fixed_lengths.from_config({"fixed_lengths": spec}, flags)
    with pytest.raises(ValueError, match="task.fixed_lengths: set rollout.max_new_tokens too"):
        fixed_lengths.from_config({"fixed_lengths": {"median_tokens": 28, "sigma": 1.5}}, {})


def test_every_process_reads_it_back_from_the_environment():
    env = {run_env.FIXED_LENGTHS: LENGTHS.to_env()}
    assert fixed_lengths.from_env(env) == LENGTHS and fixed_lengths.from_env({}) is None


def _engine_run(sampling_params, num_samples: int) -> list:
    async def execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        return sampling_params

    engine = vllm_engine.RolloutRayActor.__ray_metadata__.modified_class.__mro__[1]
    fake = SimpleNamespace(executor=SimpleNamespace(execute=execute))
    return asyncio.run(engine.generate_responses(fake, "p", "l", sampling_params, 2048, None, num_samples))


def test_openrlhfs_engines_decode_each_sample_at_its_length(monkeypatch):
    from vllm import SamplingParams

    monkeypatch.setenv(run_env.FIXED_LENGTHS, LENGTHS.to_env())
    out = _engine_run(SamplingParams(max_tokens=1024), num_samples=3)
    assert [(p.max_tokens, p.min_tokens) for p in out] == [(LENGTHS.length("p", j, 1024),) * 2 for j in range(3)]
    assert all(p.seed is None for p in out)  # untagged: the engine's RNG
    tagged = _engine_run(SamplingParams(max_tokens=1024, extra_args={SEED_KEY: [42, 3, 1]}), num_samples=2)
    assert [(p.seed, p.max_tokens) for p in tagged] == [(request_seed(42, 3, 1, "p", j), LENGTHS.length("p", j, 1024))
                                                        for j in range(2)]
    monkeypatch.delenv(run_env.FIXED_LENGTHS)
    assert [p.max_tokens for p in _engine_run(SamplingParams(max_tokens=1024), num_samples=2)] == [1024, 1024]


def test_oppos_requests_carry_the_same_length_and_decode_it_exactly(monkeypatch):
    from openrlhf_oppo.integrations.runtime.prompt_stream import GroupPrompts

    def prompts() -> GroupPrompts:
        gp = GroupPrompts(stream=None, tokenizer=None, rule_rewards=False)
        gp.by_group[5] = ("p", "l", [11, 12, 13])
        gp.set_limits(1024, 2048)
        return gp

    plain = prompts().request(5, sample_id=9, sample_index=1, held=[], seed=None)
    assert (plain.max_tokens, plain.exact) == (1024, False)
    monkeypatch.setenv(run_env.FIXED_LENGTHS, LENGTHS.to_env())
    req = prompts().request(5, sample_id=9, sample_index=1, held=[4, 4], seed=None)
    assert (req.max_tokens, req.exact, req.held_ids) == (LENGTHS.length("p", 1, 1024), True, [4, 4])
