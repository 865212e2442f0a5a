"""`python -m oppo_lab calibrate RUN_DIR... --output FILE`: this machine's costs from real runs.

Reads each run's timeline (`openrlhf_oppo.timeline`; stage names of
`integrations.runtime.timeline_hooks`) and its `rollouts.jsonl`, and writes a preset whose
`costs`, `efficiency` overheads and `lengths` come from them (the split, workload and
`oppo:` section are the `--base` preset's):

    decode      every response after warm-up (`sample` record), its life cut where its engine's
                batch or the trainer changed -> decode_step_s + decode_per_seq_s * b per iteration,
                times decode_slowdown_shared while a make_experience / train span runs, times
                decode_slowdown_scoring while (the trainer idle) a streaming scorer prefills
                (`fitting.fit_decode`; responses that span a weight sync left out)
    generate    a `driver generate` span minus the decoding inside it -> generate_overhead_s
    reward      `reward prefill` / `score` spans with token counts -> prefill_call_s + per token
    make_experience / train   `driver` spans against the step's tokens (rollouts.jsonl, padded
                per micro-batch unless the base packs; make_experience's times its forwards,
                the reward model's where the run did not stream it), slowed by
                train_slowdown_shared for the share spent beside decoding -> per-token costs +
                phase_overhead_s
    weight_sync `driver weight_sync` spans -> weight_sync_s (their median: the whole sync; sync_overhead_s 0)
    lengths     response lengths of rollouts.jsonl (sequence - prompt tokens), an empirical file

The shared-host slowdowns can only be seen in runs where decoding and training overlap
(OPPO's carried responses, OpenRLHF's async modes) or decoding and a streaming scorer (OPPO's
streaming reward); without such a run the base's are kept.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

from openrlhf_oppo import config as oppo_config
from openrlhf_oppo import timeline
from openrlhf_oppo.sim import presets
from openrlhf_oppo.sim.world import padded_tokens
from oppo_lab import sim as lab_sim
from oppo_lab.sim import fitting


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


def reward_fit(spans: list[dict]) -> dict[str, float] | None:
    """`reward prefill` / `score` spans with token counts -> a call's fixed and per-token cost."""
    if len(spans) < 2:
        return None
    xs, ys = [float(r["tokens"]) for r in spans], [r["t1"] - r["t0"] for r in spans]
    a, b = fitting.nonneg_line(xs, ys, [1.0] * len(spans))
    return {"prefill_call_s": a, "prefill_per_token_s": b, "calls": len(spans)}


def step_tokens(rollouts: Path, prompt_tokens: int, micro_batch: int, packing: bool,
                buckets: bool = False) -> tuple[list[int], list[int]]:
    """(tokens make_experience's forwards and training each process per step, every response
    length) from rollouts.jsonl: padded per micro-batch of the step's samples in order, or sorted
    by length first where the run grouped its micro-batches by length (both phases)."""
    tokens, lengths = [], []
    for line in rollouts.read_text().splitlines():
        if not line.strip():
            continue
        seqs = [len(s["sequence"]) for s in json.loads(line)["samples"]]
        lengths += [max(1, n - prompt_tokens) for n in seqs]
        tokens.append(padded_tokens(seqs, micro_batch, packing, buckets))
    return tokens, lengths


def length_buckets(run: Path) -> bool:
    """Whether the run grouped its training micro-batches by length: an OPPO run (its command is
    OPPO's entry module) whose `--oppo.*` flags leave `train.length_buckets` on."""
    path = run / "command.json"
    argv = json.loads(path.read_text()) if path.exists() else []
    if "openrlhf_oppo.cli.train_ppo_ray" not in argv:
        return False
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    oppo_config.add_cli_flags(parser)
    return oppo_config.from_cli(parser.parse_known_args(argv)[0]).train.length_buckets


def sync_seconds(rows: list[dict]) -> list[float]:
    """Each weight sync, from the driver's call to the engines' resume: a background sync
    (`--oppo.staleness.background_sync`) returns after the gather and ends when its loads land
    (its `sync`/`landing` span, started as the call returned)."""
    syncs = sorted(timeline.stage_spans(rows, "driver", "weight_sync"), key=lambda r: r["t0"])
    landings = sorted(timeline.stage_spans(rows, "sync", "landing"), key=lambda r: r["t0"])
    if len(landings) != len(syncs):  # a foreground sync (none land), or a run cut short: the calls alone
        return [r["t1"] - r["t0"] for r in syncs]
    return [max(s["t1"], land["t1"]) - s["t0"] for s, land in zip(syncs, landings, strict=True)]


