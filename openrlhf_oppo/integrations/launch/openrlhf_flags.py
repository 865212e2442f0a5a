"""The flags of OpenRLHF 0.11.2's `openrlhf.cli.train_ppo_ray`, read statically.

Its argparse parser is built inside `if __name__ == "__main__":`, so it cannot be
imported; we read the `parser.add_argument(...)` calls from the module's source
with `ast` (no import, no torch/ray/vllm), expanding the
`for prefix in ("actor", "critic"): parser.add_argument(f"--{prefix}.optim", ...)`
loop. This gives the YAML translator a table to validate keys against, in the
same place where an upstream rename would show up. The literal defaults, types,
`nargs` and `choices` are read too, so `resolve` gives the values OpenRLHF's parser would
(the launcher's input checks read them before anything starts), and so are the help texts:
`format_help` is `--help-openrlhf` (OpenRLHF's own `--help` needs its GPU imports, flash_attn
among them, which a CPU install lacks).
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.metadata
import importlib.util
import itertools
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRAIN_MODULE = "openrlhf.cli.train_ppo_ray"
HELP_FLAG = "--help-openrlhf"  # `openrlhf-oppo train` and `python -m openrlhf_oppo.cli.train_ppo_ray`: print them


@dataclass(frozen=True)
class Flag:
    name: str  # dotted, without the leading "--": "train.async_enable"
    kind: str  # "bool" (store_true), "negated" (store_false), "list" (nargs), "value"
    default: Any = None  # the literal default (None where it is not a literal)
    type: str | None = None  # "int", "float", "str" (type=...)
    nargs: Any = None
    choices: tuple | None = None
    help: str | None = None  # the help text as written upstream (None where it has none)
    # the default as OpenRLHF's help would show it: the literal, argparse's False/True for a
    # store_true/store_false without one, or the expression computed when its parser is built
    default_text: str = "None"


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


def _bindings(loop_vars: dict[str, tuple[str, ...]]) -> list[dict[str, tuple[str, ...]]]:
    """Every assignment of the enclosing loops' variables, one value each ([{}] outside a loop)."""
    names = list(loop_vars)
    return [{n: (v,) for n, v in zip(names, values, strict=True)}
            for values in itertools.product(*(loop_vars[n] for n in names))]


def _branch(node: ast.AST | None, binding: dict[str, tuple[str, ...]]) -> ast.AST | None:
    """`a if prefix == "actor" else b` inside the loop over `prefix`: the branch this binding takes."""
    while (
        isinstance(node, ast.IfExp)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id in binding
        and len(node.test.ops) == 1
        and isinstance(node.test.ops[0], ast.Eq)
        and isinstance(node.test.comparators[0], ast.Constant)
    ):
        taken = binding[node.test.left.id][0] == node.test.comparators[0].value
        node = node.body if taken else node.orelse
    return node


def _default_text(call: ast.Call, binding: dict[str, tuple[str, ...]]) -> str:
    keywords = {k.arg: k.value for k in call.keywords}
    if "default" not in keywords:
        return {"bool": "False", "negated": "True"}.get(_kind(call), "None")
    node = _branch(keywords["default"], binding)
    value = _literal(node)
    if value is None and not (isinstance(node, ast.Constant) and node.value is None):
        return f"computed: {ast.unparse(node)}"
    return repr(value) if isinstance(value, str) else str(value)


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
            kw = {k.arg: k.value for k in node.keywords}
            tp = kw.get("type")
            choices = _literal(kw.get("choices"))
            for binding in _bindings(loop_vars):  # one flag per loop value: its help and default may name it
                helps = _string_values(kw["help"], binding) if "help" in kw else []
                for text in _string_values(node.args[0], binding):
                    if text.startswith("--"):
                        name = text[2:]
                        flags[name] = Flag(name, _kind(node), _literal(kw.get("default")),
                                           tp.id if isinstance(tp, ast.Name) else None, _literal(kw.get("nargs")),
                                           tuple(choices) if isinstance(choices, (list, tuple)) else None,
                                           helps[0] if helps else None, _default_text(node, binding))
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


def asks_help(argv: list[str]) -> bool:
    """`--help-openrlhf` among `argv`'s own flags (not among those after `--`, handed to OpenRLHF)."""
    own = argv[: argv.index("--")] if "--" in argv else argv
    return HELP_FLAG in own


def _metavar(flag: Flag) -> str:
    if flag.kind in ("bool", "negated"):
        return ""
    one = "{" + ",".join(str(c) for c in flag.choices) + "}" if flag.choices else (flag.type or "str").upper()
    if flag.kind != "list":
        return f" {one}"
    if isinstance(flag.nargs, int):
        return " " + " ".join([one] * flag.nargs)
    return f" {one} [{one} ...]" if flag.nargs == "+" else f" [{one} ...]"


def format_help(width: int = 100) -> str:
    """`--help-openrlhf`: every flag of OpenRLHF's `train_ppo_ray` with its default and help text,
    grouped by dotted section (actor., critic., ..., vllm.), undotted flags last."""
    flags = train_flags()
    try:
        version = importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    lines = [
        f"OpenRLHF {version}'s flags ({TRAIN_MODULE}), read from its source, by section.",
        "Give them to `python -m openrlhf_oppo.cli.train_ppo_ray` as to OpenRLHF's entry point, or to",
        "`openrlhf-oppo train` after `--` (or as nested keys of its --config YAML). OPPO's own flags: --help.",
    ]
    sections = [f"{ns}." for ns in namespaces(flags)] + [""]
    for section in sections:
        chosen = [f for name, f in flags.items() if (name.startswith(section) if section else "." not in name)]
        if not chosen:
            continue
        lines += ["", section or "other"]
        for f in chosen:
            lines.append(f"  --{f.name}{_metavar(f)}  (default: {f.default_text})")
            if f.help:
                lines += textwrap.wrap(" ".join(f.help.split()), width, initial_indent=" " * 6,
                                       subsequent_indent=" " * 6, break_on_hyphens=False)
    return "\n".join(lines)


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
