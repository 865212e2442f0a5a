"""The fits `simulate calibrate` makes on a run's timeline (stdlib only).

Decode (the simulator's engine: one iteration gives every running response a token and costs
``step + per_seq * b``, times ``slowdown`` while the trainer works on the same host, times
``scoring`` while a streaming scorer prefills on it)::

    tokens_i = sum over the pieces k of response i's life of
               seconds_k / ((step + per_seq * b_k) * slowdown^train_k * scoring^score_k)

with ``b_k`` the responses its engine was decoding during piece k (from every `open`/`sample`
record of that engine), ``train_k`` whether a `driver make_experience` / `train` span was
running and ``score_k`` whether, the trainer idle, a `reward` / `ref` prefill or score span was
(the reward forward inside OpenRLHF's make_experience counts as the trainer's). The four costs
minimise sum_i tokens_i * (predicted_i / tokens_i - 1)^2 (Gauss-Newton): a long response weighs
what it costs, and a short one's fixed start-up latency hardly counts. A factor whose condition
held for under 10 response-seconds is not seen: it keeps its prior.

Phases (make_experience, train) on a shared host: ``seconds = overhead + per_token * tokens *
(1 + (slowdown - 1) * f)``, ``f`` the share of the span during which some response was decoding;
one slowdown for both phases, chosen on a grid, each phase's line fitted for it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from openrlhf_oppo import timeline

TRAIN_STAGES = ("make_experience", "train")  # driver spans during which the trainer computes
SCORER_ROLES = ("reward", "ref")  # OPPO's streaming scorers: their prefill / score spans


@dataclass(frozen=True)
class DecodeLife:
    """One finished response's life on its engine, cut where its engine's batch or the trainer changed.

    Attributes:
        tokens (int): tokens it decoded.
        seconds (dict[tuple[int, bool, bool], float]): (responses its engine decoded at once, the
            trainer computing beside it, a scorer prefilling beside it) -> seconds of its life spent so.
    """

    tokens: int
    seconds: dict[tuple[int, bool, bool], float]


@dataclass(frozen=True)
class DecodeFit:
    step_s: float  # per engine iteration
    per_seq_s: float  # per running response, per iteration
    slowdown: float  # iterations take this many times longer while the trainer computes
    slowdown_measured: bool  # False: under MIN_SECONDS of decoding beside the trainer, `slowdown` is the prior
    responses: int
    scoring: float = 1.0  # ... while a streaming scorer prefills on the same host
    scoring_measured: bool = False  # False: under MIN_SECONDS beside a scorer, `scoring` is the prior


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


def scorer_intervals(rows: list[dict]) -> list[tuple[float, float]]:
    return timeline.merge([(r["t0"], r["t1"]) for r in rows if r["kind"] == "span" and r["role"] in SCORER_ROLES
                           and r["stage"] in ("prefill", "score")])


def decode_lives(rows: list[dict], warmup_steps: int) -> list[DecodeLife]:
    """Every response finished after warm-up with >= 2 tokens, its life cut into pieces; a
    response whose life spans a weight sync (its engine paused or reloaded) is left out."""
    syncs = [(r["t0"], r["t1"]) for r in timeline.stage_spans(rows, "driver", "weight_sync")]
    busy, scoring = trainer_intervals(rows), scorer_intervals(rows)
    cut_s = warmup_end_s(rows, warmup_steps)
    end_s = max(r["t1"] for r in rows)
    finished = {(timeline.worker(r), r["key"]) for r in rows if r["kind"] == "sample"}
    by_engine: dict[tuple, list[dict]] = {}
    for r in rows:  # a response never finished (still decoding, killed) occupied its engine to the end
        if r["kind"] == "sample" or (r["kind"] == "open" and (timeline.worker(r), r["key"]) not in finished):
            by_engine.setdefault(timeline.worker(r), []).append(r if r["kind"] == "sample" else {**r, "t1": end_s})
    lives = []
    for lives_on_engine in by_engine.values():
        edges = sorted({t for r in lives_on_engine for t in (r["t0"], r["t1"])}
                       | {t for iv in busy + scoring for t in iv})
        pieces = _pieces(edges, lives_on_engine, busy, scoring)
        for r in lives_on_engine:
            if (r["kind"] != "sample" or r.get("tokens", 0) < 2 or r.get("finish") == "abort" or r["t0"] < cut_s
                    or r["t1"] <= r["t0"] or any(r["t0"] < b and r["t1"] > a for a, b in syncs)):
                continue
            seconds: dict[tuple[int, bool, bool], float] = {}
            for i in range(bisect.bisect_left(edges, r["t0"]), bisect.bisect_left(edges, r["t1"])):
                key, dt = pieces[i]
                seconds[key] = seconds.get(key, 0.0) + dt
            lives.append(DecodeLife(r["tokens"], seconds))
    return lives


def _pieces(edges: list[float], lives: list[dict], busy: list[tuple[float, float]],
            scoring: list[tuple[float, float]]) -> list[tuple[tuple, float]]:
    """((responses decoding, trainer computing, a scorer prefilling while the trainer does not),
    seconds) of each gap between consecutive edges."""
    delta = [0] * (len(edges) + 1)
    for r in lives:
        delta[bisect.bisect_left(edges, r["t0"])] += 1
        delta[bisect.bisect_left(edges, r["t1"])] -= 1
    out, running = [], 0
    for i, (a, b) in enumerate(zip(edges, edges[1:])):
        running += delta[i]
        mid = (a + b) / 2
        train = _inside(busy, mid)
        out.append(((running, train, not train and _inside(scoring, mid)), b - a))
    return out


def _inside(intervals: list[tuple[float, float]], t: float) -> bool:
    """`t` in one of the sorted, disjoint `intervals`."""
    j = bisect.bisect_right(intervals, (t, float("inf"))) - 1
    return j >= 0 and intervals[j][0] <= t < intervals[j][1]


MIN_SECONDS = 10.0  # a slowdown is measured when responses decoded this long (summed) under its condition
_LOWER = (1e-7, 0.0, 1.0, 1.0)  # step, per_seq, slowdown, scoring: a neighbour never speeds decoding up


def fit_decode(lives: list[DecodeLife], prior_slowdown: float, prior_scoring: float = 1.0) -> DecodeFit:
    """The decode costs of the docstring's model (Gauss-Newton from the per-response line)."""
    if not lives:
        raise ValueError("no finished response in the timelines (`sample` records of role rollout)")
    measured = [sum(dt for life in lives for key, dt in life.seconds.items() if key[c]) >= MIN_SECONDS
                for c in (1, 2)]
    xs, ys, ws = [], [], []
    for life in lives:
        dur = sum(life.seconds.values())
        xs.append(sum(key[0] * dt for key, dt in life.seconds.items()) / dur)
        ys.append(dur / life.tokens)
        ws.append(float(life.tokens))
    a, b = nonneg_line(xs, ys, ws)
    free = [True, True, *measured]
    p = [max(a, 1e-6), max(b, 0.0), max(prior_slowdown, 1.0) if measured[0] else 1.0,
         max(prior_scoring, 1.0) if measured[1] else 1.0]
    for _ in range(200):
        step = _gauss_newton_step(lives, p, free)
        new = [max(x + dx, low) if f else x for x, dx, f, low in zip(p, step, free, _LOWER)]
        if _loss(lives, new) > _loss(lives, p):  # halve a step that overshoots
            new = [(x + y) / 2 for x, y in zip(p, new)]
        done = all(abs(x - y) <= 1e-12 + 1e-10 * abs(y) for x, y in zip(new, p))
        p = new
        if done:
            break
    return DecodeFit(p[0], p[1], p[2] if measured[0] else prior_slowdown, measured[0], len(lives),
                     p[3] if measured[1] else prior_scoring, measured[1])


