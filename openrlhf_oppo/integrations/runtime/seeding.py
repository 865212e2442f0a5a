"""Seeded rollouts: with `--train.full_determinism_enable`, the same prompt gives
the same tokens in every schedule.

vLLM draws a request's tokens from one engine-wide generator unless the request
carries `SamplingParams.seed`; then a response depends on which requests share its
batch and in what order they arrived, and that differs between OpenRLHF's
synchronous loop and OPPO's streaming one. Under `--train.full_determinism_enable`
every request gets its own seed from (train.seed, rollout step, the prompt's slot
among the prompts started that step, the prompt text, the sample's index in its
group), and each step's samples are put in prompt order, not completion order, so
that training sees them in the same order too:

- OPPO's samples generator seeds its requests itself (`request_seed`);
- OpenRLHF's own schedules get it from the `seeded_rollouts_driver` and
  `seeded_rollouts_engine` patches below;
- both draw prompts in the same order: `seeded_prompt_order` seeds the prompt
  dataloader's shuffle from train.seed.

The patches are listed in `PATCHES`; the site hook installs them in every process of
a run it starts in (integrations.runtime.startup), on any hardware.

Seeds change which tokens are drawn, not their distribution. With Δ = 0 and
streaming off, OPPO then reproduces `--schedule sync` token for token
(tests/cli/test_train_oppo_on_cpu.py).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
from copy import deepcopy

from openrlhf_oppo import run_env
from openrlhf_oppo.compat.patches import VLLM_VERSION
from openrlhf_oppo.hooks import Patch
from openrlhf_oppo.integrations.runtime import fixed_lengths
from openrlhf_oppo.upstream import OPENRLHF_VERSION, ray_actor_classes

SEED_KEY = "oppo_seed"  # SamplingParams.extra_args key: [run seed, step, slot]


def request_seed(run_seed: int, step: int, slot: int, prompt: str, sample_index: int) -> int:
    """vLLM seed of one sample: a 63-bit hash of where it sits in the run."""
    h = hashlib.blake2b(f"{run_seed}\0{step}\0{slot}\0{sample_index}\0".encode(), digest_size=8)
    h.update(prompt.encode())
    return int.from_bytes(h.digest(), "little") >> 1


def seeded(params, seed: int):
    """A copy of vLLM `SamplingParams` that draws from its own generator."""
    params = deepcopy(params)
    params.seed = seed
    if params.extra_args:
        params.extra_args = {k: v for k, v in params.extra_args.items() if k != SEED_KEY} or None
    return params


def seeded_rollouts_driver(module) -> None:
    """openrlhf 0.11.2 `SamplesGenerator` (driver side): under full determinism, tag
    each prompt's `SamplingParams` with (seed, step, slot) and return each step's
    samples in prompt order; optionally write them to OPPO_ROLLOUTS_JSONL."""
    cls = module.SamplesGenerator
    dispatch = cls._dispatch_prompts_to_vllm
    generate = cls.generate_samples
    sampling_params = module.SamplingParams

    @functools.wraps(dispatch)
    def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **generate_kwargs):
        if not self.args.train.full_determinism_enable:
            return dispatch(self, prompts, labels, images=images, **generate_kwargs)
        images = images if images is not None else [None] * len(prompts)
        step = getattr(self, "_oppo_step", 0)
        refs = []
        order = self.__dict__.setdefault("_oppo_order", [])  # this step's prompts, by slot
        for prompt, label, image in zip(prompts, labels, images, strict=False):
            slot = len(order)
            order.append(prompt)
            tag = {SEED_KEY: [self.args.train.seed, step, slot]}
            module.SamplingParams = functools.partial(sampling_params, extra_args=tag)
            try:
                refs += dispatch(self, [prompt], [label], images=[image], **generate_kwargs)
            finally:
                module.SamplingParams = sampling_params
        return refs

    @functools.wraps(generate)
    def generate_samples(self, **generate_kwargs):
        self._oppo_order = []
        samples, *rest = generate(self, **generate_kwargs)
        if self.args.train.full_determinism_enable:
            # groups in dispatch order (a stable sort keeps each group's sample order)
            first = {}
            for i, prompt in enumerate(self._oppo_order):
                first.setdefault(prompt, i)
            samples = sorted(samples, key=lambda e: first.get(e.prompts[0], len(first)))
        path = run_env.path(run_env.ROLLOUTS_JSONL)
        if path and samples:
            write_rollouts(path, getattr(self, "_oppo_step", 0), samples)
        self._oppo_step = getattr(self, "_oppo_step", 0) + 1
        return (samples, *rest)

    cls._dispatch_prompts_to_vllm = _dispatch_prompts_to_vllm
    cls.generate_samples = generate_samples


def seeded_prompt_order(module) -> None:
    """openrlhf 0.11.2 `prepare_datasets` (driver side): the prompt dataloader's shuffle
    seed is drawn from torch's global RNG when it is built, in a process that never
    seeds it, so the prompt order depends on what that process imported first. Under
    full determinism, draw it from `train.seed` (nothing else's randomness changes)."""
    import torch

    prepare = module.prepare_datasets

    @functools.wraps(prepare)
    def prepare_datasets(strategy, tokenizer):
        if not strategy.args.train.full_determinism_enable:
            return prepare(strategy, tokenizer)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(strategy.args.train.seed)
            return prepare(strategy, tokenizer)

    module.prepare_datasets = prepare_datasets


def seeded_rollouts_engine(module) -> None:
    """openrlhf 0.11.2 `RolloutRayActor.generate_responses` (engine side): a request
    tagged by `seeded_rollouts_driver` runs its n samples with their own seeds; under
    `task.fixed_lengths` each sample decodes its own fixed length."""
    cls, actor_cls = ray_actor_classes(module.RolloutRayActor)  # OPPO's rollout actor subclasses cls
    generate = cls.generate_responses

    @functools.wraps(generate)
    async def generate_responses(self, prompt, label, sampling_params, max_length, hf_tokenizer,
                                 num_samples=1, images=None):
        tag = (sampling_params.extra_args or {}).get(SEED_KEY)
        lengths = fixed_lengths.from_env()
        if tag is None and lengths is None:
            return await generate(self, prompt, label, sampling_params, max_length, hf_tokenizer, num_samples, images)

        def params(j: int):
            p = sampling_params if tag is None else seeded(sampling_params, request_seed(*tag, prompt, j))
            return p if lengths is None else lengths.apply(p, prompt, j)

        groups = await asyncio.gather(*(
            generate(self, prompt, label, params(j), max_length, hf_tokenizer, 1, images) for j in range(num_samples)
        ))
        return [response for group in groups for response in group]

    cls.generate_responses = generate_responses
    # @ray.remote put a tracing wrapper of the original on its actor class; replace it too
    # (Ray exports the actor class by value from the driver, patched)
    actor_cls.generate_responses = generate_responses


def write_rollouts(path: str, step: int, experiences) -> None:
    """One JSON line: the step's samples as prompt text + unpadded token sequence + reward."""
    samples = []
    for e in experiences:
        seq = e.sequences[0][e.attention_mask[0].bool()].tolist()
        reward = e.rewards[0].item() if e.rewards is not None else None
        samples.append({"prompt": e.prompts[0], "sequence": seq, "reward": reward})
    with open(path, "a") as fh:
        fh.write(json.dumps({"step": step, "samples": samples}) + "\n")


PATCHES: tuple[Patch, ...] = (
    Patch("seeded_rollouts_driver", "openrlhf.trainer.ppo_utils.samples_generator", seeded_rollouts_driver,
          f"openrlhf {OPENRLHF_VERSION}, vllm {VLLM_VERSION}"),
    Patch("seeded_rollouts_engine", "openrlhf.trainer.ray.vllm_engine", seeded_rollouts_engine,
          f"openrlhf {OPENRLHF_VERSION}"),
    Patch("seeded_prompt_order", "openrlhf.trainer.ppo_trainer", seeded_prompt_order, f"openrlhf {OPENRLHF_VERSION}"),
)
