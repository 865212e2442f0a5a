"""`openrlhf-oppo bench <target> [options]`: benchmarks that print figures and ratios
(`openrlhf-oppo bench <target> --help` lists a target's options)."""

from __future__ import annotations

import importlib
import sys

TARGETS = {
    "scorer": ("openrlhf_oppo.bench.scorer", "streamed vs one-shot scoring time per chunk size"),
    "schedules": ("openrlhf_oppo.bench.schedules",
                  "OpenRLHF's modes vs OPPO's on one config, interleaved: mean time a step, trained tokens/s, "
                  "ratios against each mode"),
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
        print("\nopenrlhf-oppo bench <target> --help lists a target's options.")
        return 0
    module = importlib.import_module(TARGETS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)
