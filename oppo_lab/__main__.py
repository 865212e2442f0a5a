"""`python -m oppo_lab <command> [options]`: the lab's commands, dispatched as `openrlhf-oppo`'s are."""

from __future__ import annotations

import sys

from openrlhf_oppo.cli.main import dispatch

COMMANDS = {  # name -> ("module" or "module:function", help)
    "train": ("oppo_lab.train", "openrlhf-oppo train with the ablation schedules offered too"),
    "schedules": ("oppo_lab.train:bench_main",
                  "openrlhf-oppo bench schedules with the ablation schedules offered too"),
    "simulate": ("oppo_lab.train:simulate_main",
                 "openrlhf-oppo simulate with the ablation schedules (and the paper's ablation table)"),
    "convergence": ("oppo_lab.convergence.cli",
                    "reward per step and per second over seeds: sync vs OPPO, time-to-reward, length bias"),
    "control-plane": ("oppo_lab.control_plane",
                      "driver CPU, Ray messages and token lag at GPU rates (synthetic engines, real generator)"),
    "soak": ("oppo_lab.soak", "a long run: RSS of every process and reward-actor KV tokens over steps"),
    "core": ("oppo_lab.core_bench", "scheduler CPU cost per step (1,024 groups x 4, long tail)"),
    "engine": ("oppo_lab.engine_bench",
               "vLLM decode iteration cost on this host by sequences decoded together"),
    "advantages": ("oppo_lab.advantages_bench",
                   "GAE / REINFORCE returns: OpenRLHF's per-position loop vs whole-tensor, per micro-batch"),
    "calibrate": ("oppo_lab.sim.calibrate", "fit the simulator's CPU preset to measured runs"),
    "validate": ("oppo_lab.sim.validate", "the simulator against measured runs (in-sample and leave-one-out)"),
    "published": ("oppo_lab.sim.published", "the simulator against published GPU runs"),
    "build-learn": ("oppo_lab.learn.cli",
                    "build a learn task variant from scratch (SFT, reward model), or ship it"),
}


def main(argv: list[str] | None = None) -> int:
    return dispatch("python -m oppo_lab", COMMANDS, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
