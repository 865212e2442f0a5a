"""`openrlhf-oppo prepare [--variant NAME] [--assets DIR] [--force]`: put a built-in task's assets on disk.

tiny and longtail are built here: a tokenizer, the actor/reference, reward and critic-init models
(built from a config in code; nothing is downloaded) and the prompts. learn-longtail's build ships in
the package and is installed. learn has no shipped build: the lab builds it
(`python -m oppo_lab build-learn`, in a checkout of the repository). A run builds or installs its
task's assets on first use too; `prepare` does it ahead of the run.
"""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    from openrlhf_oppo import tasks

    p = argparse.ArgumentParser(prog="openrlhf-oppo prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--variant",
        default="tiny",
        choices=list(tasks.VARIANTS),
        help="task variant (default: tiny): tiny; longtail (heavy-tailed response lengths); learn (a learnable "
        "task: an SFT policy and a Bradley-Terry reward model trained by OpenRLHF's trainers; built by the lab "
        "only); learn-longtail (the learnable task with answers that loop to the response cap; installed from "
        "the package's shipped build)",
    )
    p.add_argument("--assets", default=None,
                   help="output dir (default: ~/.cache/openrlhf_oppo/<variant>; tiny's follows $OPPO_ASSETS_DIR, "
                        "the others sit beside it)")
    p.add_argument("--force", action="store_true",
                   help="build tiny or longtail again, or install learn-longtail's shipped build again, even where "
                        "--assets already holds a build of this variant")
    args = p.parse_args(argv)

    assets = tasks.build(args.variant, args.assets, force=args.force)
    print(f"openrlhf-oppo prepare: {args.variant} task assets in {assets.root}")
    return 0
