"""`openrlhf-oppo simulate calibrate RUN_DIR... --output FILE`: this machine's costs from real runs.

Reads each run's timeline (`openrlhf_oppo.timeline`; stage names of
`integrations.runtime.timeline_hooks`) and its `rollouts.jsonl`, and writes a preset whose
`costs`, `efficiency` overheads and `lengths` come from them (the split, workload and
`oppo:` section are the `--base` preset's):

    decode      every response (`sample` record): seconds per token against the mean number
                of responses its engine decoded beside it -> decode_step_s + decode_per_seq_s * b
                (least squares, weighted by tokens; responses that span a weight sync left out)
    generate    a `driver generate` span minus the decoding inside it -> generate_overhead_s
    reward      `reward prefill` / `score` spans with token counts -> prefill_call_s + per token
    make_experience / train   `driver` spans against the step's tokens (rollouts.jsonl, padded
                per micro-batch unless the base packs) -> per-token costs + phase_overhead_s
    weight_sync `driver weight_sync` spans -> weight_sync_s (its median, less the phase overhead)
    lengths     response lengths of rollouts.jsonl (sequence - prompt tokens), an empirical file
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

from openrlhf_oppo import timeline
from openrlhf_oppo.sim import presets


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


def _nonneg_line(xs: list[float], ys: list[float], ws: list[float]) -> tuple[float, float]:
    """A line with intercept and slope >= 0 (a negative one is noise: refit with it at 0)."""
    a, b = weighted_line(xs, ys, ws)
    if b < 0:
        return sum(w * y for w, y in zip(ws, ys)) / sum(ws), 0.0
    if a < 0:
        return 0.0, sum(w * x * y for w, x, y in zip(ws, xs, ys)) / sum(w * x * x for w, x in zip(ws, xs))
    return a, b


def decode_fit(rows: list[dict]) -> dict[str, float]:
    """decode_step_s and decode_per_seq_s from the responses' spans."""
    syncs = [(r["t0"], r["t1"]) for r in timeline.stage_spans(rows, "driver", "weight_sync")]
    samples = [r for r in rows if r["kind"] == "sample" and r.get("tokens", 0) > 1 and r.get("finish") != "abort"
               and r["t1"] > r["t0"] and not any(r["t0"] < b and r["t1"] > a for a, b in syncs)]
    if not samples:
        raise ValueError("no finished response in the timelines (`sample` records of role rollout)")
    by_worker: dict[tuple, list[dict]] = {}
    for r in samples:
        by_worker.setdefault(timeline.worker(r), []).append(r)
    xs, ys, ws = [], [], []
    for group in by_worker.values():
        for r in group:
            dur = r["t1"] - r["t0"]
            overlap = sum(max(0.0, min(o["t1"], r["t1"]) - max(o["t0"], r["t0"])) for o in group)
            xs.append(overlap / dur)  # mean responses decoding at once, itself included
            ys.append(dur / r["tokens"])
            ws.append(float(r["tokens"]))
    a, b = _nonneg_line(xs, ys, ws)
    return {"decode_step_s": a, "decode_per_seq_s": b, "responses": len(samples)}


def generate_overhead(rows: list[dict]) -> float:
    gens = timeline.stage_spans(rows, "driver", "generate")
    samples = [r for r in rows if r["kind"] == "sample"]
    gaps = []
    for g in gens:
        inside = [s for s in samples if g["t0"] <= s["t0"] <= g["t1"]]
        if inside:
            first, last = min(s["t0"] for s in inside), max(s["t1"] for s in inside)
            gaps.append(max(0.0, (g["t1"] - g["t0"]) - (min(last, g["t1"]) - first)))
    return statistics.median(gaps) if gaps else 0.0


def reward_fit(rows: list[dict]) -> dict[str, float] | None:
    spans = [r for r in rows if r["kind"] == "span" and r["role"] == "reward" and r["stage"] in ("prefill", "score")
             and r.get("tokens")]
    if len(spans) < 2:
        return None
    a, b = _nonneg_line([float(r["tokens"]) for r in spans], [r["t1"] - r["t0"] for r in spans], [1.0] * len(spans))
    return {"prefill_call_s": a, "prefill_per_token_s": b, "calls": len(spans)}


def step_tokens(rollouts: Path, prompt_tokens: int, micro_batch: int, packing: bool) -> tuple[list[int], list[int]]:
    """(tokens the training devices process per step, every response length) from rollouts.jsonl."""
    per_step, lengths = [], []
    for line in rollouts.read_text().splitlines():
        if not line.strip():
            continue
        seqs = [len(s["sequence"]) for s in json.loads(line)["samples"]]
        lengths += [max(1, n - prompt_tokens) for n in seqs]
        if packing:
            per_step.append(sum(seqs))
        else:
            per_step.append(sum(len(seqs[i:i + micro_batch]) * max(seqs[i:i + micro_batch])
                                for i in range(0, len(seqs), micro_batch)))
    return per_step, lengths


