"""OpenRLHF's rollout engines (`OppoRolloutActor`s) as one pool: where each group decodes,
starting and resuming its samples, polling their deltas, aborted requests, the pause
around a weight sync, sleep and wake (`--vllm.enable_sleep`), and the engine-side fault
injection."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import ray

from openrlhf_oppo import timeline
from openrlhf_oppo.integrations.runtime import faults
from openrlhf_oppo.integrations.runtime.deltas import SampleDelta, SampleRequest
from openrlhf_oppo.integrations.runtime.log import get_logger
from openrlhf_oppo.integrations.runtime.ray_calls import RayCalls

logger = get_logger(__name__)

POLL_S = 1.0  # an engine answers `next_outputs` when it has a chunk or a finished sample, or after this long
ABORT_RETRIES = 3  # an engine aborting one sample more often than this fails the step


class EnginePool:
    """A group stays on one engine (as OpenRLHF places a prompt's n samples); one
    `next_outputs` call per engine is in flight at a time, and it outlives a step."""

    def __init__(self, engines: list, calls: RayCalls | None = None) -> None:
        self.engines = list(engines)
        self.calls = calls if calls is not None else RayCalls()
        self.engine_of: dict[int, int] = {}  # group id -> engine decoding its samples
        self.polls: dict[int, Any] = {}  # engine index -> its `next_outputs` call in flight
        self.aborts: dict[int, int] = {}  # sample id -> times its engine aborted it (restarted from its tokens)
        self.step = 0  # the step under way (fault injection, error messages)
        self.aborted_this_step = 0  # aborted requests restarted this step
        self.replies_this_step = 0  # engine replies this step (crash injection counts them)
        self.paused = False  # paused for the weight sync under way
        self.paused_at = 0.0  # when the engines paused
        self.paused_s = 0.0  # seconds paused since `take_paused_s`
        self.landing: threading.Thread | None = None  # background sync: waits for the loads, then resumes
        self.landing_error: BaseException | None = None

    def set_reward_tokenizer(self, tokenizer) -> None:
        """With `--reward.remote_url` the engines decode the query text as OpenRLHF's executor does."""
        self.calls.get([e.set_reward_tokenizer.remote(tokenizer) for e in self.engines])

    def begin_step(self, step: int) -> None:
        self.step = step
        self.aborted_this_step = self.replies_this_step = 0

    # ------------------------------------------------------------------ placement and starts

    def place(self, group_id: int) -> int:
        """Put a whole group on the engine decoding the fewest groups (the lowest index on a tie)."""
        load = [0] * len(self.engines)
        for idx in self.engine_of.values():
            load[idx] += 1
        idx = self.engine_of[group_id] = min(range(len(load)), key=load.__getitem__)
        return idx

    def release(self, group_id: int, sample_ids: list[int]) -> None:
        """A trained group: nothing of it decodes again."""
        self.engine_of.pop(group_id, None)
        for sid in sample_ids:
            self.aborts.pop(sid, None)

    def start(self, requests: list[tuple[int, SampleRequest]], params) -> None:
        """Start (group id, request) pairs on their groups' engines, one call per engine."""
        per_engine: dict[int, list[SampleRequest]] = {}
        for gid, req in requests:
            per_engine.setdefault(self.engine_of[gid], []).append(req)
        if per_engine:
            self.calls.get([self.engines[i].start_samples.remote(reqs, params) for i, reqs in per_engine.items()])

    def restart_aborted(self, aborted: list[tuple[SampleDelta, int, SampleRequest]], params) -> None:
        """An aborted request (an engine-side failure) decodes on from the tokens it had, on
        its group's engine; a sample aborted `ABORT_RETRIES` times fails the step.
        `aborted`: (its last delta, group id, the request resuming it)."""
        per_engine: dict[int, list[SampleRequest]] = {}
        for d, gid, req in aborted:
            sid = d.sample_id
            self.aborts[sid] = self.aborts.get(sid, 0) + 1
            if self.aborts[sid] > ABORT_RETRIES:
                raise RuntimeError(f"OPPO step {self.step}: sample {sid} was aborted by its engine "
                                   f"{self.aborts[sid]} times; last error: {d.error}")
            per_engine.setdefault(self.engine_of[gid], []).append(req)
            logger.warning("OPPO: sample %d aborted by its engine (%s); decoding on from its %d tokens",
                           sid, d.error, len(req.held_ids))
        self.aborted_this_step += len(aborted)
        if per_engine:
            self.calls.get([self.engines[i].start_samples.remote(reqs, params) for i, reqs in per_engine.items()])

    # ------------------------------------------------------------------ polling

    def poll(self, wake_tokens: int, also: list = ()) -> list[SampleDelta]:
        """Sleep until an engine has output or one of `also` (reward calls) is done, whichever
        is first; the deltas of every engine that answered, engine by engine."""
        self._raise_landing_error()
        for idx, engine in enumerate(self.engines):
            if idx not in self.polls:
                self.polls[idx] = engine.next_outputs.remote(POLL_S, wake_tokens)
        self.calls.wait_any([*self.polls.values(), *also])
        done = set(self.calls.ready(list(self.polls.values())))
        deltas: list[SampleDelta] = []
        for idx, ref in list(self.polls.items()):
            if ref in done:
                del self.polls[idx]
                deltas += self._reply(idx, ref)
        return deltas

    def _reply(self, idx: int, ref) -> list[SampleDelta]:
        """An engine's `next_outputs`. A dead engine stops the run: a new one would hold the
        initial weights and no weight-sync group, so the run resumes from its last checkpoint
        instead (`--ckpt.load_enable`; `openrlhf-oppo train --restarts N` relaunches it),
        where the samples carried at that checkpoint decode on from their recorded tokens."""
        try:
            outputs = self.calls.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(
                f"OPPO: rollout engine {idx} died in step {self.step} ({type(exc).__name__}). Resume from the last "
                f"checkpoint with --ckpt.load_enable (openrlhf-oppo train --restarts N does it): carried samples "
                f"decode on from their recorded tokens"
            ) from exc
        self.replies_this_step += 1
        if faults.due("rollout", self.step, self.replies_this_step):
            self.calls.kill(self.engines[idx], no_restart=True)
        if faults.due("abort", self.step, self.replies_this_step):
            logger.warning("OPPO fault injection: engine %d aborted sample %s", idx,
                           self.calls.get(self.engines[idx].abort_one.remote()))
        return outputs

    # ------------------------------------------------------------------ sleep mode

    def park(self) -> None:
        """Stop every request where it is; their last ("abort") deltas wait in the outboxes."""
        self.calls.get([e.park.remote() for e in self.engines])

    def sleep(self) -> None:
        """OpenRLHF's `RolloutRayActor.sleep`: vLLM frees its KV cache and offloads its weights."""
        with timeline.RECORDER.timed("driver", "sleep"):
            self.calls.get([e.sleep.remote() for e in self.engines])

    def wake(self) -> None:
        """OpenRLHF's `RolloutRayActor.wake_up`: weights and KV cache back on the device."""
        with timeline.RECORDER.timed("driver", "wake"):
            self.calls.get([e.wake_up.remote() for e in self.engines])

    # ------------------------------------------------------------------ around a weight sync

    def pause(self, keep_kv_cache: bool) -> None:
        """Pause decoding, requests kept (and their KV cache with `keep_kv_cache`); after the last
        background sync's loads (`join_landing`)."""
        self.join_landing()
        self.paused = True
        self.paused_at = time.time()
        with timeline.RECORDER.timed("driver", "pause"):
            self.calls.get([e.pause_generation.remote(keep_kv_cache) for e in self.engines])

    def resume(self, policy_version: int) -> None:
        """Tokens from here on are `policy_version`'s; decoding resumes if it was paused."""
        with timeline.RECORDER.timed("driver", "resume") if self.paused else contextlib.nullcontext():
            self._resume(policy_version)

    def _resume(self, policy_version: int) -> None:
        self.calls.get([e.set_policy_version.remote(policy_version) for e in self.engines])
        if self.paused:
            self.calls.get([e.resume_generation.remote() for e in self.engines])  # OpenRLHF's `RolloutRayActor`'s
            self.paused = False
            self.paused_s += time.time() - self.paused_at

    def take_paused_s(self) -> float:
        """Seconds the engines sat paused for weight syncs that ended since the last call (a background
        sync's pause ends when its loads land, often in the next step)."""
        paused_s, self.paused_s = self.paused_s, 0.0
        return paused_s

    def resume_when_loaded(self, loads: list, policy_version: int, reset_prefix_cache: bool) -> None:
        """Background weight sync: the engines stay paused until `loads` (their weight loads, Ray
        refs) finish; then a thread resets their prefix caches (`reset_prefix_cache`) and resumes
        them with `policy_version`. The caller goes on meanwhile."""
        self.join_landing()

        def land() -> None:
            try:
                with timeline.RECORDER.timed("sync", "landing"):  # beside the driver's own spans
                    self.calls.get(loads)
                    if reset_prefix_cache:
                        self.calls.get([e.reset_prefix_cache.remote() for e in self.engines])
                    self._resume(policy_version)
            except BaseException as exc:  # raised in the caller's thread by the next poll or pause
                self.landing_error = exc

        self.landing = threading.Thread(target=land, name="oppo-weight-landing", daemon=True)
        self.landing.start()

    def join_landing(self) -> None:
        """Wait for the last background sync's loads and resume (RuntimeError if they failed)."""
        if self.landing is not None:
            self.landing.join()
            self.landing = None
        self._raise_landing_error()

    def _raise_landing_error(self) -> None:
        if self.landing_error is not None:
            exc, self.landing_error = self.landing_error, None
            raise RuntimeError(f"OPPO step {self.step}: the engines' weight load (background sync) failed: "
                               f"{exc!r}") from exc
