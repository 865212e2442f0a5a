"""Streaming rollout actor: OpenRLHF's vLLM `RolloutRayActor` that keeps vLLM's
partial outputs instead of discarding them.

Written against OpenRLHF 0.11.2 (`openrlhf.trainer.ray.vllm_engine.RolloutRayActor`)
and vLLM 0.29.0 (`AsyncLLM.generate` with `RequestOutputKind.DELTA`).

Requests run as asyncio tasks inside the actor and outlive the call that started
them, so a carried sample keeps decoding while the trainer trains; every delta
(new token ids, their logprobs, the policy version that produced them, and the
finish reason at the end) lands in an outbox that the OPPO samples generator
drains with `next_outputs`. Chunking and routing to the scorers are decided by the
scheduler core on the generator's side.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from copy import deepcopy
from dataclasses import dataclass

import ray
from openrlhf.trainer.ray import vllm_engine as _vllm_engine

from openrlhf_oppo import timeline

_BASE = _vllm_engine.RolloutRayActor.__ray_metadata__.modified_class.__mro__[1]  # the class under @ray.remote


@dataclass(frozen=True)
class SampleRequest:
    """Start (or resume, after a restart) decoding one sample."""

    sample_id: int
    prompt_ids: list[int]
    held_ids: list[int]  # response tokens generated before a restart; decoding continues after them
    max_tokens: int  # response budget, held tokens included
    seed: int | None = None  # vLLM per-request seed (integrations.seeding); None: the engine's RNG


@dataclass(frozen=True)
class SampleDelta:
    sample_id: int
    # arrays, not lists: the driver's scheduler holds millions of these ids between
    # steps, and arrays are invisible to the cyclic GC (lists are walked on every pass)
    token_ids: array  # array("i")
    logprobs: array | None  # array("d")
    policy_version: int
    finish_reason: str | None  # "stop" | "length" | "abort" on the last delta of a sample
    time_s: float  # when the engine produced it (time.time()): a finished sample's end


class OppoRolloutActor(_BASE):
    """`RolloutRayActor` plus streaming starts, an outbox and a policy-version counter."""

    async def __init__(self, *args, **kwargs):
        await super().__init__(*args, **kwargs)
        self._outbox: list[SampleDelta] = []
        self._outbox_ready = asyncio.Event()
        self._decoded: dict[int, int] = {}  # sample id -> response tokens pushed so far
        self._drained: dict[int, int] = {}  # sample id -> of those, handed to the caller
        self._wake_tokens = 1  # set by next_outputs: a sample crossing a multiple of it wakes the caller
        self._tasks: dict[int, asyncio.Task] = {}
        self._policy_version = 0

    async def pause_generation(self, keep_kv_cache: bool = False) -> None:
        """OpenRLHF's pause (mode "keep": requests stay queued), optionally keeping their
        KV cache: vLLM 0.29 otherwise clears it and re-prefills every carried request."""
        with timeline.RECORDER.timed("rollout", "pause"):
            await self.llm.pause_generation(mode="keep", clear_cache=not keep_kv_cache)

    def set_policy_version(self, version: int) -> None:
        """Called while generation is paused for a weight sync: later tokens carry `version`."""
        self._policy_version = version

    async def start_samples(self, requests: list[SampleRequest], sampling_params) -> None:
        from vllm.sampling_params import RequestOutputKind

        for req in requests:
            if req.sample_id in self._tasks:
                raise ValueError(f"sample {req.sample_id} is already decoding on this engine")
            params = deepcopy(sampling_params)
            params.output_kind = RequestOutputKind.DELTA
            params.max_tokens = req.max_tokens - len(req.held_ids)
            params.seed = req.seed
            if params.max_tokens <= 0:
                no_logprobs = array("d") if params.logprobs else None
                self._push(SampleDelta(req.sample_id, array("i"), no_logprobs, self._policy_version, "length", time.time()))
                continue
            self._tasks[req.sample_id] = asyncio.create_task(self._decode(req, params))

    async def _decode(self, req: SampleRequest, params) -> None:
        from vllm.inputs import TokensPrompt
        from vllm.utils import random_uuid

        prompt = TokensPrompt(prompt_token_ids=list(req.prompt_ids) + list(req.held_ids))
        finish_reason = "abort"
        opened, decoded = timeline.RECORDER.open_sample("rollout"), 0
        self._decoded[req.sample_id] = self._drained[req.sample_id] = len(req.held_ids)
        try:
            async for out in self.llm.generate(prompt, params, request_id=f"oppo-{req.sample_id}-{random_uuid()}"):
                comp = out.outputs[0]
                logprobs = None
                if params.logprobs is not None and comp.logprobs is not None:
                    logprobs = array("d", [d[t].logprob if t in d else 0.0 for t, d in zip(comp.token_ids, comp.logprobs)])
                decoded += len(comp.token_ids)
                reason = comp.finish_reason if out.finished else None
                if reason is not None:
                    finish_reason = "length" if reason == "length" else "abort" if reason == "abort" else "stop"
                self._push(
                    SampleDelta(
                        req.sample_id,
                        array("i", comp.token_ids),
                        logprobs,
                        self._policy_version,
                        finish_reason if out.finished else None,
                        time.time(),
                    )
                )
                if out.finished:
                    return
            self._push(SampleDelta(req.sample_id, array("i"), None, self._policy_version, finish_reason, time.time()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # surface engine failures to the generator, do not lose the sample silently
            self._push(SampleDelta(req.sample_id, array("i"), None, self._policy_version, "abort", time.time()))
            raise RuntimeError(f"OPPO rollout: sample {req.sample_id} failed: {exc!r}") from exc
        finally:
            self._tasks.pop(req.sample_id, None)
            timeline.RECORDER.sample("rollout", opened, decoded, finish_reason,
                                     sample=req.sample_id, held=len(req.held_ids))

    def _push(self, delta: SampleDelta) -> None:
        self._outbox.append(delta)
        sid = delta.sample_id
        self._decoded[sid] = self._decoded.get(sid, 0) + len(delta.token_ids)
        if delta.finish_reason is not None or self._chunk_ready(sid):
            self._outbox_ready.set()

    def _chunk_ready(self, sid: int) -> bool:
        # the scheduler cuts chunks at multiples of C from the response start: wake at those
        return self._decoded[sid] // self._wake_tokens > self._drained.get(sid, 0) // self._wake_tokens

    async def next_outputs(self, timeout_s: float, wake_tokens: int = 1) -> list[SampleDelta]:
        """Drain the outbox once something in it is worth a round trip: a sample finished
        or has `wake_tokens` unsent tokens (the chunk size when streaming; a large value
        when only finished samples matter), or `timeout_s` passed. Waking per token
        would cost a driver round trip and a pickle per token."""
        self._wake_tokens = wake_tokens
        if any(self._chunk_ready(sid) for sid in self._decoded):
            self._outbox_ready.set()
        try:
            await asyncio.wait_for(self._outbox_ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        out, self._outbox = self._outbox, []
        for d in out:
            if d.finish_reason is None:
                self._drained[d.sample_id] = self._decoded[d.sample_id]
            else:  # the sample is done on this engine
                self._decoded.pop(d.sample_id, None)
                self._drained.pop(d.sample_id, None)
        self._outbox_ready.clear()
        return out


OppoRolloutRayActor = ray.remote(OppoRolloutActor)
