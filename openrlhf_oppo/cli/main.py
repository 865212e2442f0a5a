"""`openrlhf-oppo` console script: one entry point, subcommands in their own modules.

    openrlhf-oppo train --schedule oppo|oppo-async-bg|... --config configs/tiny-cpu.yaml   # --help lists them
    openrlhf-oppo bench scorer|schedules
    openrlhf-oppo plot timeline|compare|lengths RUN_DIR...
    openrlhf-oppo prepare      # build the tiny task's model/tokenizer assets
    openrlhf-oppo config       # resolve and print the OPPO settings
    openrlhf-oppo ledger check RUN_DIR   # every prompt group trained exactly once or held
    openrlhf-oppo simulate --preset paper-7b-h200 [--set k=v] [--sweep k=v1,v2]   # cluster-scale simulator

Each subcommand lives in `openrlhf_oppo.cli.<name>` and exposes `main(argv) -> int`;
heavy imports happen inside it, so `openrlhf-oppo simulate` needs no torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping

SUBCOMMANDS = {
    "train": ("openrlhf_oppo.cli.train", "run OpenRLHF PPO (baselines) or OPPO on a YAML config"),
    "bench": ("openrlhf_oppo.cli.bench", "`schedules` (OpenRLHF's modes vs OPPO's), `scorer` (streamed prefill cost)"),
    "plot": ("openrlhf_oppo.bench.plot", "pictures of a run: `timeline` (Gantt), `compare` (two runs), `lengths`"),
    "config": ("openrlhf_oppo.cli.config", "resolve, validate and print the OPPO settings (YAML + --oppo.* flags)"),
    "prepare": ("openrlhf_oppo.cli.prepare", "build the tiny task's tokenizer, models and prompts locally"),
    "ledger": ("openrlhf_oppo.cli.ledger", "`check RUN_DIR`: every prompt group trained exactly once or still held"),
    "simulate": ("openrlhf_oppo.sim.cli",
                 "cluster-scale what-if driving the real scheduler (`--best-layout`: each schedule's best layout)"),
}


def _usage(prog: str, commands: Mapping[str, tuple[str, str]]) -> str:
    width = max(len(name) for name in commands) + 1
    lines = [f"usage: {prog} <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}} {help_}" for name, (_, help_) in commands.items()]
    return "\n".join(lines)


def dispatch(prog: str, commands: Mapping[str, tuple[str, str]], argv: list[str]) -> int:
    """Run the command `argv[0]` of `commands` (name -> ("module" or "module:function", help);
    the function defaults to `main`) with the rest of `argv`. A ValueError (a config or flag
    check naming the field) is one line and exit 2, not a traceback."""
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(prog, commands))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"{prog}: unknown command '{name}'; choose one of: {', '.join(commands)}", file=sys.stderr)
        return 2
    module_name, _, function = commands[name][0].partition(":")
    entry = getattr(importlib.import_module(module_name), function or "main")
    try:
        return int(entry(rest) or 0)
    except ValueError as exc:
        print(f"{prog} {name}: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return dispatch("openrlhf-oppo", SUBCOMMANDS, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
