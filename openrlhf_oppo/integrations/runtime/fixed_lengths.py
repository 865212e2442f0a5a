"""Response lengths fixed per sample (`task.fixed_lengths`): every schedule decodes the same work.

Where the policy decides when to stop, schedules that train in a different order learn different
policies, and those decode different amounts: on the long-tail workload OPPO's runs decoded 7-14 %
more tokens than over-sampling's, so mean time per step compared unequal work. Under
`task.fixed_lengths` a sample's response length is drawn from a log-normal, clipped to
`rollout.max_new_tokens`, by (train.seed, prompt, the sample's index in its group) alone: the same
in every schedule and every repeat, whatever the policy learns. vLLM holds back EOS and stop tokens
until then (`min_tokens` = `max_tokens`); the policy still picks every token. For benchmarks: a
model trained so does not learn when to stop.

The launcher hands it to every process of the run as OPPO_FIXED_LENGTHS; OpenRLHF's engines apply it
in `seeding.seeded_rollouts_engine`, OPPO's generator in `GroupPrompts.request`.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping
from copy import deepcopy
from dataclasses import dataclass

from openrlhf_oppo import run_env

KEYS = ("median_tokens", "sigma")


@dataclass(frozen=True)
class FixedLengths:
    median_tokens: float
    sigma: float
    seed: int = 0

    def length(self, prompt: str, sample_index: int, cap: int) -> int:
        """Response tokens of sample `sample_index` of `prompt`'s group, 1 to `cap`."""
        h = hashlib.blake2b(f"{self.seed}\0{sample_index}\0".encode(), digest_size=8)
        h.update(prompt.encode())
        x = random.Random(int.from_bytes(h.digest(), "little")).lognormvariate(math.log(self.median_tokens), self.sigma)
        return max(1, min(cap, int(x)))

    def apply(self, params, prompt: str, sample_index: int):
        """A copy of vLLM `SamplingParams` that decodes exactly the sample's length."""
        params = deepcopy(params)
        params.max_tokens = params.min_tokens = self.length(prompt, sample_index, params.max_tokens)
        return params

    def to_env(self) -> str:
        return f"{self.median_tokens},{self.sigma},{self.seed}"


def from_config(task: Mapping, flags: Mapping) -> FixedLengths | None:
    """`task.fixed_lengths: {median_tokens, sigma}` of a run config, checked; None where unset."""
    spec = task.get("fixed_lengths")
    if spec is None:
        return None
    if not isinstance(spec, Mapping) or set(spec) != set(KEYS):
        raise ValueError(f"task.fixed_lengths: a mapping of exactly {', '.join(KEYS)}, got {spec!r}")
    median, sigma = spec["median_tokens"], spec["sigma"]
    if isinstance(median, bool) or not isinstance(median, (int, float)) or median < 1:
        raise ValueError(f"task.fixed_lengths.median_tokens: a number >= 1, got {median!r}")
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or sigma < 0:
        raise ValueError(f"task.fixed_lengths.sigma: a number >= 0, got {sigma!r}")
    if flags.get("rollout.max_new_tokens") is None:
        raise ValueError("task.fixed_lengths: set rollout.max_new_tokens too (the lengths are clipped to it)")
    return FixedLengths(float(median), float(sigma), int(flags.get("train.seed", 42)))


def from_env(environ: Mapping[str, str] | None = None) -> FixedLengths | None:
    text = run_env.fixed_lengths(environ)
    if text is None:
        return None
    median, sigma, seed = text.split(",")
    return FixedLengths(float(median), float(sigma), int(seed))
