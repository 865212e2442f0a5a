"""vLLM's own sleep mode on a CUDA GPU, as OPPO's hybrid-engine path uses it: requests stopped
by `abort` keep the tokens they streamed, `sleep(level=1)` gives the device memory back, the
weight sync's `wake_up(["weights"])` then `wake_up(["kv_cache"])` resume scheduling, and a
stopped sample decoded on from prompt + its tokens continues as if never stopped (greedy, fp32).
On CPU the compat layer's stand-in runs this path instead (tests/cli/test_train_sleep_on_cpu.py).
Skipped without CUDA (tests/conftest.py); the tiny task's actor, built in code."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.gpu

PROMPT = [5, 17, 33, 8, 21]
FIRST, TOTAL = 12, 40  # tokens decoded before the stop, and in all


async def _decode(llm, prompt: list[int], max_tokens: int, stop_after: int | None = None) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.utils import random_uuid

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    rid, tokens = f"sleep-{random_uuid()}", []
    async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=rid):
        tokens += out.outputs[0].token_ids
        if stop_after is not None and len(tokens) >= stop_after:
            await llm.abort(rid)  # what OppoRolloutActor.park does to each request
            break
    return tokens


def test_stopped_requests_decode_on_after_sleep_and_wake_as_if_never_stopped(tiny_assets):
    import torch
    import vllm

    async def run() -> None:
        llm = vllm.AsyncLLMEngine.from_engine_args(vllm.AsyncEngineArgs(
            model=str(tiny_assets / "actor"), dtype="float32", enable_sleep_mode=True, enforce_eager=True,
            gpu_memory_utilization=0.3, seed=0))
        whole = await _decode(llm, PROMPT, TOTAL)
        held = await _decode(llm, PROMPT, TOTAL, stop_after=FIRST)
        assert held == whole[: len(held)] and len(held) >= FIRST
        free_awake, _ = torch.cuda.mem_get_info()
        await llm.sleep(level=1)
        free_asleep, _ = torch.cuda.mem_get_info()
        assert free_asleep > free_awake  # the KV cache (and the weights) left the device
        await llm.wake_up(tags=["weights"])  # OpenRLHF's weight sync wakes the weights only
        await llm.wake_up(tags=["kv_cache"])
        rest = await _decode(llm, PROMPT + held, TOTAL - len(held))  # re-prefilled: prompt + partial response
        assert held + rest == whole

    asyncio.run(run())


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    from openrlhf_oppo.tasks import tiny

    return tiny.build(tmp_path_factory.mktemp("tiny-assets")).root
