"""`openrlhf-oppo prepare [--variant NAME] [--assets DIR] [--force]`: build a built-in task's
tokenizer, models (actor/reference, reward, critic init) and prompt set locally (no hub)."""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    from openrlhf_oppo import tasks

    p = argparse.ArgumentParser(prog="openrlhf-oppo prepare", description=__doc__.splitlines()[0])
    p.add_argument(
        "--variant",
        default="tiny",
        choices=list(tasks.VARIANTS),
        help="task variant: tiny; longtail (heavy-tailed response lengths); learn (a learnable task: "
        "SFT'd policy and Bradley-Terry reward model trained by OpenRLHF's trainers, ~7 min on 2 CPU cores); "
        "learn-longtail (the learnable task with answers that loop to a 512-token cap; its build ships in the "
        "package, --force rebuilds it, ~20 min)",
    )
    p.add_argument("--assets", default=None, help="output dir (default ~/.cache/openrlhf_oppo/<variant>)")
    p.add_argument("--force", action="store_true", help="rebuild even if already built (or shipped)")
    args = p.parse_args(argv)

    assets = tasks.build(args.variant, args.assets, force=args.force)
    print(f"openrlhf-oppo prepare: {args.variant} task assets in {assets.root}")
    return 0
