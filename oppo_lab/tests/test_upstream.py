"""Every OpenRLHF symbol the lab touches exists in the installed OpenRLHF, and the lab's table lists
every one its code imports (the product's own table: tests/test_upstream.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from openrlhf_oppo import compat
from openrlhf_oppo import upstream as product
from oppo_lab import upstream as touch_points

compat.apply()  # the flash-attn stand-in, where CUDA is absent
LAB = Path(touch_points.__file__).resolve().parent


def test_the_installed_openrlhf_has_every_symbol_the_lab_touches():
    assert product.missing(touch_points.TOUCH_POINTS, "oppo_lab") == []


def test_every_openrlhf_name_the_lab_imports_is_listed_here_or_in_the_products_table():
    rows = touch_points.TOUCH_POINTS + product.TOUCH_POINTS
    imported = set()
    for path in LAB.rglob("*.py"):
        if "tests" in path.relative_to(LAB).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("openrlhf."):
                imported |= {f"{node.module}.{alias.name}" for alias in node.names}
    unlisted = [s for s in sorted(imported) if not any(t.symbol == s or t.symbol.startswith(s + ".") for t in rows)]
    assert unlisted == []


@pytest.mark.parametrize("touch", touch_points.TOUCH_POINTS, ids=lambda t: t.symbol)
def test_each_row_names_a_lab_module_that_mentions_it(touch):
    source = (LAB / (touch.where.replace(".", "/") + ".py")).read_text()
    assert touch.symbol.rsplit(".", 1)[-1] in source, f"oppo_lab.{touch.where} does not mention {touch.symbol}"