def calibrate(run_dirs: list[Path], base: presets.SimConfig, prompt_tokens: int, warmup_steps: int) -> dict:
    """Measured costs and lengths of the runs, as preset sections."""
    lives, phases, syncs, lengths, gen_over, reward_spans = [], [], [], [], [], []
    w, e = base.workload, base.efficiency
    for run in run_dirs:
        tl, ro = run / "timeline", run / "rollouts.jsonl"
        if not tl.is_dir() or not ro.exists():
            raise ValueError(f"{run}: a run directory needs timeline/ and rollouts.jsonl (from `openrlhf-oppo train`)")
        rows = timeline.read(tl)
        per_step, lens = step_tokens(ro, prompt_tokens, w.micro_batch_size, w.packing, length_buckets(run))
        lengths += lens
        gen_over.append(generate_overhead(rows))
        lives += fitting.decode_lives(rows, warmup_steps)
        phases += phase_points(rows, per_step, warmup_steps, experience_forwards(rows, w))
        syncs += sync_seconds(rows)[warmup_steps:]
        reward_spans += [r for r in rows if r["kind"] == "span" and r["role"] == "reward"
                         and r["stage"] in ("prefill", "score") and r.get("tokens")]
    dec = fitting.fit_decode(lives, e.decode_slowdown_shared, e.decode_slowdown_scoring or 1.0)
    lines, train_slow, train_slow_measured = fitting.fit_phases(phases, e.train_slowdown_shared)
    (exp_over, exp_tok), (tr_over, tr_tok) = lines.get("make_experience", (0.0, 0.0)), lines.get("train", (0.0, 0.0))
    phase_over = min(exp_over, tr_over)
    sync_s = statistics.median(syncs) if syncs else 0.0
    exp_tokens = [p.tokens for p in phases if p.stage == "make_experience"]
    costs = {"decode_step_s": dec.step_s, "decode_per_seq_s": dec.per_seq_s, "decode_per_context_token_s": 0.0,
             "forward_per_token_s": exp_tok,  # per token of one forward; the intercept beyond phase_overhead_s
             # is experience_overhead_s
             "train_per_token_s": _per_token(tr_tok, tr_over - phase_over,
                                             [p.tokens for p in phases if p.stage == "train"]),
             "weight_sync_s": max(1e-3, sync_s)}
    rew = reward_fit(reward_spans)
    if rew:
        costs.update(prefill_call_s=rew["prefill_call_s"], prefill_per_token_s=rew["prefill_per_token_s"])
    efficiency = {"phase_overhead_s": phase_over, "generate_overhead_s": statistics.median(gen_over),
                  "experience_overhead_s": exp_over - phase_over,
                  "decode_slowdown_shared": dec.slowdown, "train_slowdown_shared": train_slow,
                  "decode_slowdown_scoring": dec.scoring if dec.scoring_measured else e.decode_slowdown_scoring,
                  "sync_overhead_s": 0.0}
    notes = {"responses": dec.responses, "steps": len(exp_tokens), "reward_calls": rew["calls"] if rew else 0,
             "decode_slowdown_measured": dec.slowdown_measured,
             "decode_scoring_measured": dec.scoring_measured,
             "train_slowdown_measured": train_slow_measured, "overheads": (exp_over, tr_over)}
    return {"costs": costs, "efficiency": efficiency, "lengths": lengths, "notes": notes}


def experience_forwards(rows: list[dict], w: presets.Workload) -> int:
    """The forwards make_experience runs over a step's tokens: old log-probs, the reference and
    the critic as the base has them, and the reward model unless the run streamed it (its
    `reward prefill` spans)."""
    streamed = any(r["kind"] == "span" and r["role"] == "reward" and r["stage"] == "prefill" for r in rows)
    return 1 + int(w.reference) + int(w.critic) + int(w.reward_model and not streamed)


