"""Frozen-dataclass settings: one codec for help, values, dicts, YAML, flags and docs.

A schema is a tree of frozen dataclasses whose fields carry ``metadata["help"]`` (and,
for a closed set of strings, ``metadata["choices"]``). A :class:`Codec` builds such a
tree from a nested mapping (unknown keys and values of the wrong type raise
``ValueError`` naming the key), turns it back into plain dicts, and generates argparse
flags, argv and a markdown flag table from the fields. Two families of settings use it,
each with its own words in messages and its own rule for text values:

- OPPO's settings (:mod:`openrlhf_oppo.config`): ``--oppo.delta.init 8``; values may be
  command-line text (``"true"``, ``"8"``, ``"64,128"``), converted only when lossless.
- The simulator's presets (:mod:`openrlhf_oppo.sim.presets`): ``--set workload.steps=20``;
  values come typed from YAML.

Stdlib only; PyYAML is imported where YAML is read.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Codec.text: how a leaf reads a value that is not already of the field's type.
ARGV = "argv"  # command-line text: "true"/"false", "8", "64,128" parse; anything else of the wrong type is refused
YAML = "yaml"  # typed YAML values: an integral float is an int, any scalar is a str, PyYAML's "1.0e12" a float
TEXT_RULES = (ARGV, YAML)
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


def suggest(name: str, choices: typing.Iterable[str]) -> str:
    """" (did you mean 'x'?)" for the closest of `choices` to a misspelt `name` (difflib), else ""."""
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""


def setting(default: Any, help: str, **metadata: Any) -> Any:
    """A dataclass field with its help text (and e.g. ``choices=(...)``) in its metadata."""
    return field(default=default, metadata={"help": help, **metadata})


def leaves(cls: type, path: str = "") -> list[tuple[str, Any, dataclasses.Field]]:
    """``(dotted name, type, field)`` of every non-dataclass field under ``cls``, depth first."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        name = f"{path}.{f.name}" if path else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            out += leaves(hints[f.name], name)
        else:
            out.append((name, hints[f.name], f))
    return out


def get_path(obj: Any, dotted: str) -> Any:
    """``get_path(cfg, "delta.init")`` is ``cfg.delta.init``."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def to_dict(obj: Any) -> dict[str, Any]:
    """Nested plain-dict form (tuples become lists), for YAML, JSON and checkpoints."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        elif isinstance(value, tuple):
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out


