"""Every OpenRLHF symbol OPPO swaps, subclasses, wraps, patches or calls exists in the
installed OpenRLHF, and the table lists every one our code reaches."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from openrlhf_oppo import compat
from openrlhf_oppo import upstream as touch_points
from openrlhf_oppo.compat import patches
from openrlhf_oppo.integrations.runtime import seeding, timeline_hooks

compat.apply()  # the flash-attn stand-in, where CUDA is absent
PACKAGE = Path(touch_points.__file__).resolve().parent


def test_the_installed_openrlhf_has_every_symbol_oppo_touches():
    assert touch_points.missing() == []


def test_a_renamed_symbol_is_reported_by_name(monkeypatch):
    from openrlhf.trainer.ray import launcher

    monkeypatch.delattr(launcher, "BaseModelActor")
    problems = touch_points.missing()
    assert problems[0].startswith("openrlhf.trainer.ray.launcher.BaseModelActor "
                                  "(subclassed by openrlhf_oppo.integrations.runtime.scorer)")
    base = "openrlhf.trainer.ray.launcher.BaseModelActor"
    assert [p.split(" ")[0] for p in problems[1:]] == [f"{base}._setup_distributed", f"{base}.execute_batch"]


def _listed(symbol: str) -> bool:
    return any(t.symbol == symbol or t.symbol.startswith(symbol + ".") for t in touch_points.TOUCH_POINTS)


def test_every_openrlhf_module_a_patch_hooks_is_listed():
    every = patches.PATCHES + seeding.PATCHES + timeline_hooks.PATCHES
    modules = {p.module for p in every if p.module.startswith("openrlhf.")}
    assert modules and [m for m in sorted(modules) if not _listed(m)] == []


def test_every_openrlhf_name_our_code_imports_is_listed():
    imported = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("openrlhf."):
                imported |= {f"{node.module}.{alias.name}" for alias in node.names}
    assert imported and [s for s in sorted(imported) if not _listed(s)] == []


@pytest.mark.parametrize("touch", touch_points.TOUCH_POINTS, ids=lambda t: t.symbol)
def test_each_row_names_a_module_of_ours_that_mentions_it(touch):
    source = (PACKAGE / (touch.where.replace(".", "/") + ".py")).read_text()
    name = touch.symbol.rsplit(".", 1)[-1]
    assert name in source, f"openrlhf_oppo.{touch.where} does not mention {name}"
