"""The fits `simulate calibrate` makes on a run's timeline (stdlib only).

Decode (the simulator's engine: one iteration gives every running response a token and costs
``step + per_seq * b``, times ``slowdown`` while the trainer works on the same host)::

    tokens_i = sum over the pieces k of response i's life of  seconds_k / ((step + per_seq * b_k) * slowdown^train_k)

with ``b_k`` the responses its engine was decoding during piece k (from every `open`/`sample`
record of that engine) and ``train_k`` whether a `driver make_experience` / `train` span was
running. The three costs minimise sum_i tokens_i * (predicted_i / tokens_i - 1)^2 (Gauss-Newton):
a long response weighs what it costs, and a short one's fixed start-up latency hardly counts.

Phases (make_experience, train) on a shared host: ``seconds = overhead + per_token * tokens *
(1 + (slowdown - 1) * f)``, ``f`` the share of the span during which some response was decoding;
one slowdown for both phases, chosen on a grid, each phase's line fitted for it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from openrlhf_oppo import timeline

TRAIN_STAGES = ("make_experience", "train")  # driver spans during which the trainer computes


@dataclass(frozen=True)
class DecodeLife:
    """One finished response's life on its engine, cut where its engine's batch or the trainer changed.

    Attributes:
        tokens (int): tokens it decoded.
        seconds (dict[tuple[int, bool], float]): (responses its engine decoded at once, the trainer
            computing beside it) -> seconds of its life spent so.
    """

    tokens: int
    seconds: dict[tuple[int, bool], float]


@dataclass(frozen=True)
class DecodeFit:
    step_s: float  # per engine iteration
    per_seq_s: float  # per running response, per iteration
    slowdown: float  # iterations take this many times longer while the trainer computes
    slowdown_measured: bool  # False: no response decoded beside the trainer, `slowdown` is the prior
    responses: int


def weighted_line(xs: list[float], ys: list[float], ws: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the weighted least-squares line; a flat line when x does not vary."""
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    var = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    if var <= 1e-12:
        return my, 0.0
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / var
    return my - slope * mx, slope


def nonneg_line(xs: list[float], ys: list[float], ws: list[float]) -> tuple[float, float]:
    """A line with intercept and slope >= 0 (a negative one is noise: refit with it at 0)."""
    a, b = weighted_line(xs, ys, ws)
    if b < 0:
        return sum(w * y for w, y in zip(ws, ys)) / sum(ws), 0.0
    if a < 0:
        return 0.0, sum(w * x * y for w, x, y in zip(ws, xs, ys)) / sum(w * x * x for w, x in zip(ws, xs))
    return a, b


def warmup_end_s(rows: list[dict], warmup_steps: int) -> float:
    """The end of the `warmup_steps`-th weight sync (start-up, first-call compilation before it)."""
    ends = sorted(r["t1"] for r in timeline.stage_spans(rows, "driver", "weight_sync"))
    return ends[warmup_steps - 1] if 0 < warmup_steps <= len(ends) else float("-inf")


def trainer_intervals(rows: list[dict]) -> list[tuple[float, float]]:
    return timeline.merge([(r["t0"], r["t1"]) for stage in TRAIN_STAGES
                           for r in timeline.stage_spans(rows, "driver", stage)])


def decode_lives(rows: list[dict], warmup_steps: int) -> list[DecodeLife]:
    """Every response finished after warm-up with >= 2 tokens, its life cut into pieces; a
    response whose life spans a weight sync (its engine paused or reloaded) is left out."""
    syncs = [(r["t0"], r["t1"]) for r in timeline.stage_spans(rows, "driver", "weight_sync")]
    busy = trainer_intervals(rows)
    cut_s = warmup_end_s(rows, warmup_steps)
    end_s = max(r["t1"] for r in rows)
    finished = {(timeline.worker(r), r["key"]) for r in rows if r["kind"] == "sample"}
    by_engine: dict[tuple, list[dict]] = {}
    for r in rows:  # a response never finished (still decoding, killed) occupied its engine to the end
        if r["kind"] == "sample" or (r["kind"] == "open" and (timeline.worker(r), r["key"]) not in finished):
            by_engine.setdefault(timeline.worker(r), []).append(r if r["kind"] == "sample" else {**r, "t1": end_s})
    lives = []
    for lives_on_engine in by_engine.values():
        edges = sorted({t for r in lives_on_engine for t in (r["t0"], r["t1"])} | {t for iv in busy for t in iv})
        pieces = _pieces(edges, lives_on_engine, busy)
        for r in lives_on_engine:
            if (r["kind"] != "sample" or r.get("tokens", 0) < 2 or r.get("finish") == "abort" or r["t0"] < cut_s
                    or r["t1"] <= r["t0"] or any(r["t0"] < b and r["t1"] > a for a, b in syncs)):
                continue
            seconds: dict[tuple[int, bool], float] = {}
            for i in range(bisect.bisect_left(edges, r["t0"]), bisect.bisect_left(edges, r["t1"])):
                key, dt = pieces[i]
                seconds[key] = seconds.get(key, 0.0) + dt
            lives.append(DecodeLife(r["tokens"], seconds))
    return lives


