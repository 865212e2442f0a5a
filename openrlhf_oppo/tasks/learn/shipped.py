"""The learn variants' built assets, shipped in the package (`shipped/<variant>/`, about 3.5 MB
each): what a run needs of a build (tokenizer, SFT policy, reward model, RL prompts, the SFT
policy's baseline, the build's summary and BUILD_OK), so that every machine trains from the
same models. A build is not reproducible across machines: float reductions differ with the
CPU's kernels and 300+ optimizer steps amplify the difference.

`build` installs the shipped copy (`install`, seconds) when its BUILD_OK matches the
variant's spec. Building a spec from scratch, and shipping a fresh build here, is the lab's
work (`python -m oppo_lab build-learn`, in a checkout of the repository)."""

from __future__ import annotations

import shutil
from pathlib import Path

from openrlhf_oppo.tasks.learn.assets import (
    DEFAULT_ASSETS_DIR,
    VARIANTS,
    LearnAssets,
    LearnSpec,
    write_data,
)

SHIPPED_DIR = Path(__file__).parent / "shipped"
SHIPPED_VARIANTS = ("learn-longtail",)
"""Variants with a shipped build. `learn` is built by the lab (`python -m oppo_lab build-learn`)."""
SHIPPED = ("BUILD_OK", "summary.json", "data/sft_baseline.jsonl", "tokenizer", "actor", "reward")
"""What is shipped of a build; the model-free splits (`write_data`: SFT records, held-out
pairs, RL prompts) are written again on install, all but the reward model's training pairs."""

def copy_build(source: Path, target: Path, names: tuple[str, ...]) -> None:
    """Copy files and directories `names` from `source` to `target` (a directory's checkpoint
    leftovers stay behind)."""
    for name in names:
        src, dst = source / name, target / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.bin", "training_args*"))
        else:
            shutil.copyfile(src, dst)


def variant_of(spec: LearnSpec) -> str | None:
    return next((name for name, s in VARIANTS.items() if s == spec), None)


def shipped(spec: LearnSpec) -> LearnAssets | None:
    """The shipped build of `spec`'s variant, if there is one and it was built with `spec`."""
    name = variant_of(spec)
    found = LearnAssets(SHIPPED_DIR / name) if name else None
    return found if found is not None and found.is_built(spec) else None


def install(assets: LearnAssets, spec: LearnSpec, log=print) -> bool:
    """Copy the shipped build of `spec` into `assets.root` (the model-free splits written
    again from the spec); False if none is shipped for it."""
    source = shipped(spec)
    if source is None:
        return False
    log(f"learn: installing the shipped {variant_of(spec)} build into {assets.root} (its measurements: "
        f"summary.json there)")
    assets.root.mkdir(parents=True, exist_ok=True)
    (assets.root / "BUILD_OK").unlink(missing_ok=True)
    copy_build(source.root, assets.root, SHIPPED[1:])
    from transformers import AutoTokenizer

    write_data(assets, spec, AutoTokenizer.from_pretrained(assets.tokenizer).eos_token, rm_training_pairs=False)
    shutil.copyfile(source.root / "BUILD_OK", assets.root / "BUILD_OK")  # last: the install is whole
    return True


def build(root: Path | str | None = None, spec: LearnSpec = VARIANTS["learn"], force: bool = False,
          log=print) -> LearnAssets:
    """The assets of `spec` under `root` (default ~/.cache/openrlhf_oppo/learn): as they are when
    already built with this spec (unless `force`), else the package's shipped build of it.
    A spec with no shipped build is built from scratch by the lab (`python -m oppo_lab build-learn`):
    ValueError naming that command otherwise."""
    assets = LearnAssets(Path(root).expanduser() if root else DEFAULT_ASSETS_DIR)
    if assets.is_built(spec) and not force:
        return assets
    if install(assets, spec, log):
        return assets
    name = variant_of(spec) or "learn"
    raise ValueError(f"task.variant {name}: no build of it in {assets.root} and none shipped in the package; build it "
                     f"with `python -m oppo_lab build-learn --variant {name} --assets {assets.root}` (a checkout of "
                     f"the repository), or use a shipped variant: {', '.join(SHIPPED_VARIANTS)}")
