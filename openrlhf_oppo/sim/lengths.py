"""Response-length distributions: log-normal fitted to a mean/std and clipped, quantile points,
or an empirical list (e.g. a run's rollouts.jsonl), drawn at random or replayed in order.
Randomness is injected."""

from __future__ import annotations

import bisect
import json
import math
import random
from pathlib import Path

from openrlhf_oppo.sim.presets import PRESET_DIR, Lengths


class LengthSampler:
    """Draws response lengths in tokens, in [min_tokens, cap_tokens]."""

    def __init__(self, cfg: Lengths, rng: random.Random) -> None:
        self.cfg = cfg
        self.rng = rng
        self.empirical: list[int] = load_empirical(cfg) if cfg.kind in ("empirical", "replay") else []
        self.replayed = 0  # replay: entries drawn so far
        points = sorted(cfg.quantiles)
        self.q_probs = [0.0] + [p for p, _ in points]
        self.q_logs = [math.log(cfg.min_tokens)] + [math.log(max(1.0, t)) for _, t in points]
        var = 0.0  # of the log-normal's log
        if cfg.mean_tokens > 0:
            var = math.log(1.0 + (cfg.std_tokens / cfg.mean_tokens) ** 2)
        self.sigma = math.sqrt(var)
        self.mu = math.log(max(cfg.mean_tokens, 1e-9)) - var / 2

    def sample(self) -> int:
        cfg = self.cfg
        if cfg.kind == "empirical":
            x = float(self.rng.choice(self.empirical))
        elif cfg.kind == "replay":
            x = float(self.empirical[self.replayed % len(self.empirical)])
            self.replayed += 1
        elif cfg.kind == "quantiles":
            x = self._from_quantiles(self.rng.random())
        else:
            x = self.rng.lognormvariate(self.mu, self.sigma)
        return min(cfg.cap_tokens, max(cfg.min_tokens, int(round(x))))

    def _from_quantiles(self, u: float) -> float:
        probs = self.q_probs
        logs = self.q_logs
        if u >= probs[-1]:
            return float(self.cfg.cap_tokens)
        i = bisect.bisect_right(probs, u)
        p0, p1 = probs[i - 1], probs[i]
        frac = (u - p0) / (p1 - p0) if p1 > p0 else 0.0
        return math.exp(logs[i - 1] + frac * (logs[i] - logs[i - 1]))


def load_empirical(cfg: Lengths) -> list[int]:
    """Response lengths from a JSON list, or from a rollouts.jsonl (sequence length - prompt_tokens)."""
    path = Path(cfg.path)
    if not path.is_absolute():
        path = PRESET_DIR / path
    if not path.exists():
        raise ValueError(f"--set lengths.path: no file {path}")
    text = path.read_text()
    if path.suffix == ".jsonl":
        out = []
        for line in text.splitlines():
            if line.strip():
                for sample in json.loads(line).get("samples", []):
                    out.append(max(1, len(sample["sequence"]) - cfg.prompt_tokens))
    else:
        out = [int(x) for x in json.loads(text)]
    if not out:
        raise ValueError(f"--set lengths.path: {path} holds no response lengths")
    return out


def describe(cfg: Lengths, draws: int = 20000, seed: int = 0) -> dict[str, float]:
    """Median, p90, p99, mean and share at the cap of a distribution (for the doc and the table)."""
    sampler = LengthSampler(cfg, random.Random(seed))
    xs = sorted(sampler.sample() for _ in range(draws))
    return {"mean": sum(xs) / draws, "p50": xs[draws // 2], "p90": xs[int(0.9 * draws)],
            "p99": xs[int(0.99 * draws)], "at_cap": sum(x == cfg.cap_tokens for x in xs) / draws}
