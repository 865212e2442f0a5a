"""The flags of OpenRLHF 0.11.2's `openrlhf.cli.train_ppo_ray`, read statically.

Its argparse parser is built inside `if __name__ == "__main__":`, so it cannot be
imported; we read the `parser.add_argument(...)` calls from the module's source
with `ast` (no import, no torch/ray/vllm), expanding the
`for prefix in ("actor", "critic"): parser.add_argument(f"--{prefix}.optim", ...)`
loop. This gives the YAML translator a table to validate keys against, in the
same place where an upstream rename would show up. The literal defaults, types,
`nargs` and `choices` are read too, so `resolve` gives the values OpenRLHF's parser would
(the launcher's input checks read them before anything starts).
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRAIN_MODULE = "openrlhf.cli.train_ppo_ray"


@dataclass(frozen=True)
class Flag:
    name: str  # dotted, without the leading "--": "train.async_enable"
    kind: str  # "bool" (store_true), "negated" (store_false), "list" (nargs), "value"
    default: Any = None  # the literal default (None where it is not a literal)
    type: str | None = None  # "int", "float", "str" (type=...)
    nargs: Any = None
    choices: tuple | None = None


def train_module_source() -> str:
    spec = importlib.util.find_spec(TRAIN_MODULE)
    if spec is None or spec.origin is None:
        raise ValueError(f"OpenRLHF is not installed ({TRAIN_MODULE} not found); run scripts/install.sh")
    return Path(spec.origin).read_text()


def _string_values(node: ast.AST, loop_vars: dict[str, tuple[str, ...]]) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        results = [""]
        for part in node.values:
            if isinstance(part, ast.Constant):
                results = [r + str(part.value) for r in results]
            elif isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name):
                values = loop_vars.get(part.value.id, ())
                results = [r + v for r in results for v in values]
            else:
                return []
        return results
    return []


def _literal(node: ast.AST | None) -> Any:
    """A literal (or `int(1e8)`-like) default; None where it is computed."""
    if node is None:
        return None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("int", "float"):
        cast = int if node.func.id == "int" else float
        value = _literal(node.args[0]) if node.args else None
        return None if value is None else cast(value)
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return None


def _kind(call: ast.Call) -> str:
    keywords = {k.arg: k.value for k in call.keywords}
    action = keywords.get("action")
    if isinstance(action, ast.Constant) and action.value == "store_true":
        return "bool"
    if isinstance(action, ast.Constant) and action.value == "store_false":
        return "negated"
    if "nargs" in keywords:
        return "list"
    return "value"


def parse_flags(source: str) -> dict[str, Flag]:
    flags: dict[str, Flag] = {}

    def visit(node: ast.AST, loop_vars: dict[str, tuple[str, ...]]) -> None:
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Tuple):
            values = tuple(e.value for e in node.iter.elts if isinstance(e, ast.Constant))
            loop_vars = {**loop_vars, node.target.id: values}
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
            and node.args
        ):
            for text in _string_values(node.args[0], loop_vars):
                if text.startswith("--"):
                    name = text[2:]
                    kw = {k.arg: k.value for k in node.keywords}
                    tp = kw.get("type")
                    choices = _literal(kw.get("choices"))
                    flags[name] = Flag(name, _kind(node), _literal(kw.get("default")),
                                       tp.id if isinstance(tp, ast.Name) else None, _literal(kw.get("nargs")),
                                       tuple(choices) if isinstance(choices, (list, tuple)) else None)
        for child in ast.iter_child_nodes(node):
            visit(child, loop_vars)

    visit(ast.parse(source), {})
    return flags


@functools.lru_cache(maxsize=1)
def train_flags() -> dict[str, Flag]:
    """Every flag of `openrlhf.cli.train_ppo_ray`, keyed by dotted name."""
    return parse_flags(train_module_source())


def namespaces(flags: dict[str, Flag]) -> list[str]:
    """Top-level groups of the dotted flags: actor, critic, ds, train, vllm, ..."""
    return sorted({name.split(".", 1)[0] for name in flags if "." in name})


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)


@functools.lru_cache(maxsize=1)
def _parser() -> argparse.ArgumentParser:
    parser = _Parser(add_help=False)
    types = {"int": int, "float": float}
    for f in train_flags().values():
        if f.kind in ("bool", "negated"):
            default = (f.kind == "negated") if f.default is None else f.default
            parser.add_argument(f"--{f.name}", dest=f.name, default=default,
                                action="store_true" if f.kind == "bool" else "store_false")
        else:
            parser.add_argument(f"--{f.name}", dest=f.name, default=f.default, type=types.get(f.type, str),
                                nargs=f.nargs if f.kind == "list" else None, choices=f.choices)
    return parser


def resolve(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """What OpenRLHF's parser makes of `argv`: ({dotted flag: value}, what it does not know).
    ValueError naming the flag for a bad value."""
    namespace, unknown = _parser().parse_known_args(argv)
    return vars(namespace), unknown
