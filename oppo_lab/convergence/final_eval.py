"""`bench convergence` on the learn task: the SFT policy and each run's final actor on
prompts no run trained on (exact match overall and by list length, learned reward, length)."""

from __future__ import annotations

import statistics
from pathlib import Path

from openrlhf_oppo.bench.table import fmt, name_width, spread, table_line
from openrlhf_oppo.tasks import learn
from openrlhf_oppo.tasks.learn.evaluation import SAMPLES_PER_PROMPT, evaluate_against_sft
from oppo_lab.convergence.numbers import permutation_p
from oppo_lab.convergence.runs import task_root

FINAL_EVAL_KEYS = ("exact_match", "mean_reward", "exact_match_mid", "exact_match_long", "median_response_tokens",
                   "at_cap")
AGAINST_KEYS = ("exact_match", "mean_reward", "at_cap")
"""Compared with the reference schedule's actors: what was learned, and the loops left (lengths)."""


def evaluate(config_path: str, out: Path, runs: dict[str, dict[int, dict]]) -> dict | None:
    """The learn task's SFT policy and every finished run's final actor (`<run>/model`) on
    the same prompts no run trained on (`tasks.learn.evaluation.heldout_records`), SAMPLES_PER_PROMPT
    samples each at temperature 1 with one seed: exact match (overall, on 7-14 and 15-40 word
    lists), mean learned reward, median response length. None for another task."""
    from openrlhf_oppo.integrations.launch import yaml_config

    variant, root = task_root(config_path)
    if variant not in learn.VARIANTS:
        return None
    if not (root / "BUILD_OK").exists():
        print(f"[bench convergence] no built task assets at {root}: no final evaluation", flush=True)
        return None
    trained = int(yaml_config.load(config_path).flags.get("data.max_samples") or 0)
    actors = {f"{name}-s{seed}": out / f"{name}-s{seed}" / "model" for name, by_seed in runs.items()
              for seed, r in by_seed.items() if r["returncode"] == 0 and (out / f"{name}-s{seed}" / "model").is_dir()}
    prompts, per_actor = evaluate_against_sft(root, learn.VARIANTS[variant], actors, trained)
    rows = [{"schedule": "sft", **{k: spread([per_actor["sft"][k]]) for k in FINAL_EVAL_KEYS}}]
    by_schedule = {name: [per_actor[f"{name}-s{seed}"] for seed in by_seed if f"{name}-s{seed}" in per_actor]
                   for name, by_seed in runs.items()}
    ref = next(iter(runs), None)
    for name, figs in by_schedule.items():
        if figs:
            rows.append({"schedule": name, "runs": len(figs),
                         **{k: spread(f[k] for f in figs) for k in FINAL_EVAL_KEYS},
                         **({"against_ref": against(figs, by_schedule[ref])} if name != ref else {})})
    return {"prompts": prompts, "samples_per_prompt": SAMPLES_PER_PROMPT, "first_row": trained,
            "reference": ref, "rows": rows, "per_actor": per_actor}


def against(figs: list[dict], ref_figs: list[dict]) -> dict:
    """For each of AGAINST_KEYS, a schedule's final actors against the reference's, over
    seeds: whether the schedule's median lies within the reference's min-max, the difference
    of the means and its two-sided permutation p-value (`numbers.permutation_p`)."""
    out = {}
    for k in AGAINST_KEYS:
        a = [f[k] for f in figs if f[k] is not None]
        b = [f[k] for f in ref_figs if f[k] is not None]
        if not a or not b:
            continue
        out[k] = {"inside_ref_range": min(b) <= statistics.median(a) <= max(b),
                  "mean_diff": statistics.fmean(a) - statistics.fmean(b), "p": permutation_p(a, b)}
    return out


def print_table(fe: dict) -> None:
    print(f"final actors on {fe['prompts']} held-out prompts (prompts.jsonl rows {fe['first_row']}+, "
          f"{fe.get('samples_per_prompt', 1)} samples each at T=1; median [min-max] over seeds):")
    name_w = name_width(r["schedule"] for r in fe["rows"])
    cols = [("actor", name_w), ("exact match", 19), ("learned reward", 22), ("7-14 words", 19), ("15-40 words", 19),
            ("median len", 12), ("at cap", 19)]
    widths = [w for _, w in cols]
    print(table_line([name for name, _ in cols], widths))
    for r in fe["rows"]:
        cells = [r["schedule"], fmt(r["exact_match"], ".3f"), fmt(r["mean_reward"], ".3f"),
                 fmt(r["exact_match_mid"], ".3f"), fmt(r["exact_match_long"], ".3f"),
                 fmt(r["median_response_tokens"], ".0f"), fmt(r.get("at_cap"), ".3f")]
        print(table_line(cells, widths))
    compared = [r for r in fe["rows"] if r.get("against_ref")]
    if not compared:
        return
    print(f"against {fe['reference']}, over seeds: is the median within {fe['reference']}'s min-max, the difference "
          f"of the means, its two-sided permutation p")
    widths = [name_w, 26, 26, 26]
    print(table_line(["actor", "exact match", "learned reward", "at cap"], widths))
    for r in compared:
        cells = [r["schedule"]]
        for k in AGAINST_KEYS:
            c = r["against_ref"].get(k)
            p = "-" if c is None or c["p"] is None else f"{c['p']:.2f}"
            cells.append("-" if c is None else
                         f"{'within' if c['inside_ref_range'] else 'OUTSIDE'} {c['mean_diff']:+.3f} p {p}")
        print(table_line(cells, widths))