def calibrate(run_dirs: list[Path], base: presets.SimConfig, prompt_tokens: int, warmup_steps: int) -> dict:
    """Measured costs and lengths of the runs, as preset sections."""
    rows_all, tokens_exp, exp_s, tokens_train, train_s, syncs, lengths, gen_over = [], [], [], [], [], [], [], []
    w = base.workload
    forwards = 1 + int(w.reference) + int(w.critic)
    for run in run_dirs:
        tl, ro = run / "timeline", run / "rollouts.jsonl"
        if not tl.is_dir() or not ro.exists():
            raise ValueError(f"{run}: a run directory needs timeline/ and rollouts.jsonl (from `openrlhf-oppo train`)")
        rows = timeline.read(tl)
        rows_all.append(rows)
        per_step, lens = step_tokens(ro, prompt_tokens, w.micro_batch_size, w.packing)
        lengths += lens
        gen_over.append(generate_overhead(rows))
        for stage, xs, ys in (("make_experience", tokens_exp, exp_s), ("train", tokens_train, train_s)):
            spans = [r["t1"] - r["t0"] for r in timeline.stage_spans(rows, "driver", stage)]
            pairs = list(zip(spans, per_step))[warmup_steps:]
            xs += [float(t) for _, t in pairs]
            ys += [s for s, _ in pairs]
        syncs += [r["t1"] - r["t0"] for r in timeline.stage_spans(rows, "driver", "weight_sync")][warmup_steps:]
    merged = [r for rows in rows_all for r in rows]
    dec = decode_fit(merged)
    exp_over, exp_tok = _nonneg_line(tokens_exp, exp_s, [1.0] * len(exp_s)) if exp_s else (0.0, 0.0)
    tr_over, tr_tok = _nonneg_line(tokens_train, train_s, [1.0] * len(train_s)) if train_s else (0.0, 0.0)
    phase_over = min(exp_over, tr_over)
    sync_s = statistics.median(syncs) if syncs else 0.0
    costs = {"decode_step_s": dec["decode_step_s"], "decode_per_seq_s": dec["decode_per_seq_s"],
             "decode_per_context_token_s": 0.0,
             "forward_per_token_s": _per_token(exp_tok, exp_over - phase_over, tokens_exp) / forwards,
             "train_per_token_s": _per_token(tr_tok, tr_over - phase_over, tokens_train),
             "weight_sync_s": max(1e-3, sync_s - phase_over)}
    rew = reward_fit(merged)
    if rew:
        costs.update(prefill_call_s=rew["prefill_call_s"], prefill_per_token_s=rew["prefill_per_token_s"])
    efficiency = {"phase_overhead_s": phase_over, "generate_overhead_s": statistics.median(gen_over)}
    notes = {"responses": dec["responses"], "steps": len(exp_s), "reward_calls": rew["calls"] if rew else 0,
             "forwards": forwards}
    return {"costs": costs, "efficiency": efficiency, "lengths": lengths, "notes": notes}


def _per_token(slope_s: float, extra_s: float, tokens: list[float]) -> float:
    """The fitted seconds per token; when the steps' tokens did not vary (no slope), the
    phase's time beyond the shared overhead spread over its mean tokens."""
    if slope_s > 0:
        return slope_s
    return max(0.0, extra_s) / max(1.0, statistics.fmean(tokens)) if tokens else 0.0


def write_preset(out: Path, found: dict, base_name: str, run_dirs: list[Path], prompt_tokens: int) -> None:
    """The base preset's YAML with measured `costs`, overheads and an empirical length file beside it."""
    import yaml

    base_path = presets.PRESET_DIR / f"{base_name}.yaml" if not Path(base_name).exists() else Path(base_name)
    raw = yaml.safe_load(base_path.read_text()) or {}
    lengths_file = out.with_name(out.stem + "-lengths.json")
    lengths_file.write_text(json.dumps(found["lengths"]))
    raw["costs"] = {k: float(f"{v:.6g}") for k, v in found["costs"].items()}
    raw.setdefault("efficiency", {}).update({k: float(f"{v:.6g}") for k, v in found["efficiency"].items()})
    rel = lengths_file.name if out.parent.resolve() == presets.PRESET_DIR.resolve() else str(lengths_file.resolve())
    raw["lengths"] = {**(raw.get("lengths") or {}), "kind": "empirical", "path": rel, "prompt_tokens": prompt_tokens}
    raw["lengths"].pop("quantiles", None)
    raw.pop("name", None)
    n = found["notes"]
    head = [
        f"# Calibrated by `openrlhf-oppo simulate calibrate {' '.join(map(str, run_dirs))}`",
        f"# on {datetime.date.today().isoformat()}: {n['responses']} responses, {n['steps']} steps, "
        f"{n['reward_calls']} reward calls with token counts.",
        "# decode: seconds per token vs responses decoded at once (least squares); make_experience and train:",
        f"# driver spans vs the step's tokens (forward_per_token_s = the fit / {n['forwards']} forwards);",
        f"# lengths: {len(found['lengths'])} responses of rollouts.jsonl (sequence - {prompt_tokens} prompt tokens).",
        f"# Split, workload and oppo sections: from the base preset {base_name}.",
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(head) + yaml.safe_dump(raw, sort_keys=False, default_flow_style=None))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="openrlhf-oppo simulate calibrate", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    p.add_argument(
        "--output",
        type=Path,
        required=True,
        help="the preset to write (e.g. openrlhf_oppo/sim/presets/cpu-longtail.yaml)",
    )
    p.add_argument("--base", default="cpu-longtail", help="preset whose split, workload and oppo sections are kept")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="prompt tokens to subtract from rollouts.jsonl sequences (default: the base preset's)",
    )
    p.add_argument("--warmup-steps", type=int, default=2, help="steps left out of the phase fits")
    args = p.parse_args(argv)
    base = presets.load_preset(args.base)
    prompt_tokens = base.lengths.prompt_tokens if args.prompt_tokens is None else args.prompt_tokens
    found = calibrate(args.runs, base, prompt_tokens, args.warmup_steps)
    write_preset(args.output, found, args.base, args.runs, prompt_tokens)
    print(f"wrote {args.output} ({len(found['lengths'])} response lengths beside it)")
    for section in ("costs", "efficiency"):
        for k, v in found[section].items():
            print(f"  {section}.{k} = {v:.6g}")
    return 0
