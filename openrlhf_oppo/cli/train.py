"""`openrlhf-oppo train --schedule sync --config configs/tiny-cpu.yaml [-- extra OpenRLHF flags]`

The CLI over openrlhf_oppo.integrations.launch.train_run (flags, task defaults, input
checks, launching with restarts); `run` is its. `main` runs it and closes with a summary of
what the run logged: steps, the reward from the first steps to the last, the mean time a step,
on the learn task what PPO learned (exact match against the SFT policy on the same prompts,
response length, loops at the cap), and where the outputs are; then, on the learn task, the
final actor against the SFT policy on prompts no step trained on (`heldout`). The figures go to
RUN_DIR/summary.json and the lines to RUN_DIR/train.log too, beside the whole run's timeline as
Chrome trace-event JSON (RUN_DIR/timeline.trace.json, for Perfetto). With `--dry-run`
it runs every check a launch runs (flags, the per-GPU, per-phase memory table, the inputs),
prints the command and exits: no Ray, no vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from openrlhf_oppo.integrations.launch import openrlhf_flags
from openrlhf_oppo.integrations.launch.train_run import dry_run, parse_args, run

__all__ = ["main", "run", "summary"]

REWARD_TAG = "train/reward"  # OpenRLHF's mean reward of the trained batch, one value a step
LEARNING_STEPS = 8  # the closing summary's learn-task figures: the first steps against the last
SUMMARY_JSON = "summary.json"  # the closing summary's figures, the held-out evaluation's among them


def main(argv: list[str]) -> int:
    if openrlhf_flags.asks_help(argv):  # before parsing: --schedule and --config are not needed for it
        print(openrlhf_flags.format_help())
        return 0
    if parse_args(argv).dry_run:
        return dry_run(parse_args(argv))
    args = parse_args(argv)
    result = run(argv)
    root = result.paths.root
    record = {"schedule": args.schedule, "config": args.config, "exit_code": result.returncode,
              "wall_s": round(result.wall_s, 1)}
    lines = summary(root, record)
    if result.returncode == 0:
        lines += heldout(root, record)
    lines += _chrome_trace(root)
    lines.append(f"this summary: {root / SUMMARY_JSON}")
    (root / SUMMARY_JSON).write_text(json.dumps(record, indent=1) + "\n")
    with (root / "train.log").open("a") as log:  # kept beside the run's own output
        for line in lines:
            print(f"openrlhf-oppo train: {line}", flush=True)
            log.write(f"openrlhf-oppo train: {line}\n")
    return result.returncode


def summary(root: Path, record: dict | None = None) -> list[str]:
    """The closing lines of a run directory (none when it logged no step); their figures go into
    `record` (RUN_DIR/summary.json)."""
    from openrlhf_oppo.bench.schedules import summarize_run, tensorboard_scalars

    record = {} if record is None else record
    scalars = tensorboard_scalars(root / "tensorboard") if (root / "tensorboard").is_dir() else {}
    rewards = [v for _, _, v in scalars.get(REWARD_TAG, [])]
    if not rewards:
        return []
    mean_s = summarize_run(root, warmup_steps=1, scalars=scalars)["mean_step_s"]
    pace = f"; {mean_s:.1f} s a step after the first" if mean_s else ""
    k = max(1, min(LEARNING_STEPS, len(rewards) // 2))  # a step's reward swings with its prompts: a mean
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    record.update(steps=len(rewards), mean_step_s=mean_s,
                  reward={"tag": REWARD_TAG, "steps_averaged": k, "first": first, "last": last})
    return [f"{len(rewards)} steps; reward {first:+.3f} -> {last:+.3f} ({REWARD_TAG}, mean of the first {k} steps "
            f"-> the last {k}){pace}",
            *_learning(root, k, record),
            f"outputs in {root}: train.log, tensorboard/, timeline/ (openrlhf-oppo plot timeline {root})"]


def _chrome_trace(root: Path) -> list[str]:
    """The run's timeline as Chrome trace-event JSON (the whole run, zoomable in Perfetto); nothing
    for a run that recorded no timeline."""
    from openrlhf_oppo.bench.trace_events import write_chrome_trace

    try:
        path = write_chrome_trace(root)
    except FileNotFoundError:
        return []
    return [f"the whole run's timeline: {path} (open it at https://ui.perfetto.dev)"]


def _learning(root: Path, steps: int, record: dict | None = None) -> list[str]:
    """For the learn task: exact match of the trained samples (rollouts.jsonl) against the SFT
    policy's on the same prompts (the task's data/sft_baseline.jsonl: what the prompts alone
    would give), mean response length and the share at the cap, the first `steps` steps
    against the last; nothing for another task, or a run of fewer than 2 * `steps` steps."""
    from openrlhf_oppo.tasks.learn.rollouts import jsonl, load_baseline, load_tokenizer, trained_samples

    records = jsonl(root / "rollouts.jsonl")
    flag = _run_flags(root)
    if len(records) < 2 * steps or "--actor.model_name_or_path" not in flag:
        return []
    actor = Path(flag["--actor.model_name_or_path"])
    text = load_tokenizer(actor)
    cap = int(flag["--rollout.max_new_tokens"]) if "--rollout.max_new_tokens" in flag else None
    baseline = load_baseline(actor.parent / "data" / "sft_baseline.jsonl") or {}

    def figures(rows: list[dict]) -> dict | None:
        found = [trained_samples(r, text) for r in rows]
        exact = [x for f in found for x in (f["exact"] or [])]
        lengths = [n for f in found for n in f["lengths"]]
        if not exact or len(exact) != len(lengths):  # not the learn task's prompts
            return None
        sft = [baseline[s["prompt"]][1] for r in rows for s in r["samples"] if s["prompt"] in baseline]
        sft_exact = None  # only where the baseline holds every trained sample's prompt
        if len(sft) == len(exact):
            sft_exact = sum(sft) / len(sft)
        at_cap = 0.0
        if cap:
            at_cap = sum(n >= cap for n in lengths) / len(lengths)
        return {"exact": sum(exact) / len(exact), "sft": sft_exact, "tokens": sum(lengths) / len(lengths),
                "at_cap": at_cap}

    first, last = figures(records[:steps]), figures(records[-steps:])
    if first is None or last is None:
        return []
    if record is not None:
        record["trained_samples"] = {"steps_averaged": steps, "cap_tokens": cap, "first": first, "last": last}
    sft = ""
    if first["sft"] is not None and last["sft"] is not None:
        sft = f" (the SFT policy on the same prompts: {first['sft']:.2f} -> {last['sft']:.2f})"
    return [f"exact match {first['exact']:.2f} -> {last['exact']:.2f}{sft}; mean response {first['tokens']:.0f} -> "
            f"{last['tokens']:.0f} tokens; at the {cap}-token cap {first['at_cap']:.0%} -> {last['at_cap']:.0%} "
            f"(trained samples, first {steps} steps -> last {steps}, rollouts.jsonl)"]


def heldout(root: Path, record: dict | None = None) -> list[str]:
    """For a learn-task run: the SFT policy and the run's final actor (`--ckpt.output_dir`) on
    the prompts after the trained ones (`--data.max_samples`), as the lab's convergence study scores
    them: exact match, learned reward, the share at the cap. A step's trained samples swing with
    its prompts and loops; these prompts are the same for both. Nothing for another task or
    where no prompt is left out."""
    from openrlhf_oppo.tasks import learn
    from openrlhf_oppo.tasks.learn import evaluation

    flag = _run_flags(root)
    if "--actor.model_name_or_path" not in flag or "--data.max_samples" not in flag:
        return []
    assets = learn.LearnAssets(Path(flag["--actor.model_name_or_path"]).parent)
    spec = next((spec for spec in learn.VARIANTS.values() if assets.is_built(spec)), None)
    model = Path(flag.get("--ckpt.output_dir", root / "model"))
    trained = int(flag["--data.max_samples"])
    if spec is None or not (model / "config.json").exists() or len(learn.read_jsonl(assets.prompts)) <= trained:
        return []
    print(f"openrlhf-oppo train: scoring the SFT policy and the final actor on held-out prompts "
          f"({evaluation.SAMPLES_PER_PROMPT} samples each) ...", flush=True)
    with _output_to(root / "train.log"):  # transformers', DeepSpeed's and OpenRLHF's loading lines, as in the run
        prompts, figs = evaluation.evaluate_against_sft(assets.root, spec, {"run": model}, trained)
    sft = figs["sft"]
    final = figs["run"]
    if record is not None:
        record["heldout"] = {"prompts": prompts, "samples_per_prompt": evaluation.SAMPLES_PER_PROMPT,
                             "cap_tokens": spec.max_new_tokens, "sft": sft, "final_actor": final}
    return [f"held out ({prompts} prompts no step trained on), the SFT policy -> this run's final actor: exact match "
            f"{sft['exact_match']:.3f} -> {final['exact_match']:.3f}; learned reward {sft['mean_reward']:+.3f} -> "
            f"{final['mean_reward']:+.3f}; at the {spec.max_new_tokens}-token cap {sft['at_cap']:.1%} -> "
            f"{final['at_cap']:.1%}"]


def _run_flags(root: Path) -> dict[str, str]:
    """The run's flags with a value, from the command it launched (`command.json`); {} without one."""
    import json

    argv = json.loads((root / "command.json").read_text()) if (root / "command.json").exists() else []
    return {k: v for k, v in zip(argv, argv[1:], strict=False) if k.startswith("--")}


@contextlib.contextmanager
def _output_to(path: Path):
    """This process's stdout and stderr (the file descriptors: libraries' loggers and progress
    bars hold their own references to the streams) appended to `path` for the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with path.open("ab") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
