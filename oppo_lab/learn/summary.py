"""The build's report: the stage timer (`Stages`), the numbers of a built asset directory
(`measure`: trainer losses from TensorBoard, the reward model's held-out accuracy, the SFT
policy's samples and its per-prompt baseline) and their table (`summary_table`)."""

from __future__ import annotations

import json
import math
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from openrlhf_oppo.tasks.learn.assets import ASSET_VERSION, LearnAssets, LearnSpec, read_jsonl
from openrlhf_oppo.tasks.learn.evaluation import evaluate_policy, load_reward_model, rm_accuracy, sft_baseline


def _cpu_seconds() -> float:
    """CPU time (user + system) of this process and of its waited-for children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclass
class Stages:
    """Wall and CPU time of each build stage (s), in order. CPU time is what the stage
    would take alone on the machine (the trainers run one thread each); wall time
    includes waiting for cores that other jobs hold."""

    seconds: dict[str, float] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)

    def run(self, name: str, fn, log=print):
        log(f"learn: [{len(self.seconds) + 1}] {name} ...")
        start, cpu_start = time.perf_counter(), _cpu_seconds()
        result = fn()
        self.seconds[name] = time.perf_counter() - start
        self.cpu_seconds[name] = _cpu_seconds() - cpu_start
        log(f"learn: [{len(self.seconds)}] {name}: {self.seconds[name]:.1f} s ({self.cpu_seconds[name]:.1f} s CPU)")
        return result


def scalars(log_dir: Path, tag: str) -> list[float]:
    """One TensorBoard scalar series (by step) from the event files under `log_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[int, float] = {}
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values.update({e.step: e.value for e in acc.Scalars(tag)})
    return [values[s] for s in sorted(values)]



def measure(assets: LearnAssets, spec: LearnSpec, stages: Stages | None = None, log=print) -> dict:
    """The numbers of a built (or trained) asset directory: trainer losses from TensorBoard,
    reward-model held-out accuracy and the SFT policy's samples, both in bf16 as PPO runs
    them; with `stages`' times so far plus its own. Writes the SFT policy's baseline per RL
    prompt (`sft_baseline`) to `assets.sft_baseline`."""
    from transformers import AutoTokenizer

    stages = Stages() if stages is None else stages
    tokenizer = AutoTokenizer.from_pretrained(assets.tokenizer)
    reward_model = stages.run("load reward model (as PPO does)", lambda: load_reward_model(assets.reward), log)
    heldout = read_jsonl(assets.data / "rm_heldout.jsonl")
    rm_acc = stages.run("RM held-out accuracy",
                        lambda: rm_accuracy(reward_model, tokenizer, heldout, spec.lengths), log)
    policy = stages.run("SFT policy samples", lambda: evaluate_policy(assets, spec, reward_model, tokenizer), log)
    baseline = stages.run("SFT baseline per RL prompt",
                          lambda: sft_baseline(assets, spec, reward_model, tokenizer), log)
    assets.sft_baseline.write_text("".join(json.dumps(row) + "\n" for row in baseline))
    sft_loss = scalars(assets.root / "logs" / "sft", "train/gpt_loss")
    rm_loss = scalars(assets.root / "logs" / "rm", "train/loss")
    rm_eval = scalars(assets.root / "logs" / "rm", "eval/acc_mean")
    return {
        "version": ASSET_VERSION,
        "spec": asdict(spec),
        "actor_params": _parameters(assets.actor),
        "reward_params": sum(p.numel() for p in reward_model.parameters()),
        "sft_steps": len(sft_loss),
        "sft_loss_first": sft_loss[0] if sft_loss else None,
        "sft_loss_last": sft_loss[-1] if sft_loss else None,
        "rm_train_pairs": _rows(assets.data / "rm_train.jsonl"),
        "rm_policy_pairs": _rows(assets.data / "rm_policy.jsonl"),
        "rm_steps": len(rm_loss),
        "rm_loss_first": rm_loss[0] if rm_loss else None,
        "rm_loss_last": rm_loss[-1] if rm_loss else None,
        "rm_heldout_pairs": len(heldout),
        "rm_heldout_accuracy": rm_acc["accuracy"],
        "rm_heldout_accuracy_by_kind": rm_acc["by_kind"],
        "rm_heldout_accuracy_by_band": rm_acc["by_band"],
        "rm_heldout_accuracy_trainer_eval": rm_eval[-1] if rm_eval else None,
        "sft_policy": policy,
        "stage_seconds": stages.seconds,
        "stage_cpu_seconds": stages.cpu_seconds,
        "total_seconds": sum(stages.seconds.values()),
        "total_cpu_seconds": sum(stages.cpu_seconds.values()),
    }


def _rows(path: Path) -> int | None:
    """Rows of a JSONL file (None if absent), without parsing them."""
    if not path.exists():
        return None
    with path.open() as f:
        return sum(1 for line in f if line.strip())


def _parameters(model_dir: Path) -> int:
    """Parameter count of a saved model (one safetensors file), without loading it."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def summary_table(s: dict) -> str:
    """The build's numbers as a two-column table."""
    p = s["sft_policy"]
    tokens = p["response_tokens"]

    def num(x, fmt=".3f"):
        return "n/a" if x is None else format(x, fmt)

    rows = [
        ("actor / reward params", f"{s['actor_params']:,} / {s['reward_params']:,}"),
        ("SFT loss first -> last", f"{num(s['sft_loss_first'])} -> {num(s['sft_loss_last'])} ({s['sft_steps']} steps)"),
        ("RM training pairs", f"{s['rm_train_pairs']:,}, of which {s['rm_policy_pairs']:,} gold vs the SFT "
                              "policy's own wrong samples"),
        ("RM loss first -> last", f"{num(s['rm_loss_first'])} -> {num(s['rm_loss_last'])} ({s['rm_steps']} steps)"),
        ("RM held-out accuracy", f"{s['rm_heldout_accuracy']:.3f} on {s['rm_heldout_pairs']} pairs (bf16, as PPO runs "
                                 f"it; {num(s['rm_heldout_accuracy_trainer_eval'])} in train_rm's own eval)"),
        *((f"  {kind}", f"{acc:.3f}") for kind, acc in s["rm_heldout_accuracy_by_kind"].items()),
        *((f"  {band} lists", f"{acc:.3f}") for band, acc in s["rm_heldout_accuracy_by_band"].items()),
        ("SFT exact match (T=1)", f"{p['exact_match']:.3f} on {p['prompts']} RL prompts; "
                                  f"{num(p['exact_match_unseen'])} on {p['unseen_prompts']} unseen in SFT"),
        *((f"  {band} lists", f"{v['exact_match']:.3f} ({v['n']})") for band, v in p["exact_match_by_band"].items()),
        ("response tokens", f"median {tokens['median']}, p95 {tokens['p95']}, max {tokens['max']}, "
                            f"{tokens['at_cap']:.1%} at the cap"),
        ("RM on SFT's wrong samples", f"gold answer scored higher for {num(p['reward_gold_above_wrong_sample'])} "
                                      f"of {p['wrong_samples']}"),
        ("RM AUC on SFT samples", f"{num(p['reward_auc_correct_vs_wrong'])} (correct vs wrong, across prompts)"),
        *((f"time: {name}", f"{sec:.1f} s ({s['stage_cpu_seconds'][name]:.1f} s CPU)")
          for name, sec in s["stage_seconds"].items()),
        ("time: total", f"{s['total_seconds']:.1f} s ({s['total_cpu_seconds']:.1f} s CPU)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["learn task build summary", *(f"  {k:<{width}}  {v}" for k, v in rows)])