def _pieces(edges: list[float], lives: list[dict], busy: list[tuple[float, float]]) -> list[tuple[tuple, float]]:
    """((responses decoding, trainer computing), seconds) of each gap between consecutive edges."""
    delta = [0] * (len(edges) + 1)
    for r in lives:
        delta[bisect.bisect_left(edges, r["t0"])] += 1
        delta[bisect.bisect_left(edges, r["t1"])] -= 1
    out, running = [], 0
    for i, (a, b) in enumerate(zip(edges, edges[1:])):
        running += delta[i]
        mid = (a + b) / 2
        j = bisect.bisect_right(busy, (mid, float("inf"))) - 1
        out.append(((running, j >= 0 and busy[j][0] <= mid < busy[j][1]), b - a))
    return out


def fit_decode(lives: list[DecodeLife], prior_slowdown: float) -> DecodeFit:
    """The decode costs of the docstring's model (Gauss-Newton from the per-response line)."""
    if not lives:
        raise ValueError("no finished response in the timelines (`sample` records of role rollout)")
    measured = any(train and dt > 0 for life in lives for (_, train), dt in life.seconds.items())
    xs, ys, ws = [], [], []
    for life in lives:
        dur = sum(life.seconds.values())
        xs.append(sum(n * dt for (n, _), dt in life.seconds.items()) / dur)
        ys.append(dur / life.tokens)
        ws.append(float(life.tokens))
    a, b = nonneg_line(xs, ys, ws)
    p = [max(a, 1e-6), max(b, 0.0), prior_slowdown if measured else 1.0]
    for _ in range(200):
        step = _gauss_newton_step(lives, p, measured)
        new = [max(p[0] + step[0], 1e-7), max(p[1] + step[1], 0.0), max(p[2] + step[2], 1.0) if measured else p[2]]
        if _loss(lives, new) > _loss(lives, p):  # halve a step that overshoots
            new = [(x + y) / 2 for x, y in zip(p, new)]
        done = all(abs(x - y) <= 1e-12 + 1e-10 * abs(y) for x, y in zip(new, p))
        p = new
        if done:
            break
    return DecodeFit(p[0], p[1], p[2] if measured else prior_slowdown, measured, len(lives))


def _predict(life: DecodeLife, p: list[float]) -> tuple[float, list[float]]:
    """Predicted tokens and their gradient in (step, per_seq, slowdown)."""
    a, b, s = p
    tok, ga, gb, gs = 0.0, 0.0, 0.0, 0.0
    for (n, train), dt in life.seconds.items():
        f = s if train else 1.0
        it = (a + b * n) * f
        x = dt / it
        tok += x
        ga -= x * f / it
        gb -= x * n * f / it
        if train:
            gs -= x / s
    return tok, [ga, gb, gs]


def _loss(lives: list[DecodeLife], p: list[float]) -> float:
    return sum(life.tokens * (_predict(life, p)[0] / life.tokens - 1.0) ** 2 for life in lives)


def _gauss_newton_step(lives: list[DecodeLife], p: list[float], fit_slowdown: bool) -> list[float]:
    dim = 3 if fit_slowdown else 2
    jtj = [[0.0] * dim for _ in range(dim)]
    jtr = [0.0] * dim
    for life in lives:
        tok, grad = _predict(life, p)
        w = 1.0 / life.tokens  # residual sqrt(tokens) * (pred / tokens - 1)
        r = tok - life.tokens
        for i in range(dim):
            jtr[i] += w * grad[i] * r
            for j in range(dim):
                jtj[i][j] += w * grad[i] * grad[j]
    for i in range(dim):
        jtj[i][i] *= 1.0 + 1e-9  # Levenberg's damping, for a flat direction
    return [-x for x in _solve(jtj, jtr)] + [0.0] * (3 - dim)


def _solve(m: list[list[float]], v: list[float]) -> list[float]:
    """m x = v by Gaussian elimination with partial pivoting (a singular m gives zeros there)."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(a[r][c]))
        a[c], a[piv] = a[piv], a[c]
        if abs(a[c][c]) < 1e-300:
            continue
        for r in range(c + 1, n):
            f = a[r][c] / a[c][c]
            for k in range(c, n + 1):
                a[r][k] -= f * a[c][k]
    x = [0.0] * n
    for c in reversed(range(n)):
        if abs(a[c][c]) >= 1e-300:
            x[c] = (a[c][n] - sum(a[c][k] * x[k] for k in range(c + 1, n))) / a[c][c]
    return x


@dataclass(frozen=True)
class PhasePoint:
    """One driver span of a phase: its tokens, seconds and the share of it spent beside decoding."""

    stage: str
    tokens: float
    seconds: float
    decoding_share: float


def fit_phases(points: list[PhasePoint], prior_slowdown: float) -> tuple[dict[str, tuple[float, float]], float, bool]:
    """({stage: (overhead_s, per_token_s)}, slowdown, measured): the docstring's phase model.
    Without a span beside decoding the slowdown cannot be seen: the prior is kept."""
    stages = sorted({p.stage for p in points})
    measured = any(p.decoding_share > 0.05 for p in points)
    best = None
    for s in ([1.0 + i / 100 for i in range(401)] if measured else [prior_slowdown]):
        lines, sse = {}, 0.0
        for st in stages:
            pts = [p for p in points if p.stage == st]
            xs = [p.tokens * (1.0 + (s - 1.0) * p.decoding_share) for p in pts]
            ys = [p.seconds for p in pts]
            lines[st] = nonneg_line(xs, ys, [1.0] * len(pts))
            sse += sum((lines[st][0] + lines[st][1] * x - y) ** 2 for x, y in zip(xs, ys))
        if best is None or sse < best[0] - 1e-15:
            best = (sse, lines, s)
    return best[1], best[2], measured
