"""`openrlhf-oppo bench <target>`: micro-benchmarks that print figures and ratios."""

from __future__ import annotations

import importlib
import sys

TARGETS = {
    "core": ("openrlhf_oppo.bench.core", "scheduler CPU cost per step (1,024 groups x 4, long tail)"),
    "advantages": ("openrlhf_oppo.bench.advantages",
                   "GAE / REINFORCE returns: OpenRLHF's per-position loop vs whole-tensor, per micro-batch"),
    "engine": ("openrlhf_oppo.bench.engine", "vLLM decode iteration cost on this host by sequences decoded together"),
    "scorer": ("openrlhf_oppo.bench.scorer", "streamed vs one-shot scoring time per chunk size"),
    "schedules": ("openrlhf_oppo.bench.schedules", "OpenRLHF's modes vs OPPO's: step latency ratios, same config"),
    "convergence": ("openrlhf_oppo.bench.convergence",
                    "reward per step and per second over seeds: sync vs OPPO, time-to-reward, length bias"),
    "soak": ("openrlhf_oppo.bench.soak", "a long run: RSS of every process and reward-actor KV tokens over steps"),
    "control-plane": ("openrlhf_oppo.bench.control_plane",
                      "driver CPU, Ray messages and token lag at GPU rates (synthetic engines, real generator)"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in TARGETS:
        if argv and argv[0] not in ("-h", "--help"):
            print(
                f"openrlhf-oppo bench: unknown target '{argv[0]}'; choose one of: {', '.join(TARGETS)}", file=sys.stderr
            )
            return 2
        print("usage: openrlhf-oppo bench <target> [options]\n\ntargets:")
        for name, (_, help_) in TARGETS.items():
            print(f"  {name:<14} {help_}")
        return 0
    module = importlib.import_module(TARGETS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)
