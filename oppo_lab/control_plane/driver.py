"""One `bench control-plane` run: the real `OppoSamplesGenerator`, `EnginePool`,
`Scorers`, `StepMeter` and scheduler core, built as `trainer.build_samples_generator`
builds them, around synthetic engines and scorers (`actors`); one OPPO step of B = all prompts
(Δ = 0), measured from the driver process.

What the bench adds to the driver is small and outside the generator: `MeteredPool` notes
(time, process CPU, tokens) after each poll, at most every `TRACE_S`, and prints progress;
`MeteredMeter` notes when the streaming phase ended. Both only read what passes by.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from dataclasses import dataclass
from operator import attrgetter
from types import SimpleNamespace

import ray

from openrlhf_oppo.config import ChunkConfig, DeltaConfig, OppoConfig, StreamingConfig
from openrlhf_oppo.core import OverlapScheduler
from openrlhf_oppo.integrations.runtime.engine_pool import EnginePool
from openrlhf_oppo.integrations.runtime.generator import OppoSamplesGenerator
from openrlhf_oppo.integrations.runtime.reward_dispatch import REFERENCE, REWARD, ScorerDispatcher, Scorers
from openrlhf_oppo.integrations.runtime.step_meter import StepMeter
from openrlhf_oppo.integrations.runtime.step_mode import Carried, StepKind, StepMode
from oppo_lab.control_plane.actors import SyntheticEngineActor, SyntheticScorerActor, sample_length
from oppo_lab.synthetic import LengthModel

TRACE_S = 0.25  # the driver's (time, CPU, tokens) is noted at most this often
PROGRESS_S = 15.0  # a progress line this often
_TOKEN_IDS = attrgetter("token_ids")


@dataclass(frozen=True)
class Workload:
    """What the synthetic cluster decodes (defaults: a GPU cluster's rates)."""

    engines: int = 8
    sequences: int = 128  # decoding at once per engine (vLLM's max_num_seqs)
    tokens_per_s: float = 40.0  # per sequence
    prompts: int = 1024  # prompt groups of the step (B; Δ = 0)
    samples: int = 4  # per prompt (n)
    scorers: int = 4  # streaming reward actors
    scorer_us_per_token: float = 0.0  # a chunk token's fixed cost on its scorer (slept)
    prompt_tokens: int = 256
    lengths: LengthModel = LengthModel()  # response lengths (tokens), long tail
    drain: str = "all"  # the engines' outbox: "all" (the product's) or "due" (actors.DueOnlyOutbox)
    seed: int = 0

    @property
    def target_tokens_per_s(self) -> float:
        """What the engines emit while every slot decodes."""
        return self.engines * self.sequences * self.tokens_per_s

    def response_lengths(self) -> dict[int, int]:
        """sample id -> response tokens, as the engines will draw them (sample ids 0..B*n-1)."""
        return {sid: sample_length(self.lengths, self.seed, sid, self.lengths.max_tokens)
                for sid in range(self.prompts * self.samples)}


class MeteredPool(EnginePool):
    """The real pool; each poll also notes the driver's (time, CPU, tokens) and shows progress."""

    def __init__(self, engines: list, total_tokens: int, total_samples: int, meter: StepMeter, progress: bool) -> None:
        super().__init__(engines)
        self.total_tokens, self.total_samples = total_tokens, total_samples
        self.meter = meter  # its finished samples, for the progress line
        self.tokens = 0  # received from the engines
        self.deltas = 0  # merged deltas received (one per sample per reply it had tokens in)
        self.polls_done = 0
        self.trace: list[tuple[float, float, int]] = []  # (time.time(), process CPU s, tokens)
        self.progress = progress
        self.started_s = time.time()
        self.next_trace_s = self.next_progress_s = 0.0

    def start(self, requests, params) -> None:
        # a vLLM SamplingParams costs each engine process an import of vLLM to unpickle (seconds,
        # hundreds of MB); the synthetic engines read only each request's own budget
        super().start(requests, None)

    def poll(self, wake_tokens: int, also: list = ()):
        deltas = super().poll(wake_tokens, also)
        self.polls_done += 1
        self.deltas += len(deltas)
        self.tokens += sum(map(len, map(_TOKEN_IDS, deltas)))  # C-level: the bench's own cost stays small
        now = time.time()
        if now >= self.next_trace_s:
            self.trace.append((now, time.process_time(), self.tokens))
            self.next_trace_s = now + TRACE_S
            if self.progress and now >= self.next_progress_s:
                if self.next_progress_s:
                    print(f"  {now - self.started_s:6.0f} s  tokens {self.tokens:,}/{self.total_tokens:,} "
                          f"({self.tokens / max(self.total_tokens, 1):.0%})  samples finished "
                          f"{len(self.meter.finished_s):,}/{self.total_samples:,}", file=sys.stderr, flush=True)
                self.next_progress_s = now + PROGRESS_S
        return deltas


class MeteredMeter(StepMeter):
    """The real step meter; notes the time and driver CPU when the streaming phase ends."""

    def __init__(self, scorers: int) -> None:
        super().__init__(scorers, show_progress=False)
        self.stream_end: tuple[float, float, float] | None = None  # time.time(), process and main-thread CPU s

    def end_generation(self, generated_tokens: int) -> None:
        self.stream_end = (time.time(), time.process_time(), time.thread_time())
        super().end_generation(generated_tokens)


class PromptTokenizer:
    """Every prompt is `prompt_tokens` ids long (their values do not matter to the control plane)."""

    def __init__(self, prompt_tokens: int) -> None:
        self.ids = list(range(1, prompt_tokens + 1))

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": list(self.ids)}


class PromptLoader(list):
    """OpenRLHF's prompt dataloader as the generator reads it: (indices, prompts, labels, images)."""


def generator_args(w: Workload) -> SimpleNamespace:
    """The OpenRLHF flags the generator reads."""
    ns = SimpleNamespace
    return ns(rollout=ns(batch_size=w.prompts, n_samples_per_prompt=w.samples, top_p=1.0),
              algo=ns(advantage=ns(is_correction_level="off")),
              reward=ns(remote_url=None, model_name_or_path=None),
              train=ns(full_determinism_enable=False, seed=w.seed, agent_func_path=None),
              vllm=ns(enable_sleep=False))


def build(w: Workload, chunk_tokens: int, engines: list, scorers: list, progress: bool
          ) -> tuple[OppoSamplesGenerator, MeteredPool, MeteredMeter]:
    """The generator and its collaborators, as `trainer.build_samples_generator` makes them."""
    oppo = OppoConfig(delta=DeltaConfig(init=0, min=0, max=1, adaptive=False),
                      chunk=ChunkConfig(size_tokens=chunk_tokens), streaming=StreamingConfig(enable=True))
    scheduler = OverlapScheduler(oppo, batch_groups=w.prompts, samples_per_group=w.samples, scorers=(REWARD,))
    lengths = w.response_lengths()
    meter = MeteredMeter(len(scorers))
    pool = MeteredPool(engines, sum(lengths.values()), len(lengths), meter, progress)
    rewards = Scorers(ScorerDispatcher(scorers, scheduler, meter, strategy=None, model_path=None),
                      ScorerDispatcher([], scheduler, meter, strategy=None, model_path=None, name=REFERENCE))
    loader = PromptLoader([(None, [f"prompt {i}"], [f"label {i}"], [None]) for i in range(w.prompts)])
    gen = OppoSamplesGenerator(SimpleNamespace(args=generator_args(w)), loader, None,
                               PromptTokenizer(w.prompt_tokens), engines, oppo=oppo,
                               mode=StepMode(StepKind.SYNC, Carried.DECODE, keep_kv_cache=True, max_policy_lag=0),
                               scheduler=scheduler, engines=pool, scorers=rewards, meter=meter)
    return gen, pool, meter


def start_actors(w: Workload) -> tuple[list, list]:
    engines = [SyntheticEngineActor.remote(w.sequences, w.tokens_per_s, w.lengths, w.seed, drain=w.drain)
               for _ in range(w.engines)]
    scorers = [SyntheticScorerActor.remote(w.scorer_us_per_token * 1e-6) for _ in range(w.scorers)]
    ray.get([a.__ray_ready__.remote() for a in engines + scorers])  # started before the clock runs
    return engines, scorers


def run_step(w: Workload, chunk_tokens: int, progress: bool = True, profile: bool = False) -> dict:
    """One step at chunk size `chunk_tokens`; the raw measurements and the actors' logs."""
    engines, scorers = start_actors(w)
    try:
        gen, pool, meter = build(w, chunk_tokens, engines, scorers, progress)
        generate_kwargs = {"max_new_tokens": w.lengths.max_tokens, "max_len": w.prompt_tokens + w.lengths.max_tokens}
        # main-thread CPU: the Python driver's own; the process's adds Ray's core-worker threads
        profiler = cProfile.Profile(time.thread_time) if profile else None
        start = (time.time(), time.process_time(), time.thread_time())
        if profiler:
            profiler.enable()
        experiences, _, admitted, _ = gen.generate_samples(**generate_kwargs)
        if profiler:
            profiler.disable()
        end = (time.time(), time.process_time(), time.thread_time())
        engine_logs = ray.get([e.emission_log.remote() for e in engines])
        scorer_logs = ray.get([s.chunk_log.remote() for s in scorers])
    finally:
        for a in engines + scorers:
            ray.kill(a)
    return {
        "start": start, "stream_end": meter.stream_end, "end": end, "trace": pool.trace,
        "driver_tokens": pool.tokens, "driver_polls": pool.polls_done, "driver_deltas": pool.deltas,
        "admitted_groups": admitted, "experiences": len(experiences),
        # the streamed reward of each trained sample (the synthetic scorer's: its token count)
        "rewards": {sid: gen.scorers.reward.scores.get(sid) for sid in gen.batch_sample_ids or []},
        "engine_logs": engine_logs, "scorer_logs": scorer_logs, "profile": _profile_text(profiler),
    }


def _profile_text(profiler: cProfile.Profile | None, top: int = 25) -> str | None:
    if profiler is None:
        return None
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()
