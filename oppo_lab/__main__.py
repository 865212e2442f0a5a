"""`python -m oppo_lab <command> [options]`: the lab's commands, each a function `(argv) -> int` of a module."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {  # name -> (module, function, help)
    "train": ("oppo_lab.train", "main", "openrlhf-oppo train with the ablation schedules offered too"),
    "schedules": ("oppo_lab.train", "bench_main",
                  "openrlhf-oppo bench schedules with the ablation schedules offered too"),
    "simulate": ("oppo_lab.train", "simulate_main",
                 "openrlhf-oppo simulate with the ablation schedules (and the paper's ablation table)"),
    "convergence": ("oppo_lab.convergence.cli", "main",
                    "reward per step and per second over seeds: sync vs OPPO, time-to-reward, length bias"),
    "control-plane": ("oppo_lab.control_plane", "main",
                      "driver CPU, Ray messages and token lag at GPU rates (synthetic engines, real generator)"),
    "soak": ("oppo_lab.soak", "main", "a long run: RSS of every process and reward-actor KV tokens over steps"),
    "core": ("oppo_lab.core_bench", "main", "scheduler CPU cost per step (1,024 groups x 4, long tail)"),
    "engine": ("oppo_lab.engine_bench", "main",
               "vLLM decode iteration cost on this host by sequences decoded together"),
    "advantages": ("oppo_lab.advantages_bench", "main",
                   "GAE / REINFORCE returns: OpenRLHF's per-position loop vs whole-tensor, per micro-batch"),
    "calibrate": ("oppo_lab.sim.calibrate", "main", "fit the simulator's CPU preset to measured runs"),
    "validate": ("oppo_lab.sim.validate", "main", "the simulator against measured runs (in-sample and leave-one-out)"),
    "published": ("oppo_lab.sim.published", "main", "the simulator against published GPU runs"),
    "build-learn": ("oppo_lab.learn.cli", "main",
                    "build a learn task variant from scratch (SFT, reward model), or ship it"),
}


def _usage() -> str:
    lines = ["usage: python -m oppo_lab <command> [options]", "", "commands:"]
    lines += [f"  {name:<14} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"python -m oppo_lab: unknown command '{name}'; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module_name, function, _ = COMMANDS[name]
    entry = getattr(importlib.import_module(module_name), function)
    try:
        return int(entry(rest) or 0)
    except ValueError as exc:
        print(f"python -m oppo_lab {name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
