"""Built-in tasks, all built in code (no model hub):

- `openrlhf_oppo.tasks.tiny`: a tokenizer, tiny Qwen2-style models and a prompt set
  (variants `tiny`, `longtail`); the models are shaped, not trained.
- `openrlhf_oppo.tasks.learn`: a learnable task (reverse a word list) with an SFT'd
  policy, a ground-truth checker and a Bradley-Terry reward model trained by OpenRLHF's
  own trainers (variant `learn`), and the same with a long tail of answers that loop to the
  response cap (variant `learn-longtail`, whose build ships in the package).

`build(variant)` builds (or finds cached) any of them; the assets it returns name
`actor`, `reward`, `critic` and `prompts` paths.
"""

from __future__ import annotations

from pathlib import Path

from openrlhf_oppo.tasks import learn, tiny

VARIANTS: tuple[str, ...] = (*tiny.VARIANTS, *learn.VARIANTS)


def default_root(variant: str) -> Path:
    return learn.default_root(variant) if variant in learn.VARIANTS else tiny.default_root(variant)


def build(variant: str, root: Path | str | None = None, force: bool = False):
    """The variant's assets under `root` (default: `default_root(variant)`), built unless
    already built with the same spec. ValueError naming the allowed variants otherwise."""
    if variant not in VARIANTS:
        raise ValueError(f"task.variant: unknown variant '{variant}'; allowed: {', '.join(VARIANTS)}")
    root = root or default_root(variant)
    if variant in learn.VARIANTS:
        return learn.build(root, learn.VARIANTS[variant], force=force)
    return tiny.build(root, tiny.VARIANTS[variant], force=force)
