"""Fakes for the runtime's collaborators: no Ray cluster, no vLLM engine, no model.

`FakeCalls` stands in for `ray_calls.RayCalls`; a fake actor's method is a `FakeMethod`
whose `.remote(...)` returns a `FakeRef` (ready or not, a value or an error). The
scheduler is always the real `OverlapScheduler` (pure Python), built by `make_scheduler`.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest

from openrlhf_oppo import compat, run_env
from openrlhf_oppo.config import ChunkConfig, DeltaConfig, OppoConfig, StalenessConfig, StreamingConfig
from openrlhf_oppo.core import OverlapScheduler

compat.apply()  # OpenRLHF's modules import flash_attn where CUDA is absent


@pytest.fixture(autouse=True)
def no_oppo_environment(monkeypatch):
    """No fault injection, trace, ledger or rollout file from the caller's environment."""
    for name in run_env.ALL:
        monkeypatch.delenv(name, raising=False)


class FakeRef:
    """A Ray object ref: `ready` is what `ray.wait` would say; `get` returns `value` or raises `error`."""

    def __init__(self, value=None, *, error: BaseException | None = None, ready: bool = True) -> None:
        self.value = value
        self.error = error
        self.ready = ready


class FakeCalls:
    """`RayCalls` on `FakeRef`s; records kills."""

    def __init__(self) -> None:
        self.killed: list = []

    def get(self, refs, timeout_s: float | None = None):
        if isinstance(refs, list):
            return [self.get(r) for r in refs]
        if refs.error is not None:
            raise refs.error
        return refs.value

    def wait_any(self, refs: list, timeout_s: float | None = None) -> None:
        assert any(r.ready for r in refs), "the driver would sleep forever: nothing is ready"

    def ready(self, refs: list) -> list:
        return [r for r in refs if r.ready]

    def kill(self, actor, *, no_restart: bool) -> None:
        self.killed.append((actor, no_restart))


class FakeMethod:
    """An actor method: `.remote(*args)` records the call and wraps `fn(*args)` in a ready `FakeRef`
    (`fn` may return a `FakeRef` itself to control readiness or errors)."""

    def __init__(self, fn=lambda *args, **kwargs: None) -> None:
        self.fn = fn
        self.calls: list[tuple] = []

    def remote(self, *args, **kwargs):
        self.calls.append(args)
        out = self.fn(*args, **kwargs)
        return out if isinstance(out, FakeRef) else FakeRef(out)


def make_actor(**methods) -> SimpleNamespace:
    """An actor handle whose named methods are `FakeMethod`s (functions are wrapped; None: returns None)."""

    def method(m):
        return m if isinstance(m, FakeMethod) else FakeMethod() if m is None else FakeMethod(m)

    return SimpleNamespace(**{name: method(m) for name, m in methods.items()})


def make_delta(sample_id: int, tokens: list[int], version: int = 0, finish: str | None = None,
               time_s: float = 0.0, error: str | None = None):
    from openrlhf_oppo.integrations.runtime.rollout import SampleDelta

    return SampleDelta(sample_id, array("i", tokens), None, version, finish, time_s, error=error)


def make_config(delta: int = 0, chunk: int = 4, stream: bool = True, max_deferral: int = 3,
                max_lag: int = 0) -> OppoConfig:
    return OppoConfig(
        delta=DeltaConfig(enable=True, init=delta, min=0, max=max(delta, 1), adaptive=False),
        chunk=ChunkConfig(size_tokens=chunk),
        staleness=StalenessConfig(max_deferral_steps=max_deferral, max_policy_lag=max_lag),
        streaming=StreamingConfig(enable=stream),
    )


def make_scheduler(B: int = 2, n: int = 2, delta: int = 0, chunk: int = 4, scorers=("reward",)) -> OverlapScheduler:
    return OverlapScheduler(make_config(delta, chunk, stream=bool(scorers)), batch_groups=B, samples_per_group=n,
                            scorers=scorers)


def make_args(B: int = 2, n: int = 2, remote_url: str | None = None) -> SimpleNamespace:
    """The OpenRLHF flags the generator reads."""
    ns = SimpleNamespace
    return ns(rollout=ns(batch_size=B, n_samples_per_prompt=n, top_p=1.0),
              algo=ns(advantage=ns(is_correction_level="off")),
              reward=ns(remote_url=remote_url, model_name_or_path="/rm"),
              train=ns(full_determinism_enable=False, seed=42, agent_func_path=None, colocate_all=False),
              vllm=ns(enable_sleep=False, enable_prefix_caching=False))


@pytest.fixture
def fakes():
    """The fakes as one namespace, for tests that build their own collaborators."""
    return SimpleNamespace(FakeRef=FakeRef, FakeCalls=FakeCalls, FakeMethod=FakeMethod, make_actor=make_actor,
                           make_delta=make_delta, make_config=make_config, make_scheduler=make_scheduler,
                           make_args=make_args)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """A tiny Qwen2 causal LM's checkpoint (seeded, random weights), for the tests that compare a forward."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path