def shown(value: Any) -> str:
    """A value as a user would type it: ``true``, ``128 256 512``."""
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def read_yaml(path: str) -> dict[str, Any]:
    """A YAML file's top-level mapping (an empty file gives ``{}``)."""
    import yaml

    try:
        with open(path) as fh:
            doc = yaml.safe_load(fh) or {}
    except FileNotFoundError:
        raise ValueError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:  # where and what the parser expected, not its traceback
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        raise ValueError(f"{path}:{where} not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    if not isinstance(doc, Mapping):
        raise ValueError(f"{path}: top level must be a mapping")
    return dict(doc)


def yaml_value(text: Any) -> Any:
    """A ``key=value`` edit's value read as a YAML scalar (``8`` -> 8, ``[1, 2]`` -> [1, 2]);
    text YAML cannot read stays text."""
    if not isinstance(text, str):
        return text
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


@dataclass(frozen=True)
class Codec:
    """The words and the value rule of one family of settings.

    Message templates (``str.format``): ``leaf`` names a leaf key in a bad-value message
    (``{key}``: its dotted path); ``section`` names a section that is not a mapping
    (``{path}``, ``{dotted}`` = ``"." + path`` or ``""``); ``unknown`` is the whole
    unknown-key message (``{where}`` = ``path + "."`` or ``""``, ``{key}``, ``{names}``: the
    allowed names sorted, ``{qualified}``: the allowed names after ``where``, in field
    order). ``text`` is :data:`ARGV` or :data:`YAML`; ``prefix`` heads the generated flags.
    """

    leaf: str
    section: str
    unknown: str
    text: str = ARGV
    prefix: str = ""

    def __post_init__(self) -> None:
        if self.text not in TEXT_RULES:
            raise ValueError(f"Codec.text must be one of {TEXT_RULES}, got {self.text!r}")

    # ------------------------------------------------------------------------- values

    def error(self, key: str, allowed: str, value: Any) -> ValueError:
        return ValueError(f"{self.leaf.format(key=key)} must be {allowed}, got {value!r}")

    def require(self, ok: bool, key: str, allowed: str, value: Any) -> None:
        """Raise the family's bad-value message unless ``ok``."""
        if not ok:
            raise self.error(key, allowed, value)

    def build(self, cls: type, data: Any, path: str = "", skip: tuple[str, ...] = ()) -> Any:
        """``cls`` built from a nested mapping; ``skip`` names fields the caller builds itself."""
        if not isinstance(data, Mapping):
            where = self.section.format(path=path, dotted="." + path if path else "")
            raise ValueError(f"{where} must be a mapping, got {data!r}")
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
        unknown = sorted(set(data) - set(names))
        if unknown:
            where = f"{path}." if path else ""
            raise ValueError(self.unknown.format(where=where, key=unknown[0], names=", ".join(sorted(names)),
                                                 qualified=", ".join(where + n for n in names))
                             + suggest(unknown[0], names))
        kwargs = {key: self.coerce(value, hints[key], f"{path}.{key}" if path else key) for key, value in data.items()}
        return cls(**kwargs)

    def coerce(self, value: Any, tp: Any, key: str) -> Any:
        """``value`` checked against the field type ``tp`` (converted by the codec's text rule)."""
        origin = typing.get_origin(tp)
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if origin in (typing.Union, types.UnionType) and len(args) == 1:  # X | None
            return None if value is None else self.coerce(value, args[0], key)
        if dataclasses.is_dataclass(tp):
            return self.build(tp, value, key)
        if origin is tuple:
            return self._tuple(value, tp, key)
        readers = {bool: self._bool, int: self._int, float: self._float, str: self._str}
        if tp not in readers:
            raise TypeError(f"unsupported field type {tp!r} for {key}")
        return readers[tp](value, key)

    def _tuple(self, value: Any, tp: Any, key: str) -> tuple:
        if isinstance(value, str) and self.text == ARGV:
            value = [v for v in value.replace(",", " ").split() if v]
        if not isinstance(value, (list, tuple)):
            raise self.error(key, "a list", value)
        item_types = typing.get_args(tp)
        if len(item_types) == 2 and item_types[1] is Ellipsis:
            return tuple(self.coerce(v, item_types[0], key) for v in value)
        if len(value) != len(item_types):
            raise self.error(key, f"a list of {len(item_types)} items", value)
        return tuple(self.coerce(v, t, key) for v, t in zip(value, item_types, strict=True))

    def _bool(self, value: Any, key: str) -> bool:
        if isinstance(value, bool):
            return value
        if self.text == ARGV and isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise self.error(key, "true or false", value)

    def _int(self, value: Any, key: str) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if self.text == ARGV and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        if self.text == YAML and isinstance(value, float) and value.is_integer():
            return int(value)
        raise self.error(key, "an integer", value)

    def _float(self, value: Any, key: str) -> float:
        if isinstance(value, str):  # PyYAML reads 989.0e12 (no sign in the exponent) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, "a number", value)
        return float(value)

    def _str(self, value: Any, key: str) -> str:
        if isinstance(value, str):
            return value
        if self.text == YAML:  # `name: 7` in YAML means the text the user wrote
            return str(value)
        raise self.error(key, "a string", value)

    # -------------------------------------------------------------------------- flags

    def flag(self, name: str) -> str:
        return f"{self.prefix}.{name}"

    def add_flags(self, parser: argparse.ArgumentParser, cls: type, title: str, description: str) -> None:
        """One ``--<prefix>.<section>.<field>`` flag per leaf of ``cls`` (default: unset)."""
        group = parser.add_argument_group(title, description)
        defaults = cls()
        for name, tp, f in leaves(cls):
            kw: dict[str, Any] = dict(dest=self.flag(name), default=None,
                                      help=f"{f.metadata['help']} [default: {shown(get_path(defaults, name))}]")
            if typing.get_origin(tp) is tuple:
                kw["nargs"] = "+"
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            group.add_argument(f"--{self.flag(name)}", **kw)

    def overlay(self, values: Mapping[str, Any], base: Any) -> Any:
        """``base`` with the ``<prefix>.*`` entries of ``values`` that are not None set on it."""
        data = to_dict(base)
        for key, value in values.items():
            if not key.startswith(self.prefix + ".") or value is None:
                continue
            *sections, leaf = key.split(".")[1:]
            node = data
            for s in sections:
                node = node[s]
            node[leaf] = value
        return self.build(type(base), data)

    def to_argv(self, obj: Any) -> list[str]:
        """Every leaf as ``--<prefix>.<name> value`` flags (the inverse of :meth:`overlay`)."""
        argv: list[str] = []
        for name, _, _ in leaves(type(obj)):
            value = get_path(obj, name)
            argv.append(f"--{self.flag(name)}")
            if isinstance(value, tuple):
                argv += [str(v) for v in value]
            else:
                argv.append(shown(value))
        return argv

    def flag_tables(self, cls: type) -> list[str]:
        """Markdown: per section of ``cls``, its help, docstring and a table of its flags."""
        hints = typing.get_type_hints(cls)
        defaults = cls()
        lines: list[str] = []
        for section in dataclasses.fields(cls):
            lines += ["", f"## `{section.name}`: {section.metadata['help']}", "",
                      inspect.getdoc(hints[section.name]) or "", "",
                      "| flag | type | default | meaning |", "|---|---|---|---|"]
            for name, tp, f in leaves(hints[section.name], section.name):
                if "choices" in f.metadata:
                    kind = " \\| ".join(f"`{c}`" for c in f.metadata["choices"])
                elif typing.get_origin(tp) is tuple:
                    kind = f"list of {typing.get_args(tp)[0].__name__}"
                else:
                    kind = tp.__name__
                text = f.metadata["help"].replace("|", "\\|")
                lines.append(f"| `--{self.flag(name)}` | {kind} | `{shown(get_path(defaults, name))}` | {text} |")
        return lines


def field_help(cls: type) -> dict[str, str]:
    """``{"delta.init": "...", ...}``: the help text of every leaf field."""
    return {name: f.metadata["help"] for name, _, f in leaves(cls)}
