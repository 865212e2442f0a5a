"""`python -m oppo_lab build-learn [--variant NAME] [--assets DIR] [--force] [--ship]`: build a learn
task variant from scratch (OpenRLHF's train_sft and train_rm on the CPU), unless already built with
its spec; `--ship` then copies the build into the package as the variant's shipped build."""

from __future__ import annotations

import argparse

from openrlhf_oppo.tasks import learn


def main(argv: list[str]) -> int:
    from oppo_lab.learn import builder, ship

    p = argparse.ArgumentParser(prog="python -m oppo_lab build-learn", description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="learn", choices=list(learn.VARIANTS),
                   help="learn (~7 min on 2 CPU cores) or learn-longtail (answers looping to a 512-token cap, ~20 min)")
    p.add_argument("--assets", default=None, help="output dir (default ~/.cache/openrlhf_oppo/<variant>)")
    p.add_argument("--force", action="store_true", help="build from scratch even if already built or shipped")
    p.add_argument("--ship", action="store_true", help="copy the finished build into the package's shipped builds")
    args = p.parse_args(argv)
    assets = builder.build(args.assets or learn.default_root(args.variant), learn.VARIANTS[args.variant],
                           force=args.force)
    print(f"python -m oppo_lab build-learn: {args.variant} assets in {assets.root}")
    if args.ship:
        print(f"python -m oppo_lab build-learn: shipped into {ship.ship(args.variant, assets.root)}")
    return 0