def phase_points(rows: list[dict], per_step: list[int], warmup_steps: int, forwards: int) -> list[fitting.PhasePoint]:
    """Each step's make_experience and train spans after warm-up, with the tokens the phase
    processes (make_experience: the step's tokens x its `forwards`; train: the step's tokens) and
    the share of the span during which some response was decoding (on a shared host: slower)."""
    decoding = timeline.merge([(r["t0"], r["t1"]) for r in rows if r["kind"] == "sample"])
    out = []
    for stage in fitting.TRAIN_STAGES:
        spans = timeline.stage_spans(rows, "driver", stage)
        scale = forwards if stage == "make_experience" else 1
        for r, tokens in list(zip(spans, per_step))[warmup_steps:]:
            dur = r["t1"] - r["t0"]
            share = timeline.covered_s(decoding, r["t0"], r["t1"]) / dur if dur > 0 else 0.0
            out.append(fitting.PhasePoint(stage, float(tokens * scale), dur, share))
    return out


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
    out.parent.mkdir(parents=True, exist_ok=True)
    lengths_file.write_text(json.dumps(found["lengths"]))
    raw["costs"] = {k: float(f"{v:.6g}") for k, v in found["costs"].items()}
    raw.setdefault("efficiency", {}).update({k: float(f"{v:.6g}") for k, v in found["efficiency"].items()})
    rel = lengths_file.name if out.parent.resolve() == presets.PRESET_DIR.resolve() else str(lengths_file.resolve())
    raw["lengths"] = {**(raw.get("lengths") or {}), "kind": "empirical", "path": rel, "prompt_tokens": prompt_tokens}
    raw["lengths"].pop("quantiles", None)
    raw.pop("name", None)
    n = found["notes"]
    seen = {True: "measured", False: f"kept from {base_name} (no overlap in these runs)"}
    exp_over, tr_over = n["overheads"]
    head = [
        f"# Calibrated by `python -m oppo_lab calibrate {' '.join(map(str, run_dirs))}`",
        f"# on {datetime.date.today().isoformat()}: {n['responses']} responses, {n['steps']} steps, "
        f"{n['reward_calls']} reward calls with token counts.",
        "# decode: each response's life cut where its engine's batch b or the trainer changed;",
        "# tokens = sum of seconds / ((decode_step_s + decode_per_seq_s * b) x decode_slowdown_shared",
        "# while a make_experience / train span runs, x decode_slowdown_scoring while, the trainer idle,",
        "# a streaming scorer prefills), Gauss-Newton weighted by tokens;",
        f"# decode_slowdown_shared {seen[n['decode_slowdown_measured']]}; decode_slowdown_scoring "
        f"{seen[n['decode_scoring_measured']].replace('overlap', 'streaming scorer')}.",
        "# make_experience and train: driver spans vs the step's tokens, x train_slowdown_shared for the",
        f"# share of the span beside decoding (one factor for both; {seen[n['train_slowdown_measured']]});",
        "# forward_per_token_s: per token of each forward make_experience ran (the reward model's only where",
        "# it was not streamed); phase_overhead_s = the smaller intercept",
        f"# (make_experience {exp_over:.3f} s, train {tr_over:.3f} s), experience_overhead_s the rest;",
        "# weight_sync_s = the median weight_sync span, the whole sync (sync_overhead_s 0).",
        f"# lengths: {len(found['lengths'])} responses of rollouts.jsonl (sequence - {prompt_tokens} prompt tokens).",
        f"# Split, workload and oppo sections: from the base preset {base_name}.",
        "",
    ]
    body = yaml.safe_dump(raw, sort_keys=False, default_flow_style=None)
    out.write_text("\n".join(head) + _with_key_comments(body, base_path.read_text()))


def _with_key_comments(body: str, base_text: str) -> str:
    """The base preset's comment lines above a top-level key (not its header), put back above that key."""
    comments: dict[str, list[str]] = {}
    pending: list[str] = []
    seen_key = False
    for line in base_text.splitlines():
        if line.startswith("#"):
            pending.append(line)
        elif line and not line[0].isspace() and ":" in line:
            if seen_key and pending:
                comments[line.split(":", 1)[0]] = pending
            pending, seen_key = [], True
        else:
            pending = [] if not line.strip() else pending
    out = []
    for line in body.splitlines():
        key = line.split(":", 1)[0] if line and not line[0].isspace() else None
        out += comments.get(key, []) + [line]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m oppo_lab calibrate", description=__doc__.splitlines()[0])
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
    base = lab_sim.load_preset(args.base)
    prompt_tokens = base.lengths.prompt_tokens if args.prompt_tokens is None else args.prompt_tokens
    found = calibrate(args.runs, base, prompt_tokens, args.warmup_steps)
    write_preset(args.output, found, args.base, args.runs, prompt_tokens)
    print(f"wrote {args.output} ({len(found['lengths'])} response lengths beside it)")
    for section in ("costs", "efficiency"):
        for k, v in found[section].items():
            print(f"  {section}.{k} = {v:.6g}")
    return 0