def _predict(life: DecodeLife, p: list[float]) -> tuple[float, list[float]]:
    """Predicted tokens and their gradient in (step, per_seq, slowdown, scoring)."""
    a, b, s, r = p
    tok, grad = 0.0, [0.0] * 4
    for (n, train, score), dt in life.seconds.items():
        f = (s if train else 1.0) * (r if score else 1.0)
        it = (a + b * n) * f
        x = dt / it
        tok += x
        grad[0] -= x * f / it
        grad[1] -= x * n * f / it
        if train:
            grad[2] -= x / s
        if score:
            grad[3] -= x / r
    return tok, grad


def _loss(lives: list[DecodeLife], p: list[float]) -> float:
    return sum(life.tokens * (_predict(life, p)[0] / life.tokens - 1.0) ** 2 for life in lives)


def _gauss_newton_step(lives: list[DecodeLife], p: list[float], free: list[bool]) -> list[float]:
    idx = [i for i, f in enumerate(free) if f]
    jtj = [[0.0] * len(idx) for _ in idx]
    jtr = [0.0] * len(idx)
    for life in lives:
        tok, grad = _predict(life, p)
        w = 1.0 / life.tokens  # residual sqrt(tokens) * (pred / tokens - 1)
        r = tok - life.tokens
        g = [grad[i] for i in idx]
        for i in range(len(idx)):
            jtr[i] += w * g[i] * r
            for j in range(len(idx)):
                jtj[i][j] += w * g[i] * g[j]
    for i in range(len(idx)):
        jtj[i][i] *= 1.0 + 1e-9  # Levenberg's damping, for a flat direction
    step = [0.0] * len(p)
    for i, dx in zip(idx, _solve(jtj, jtr)):
        step[i] = -dx
    return step


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
