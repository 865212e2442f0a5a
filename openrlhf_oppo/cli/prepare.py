"""`openrlhf-oppo prepare [--variant NAME] [--assets DIR] [--force]`: build the tiny task's
tokenizer, models (actor/reference, reward, critic init) and prompt set locally (no hub)."""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    from openrlhf_oppo.tasks import tiny

    p = argparse.ArgumentParser(prog="openrlhf-oppo prepare", description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="tiny", choices=list(tiny.VARIANTS),
                   help="model variant (tiny.VARIANTS): tiny, or longtail for heavy-tailed response lengths")
    p.add_argument("--assets", default=None, help="output dir (default ~/.cache/openrlhf_oppo/<variant>)")
    p.add_argument("--force", action="store_true", help="rebuild even if already built")
    args = p.parse_args(argv)

    assets = tiny.build(args.assets or tiny.default_root(args.variant), tiny.VARIANTS[args.variant], force=args.force)
    print(f"openrlhf-oppo prepare: {args.variant} task assets in {assets.root}")
    return 0
