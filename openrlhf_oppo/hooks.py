"""How OPPO's patches reach every process of a run: a `Patch` runs when its target
module is imported (after it executes, or before with `before_exec`), or at once if
it already is; `SITE_DIR` holds the `sitecustomize` that installs a run's patch lists
at process start (`integrations.runtime.startup` decides which).

Pure standard library: the sitecustomize imports it in every Python process of a run.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

# The directory the launcher (and `compat.launch_env`) puts first on PYTHONPATH: Ray
# workers, Ray actors and vLLM's engine subprocesses all inherit it. A path, not an
# import: its sitecustomize runs the composition root of integrations.runtime.
SITE_DIR = Path(__file__).resolve().parent / "integrations" / "runtime" / "_site"


def site_pythonpath(pythonpath: str) -> str:
    """`pythonpath` with SITE_DIR first (once): what a run's processes get as PYTHONPATH."""
    entries = [str(SITE_DIR)] + [p for p in pythonpath.split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(entries))


@dataclass(frozen=True)
class Patch:
    name: str  # once per process: a second install of the same name is skipped
    module: str  # the module whose import triggers the patch
    fn: Callable  # fn(module) -> None
    upstream: str  # what it was written against: "openrlhf 0.11.2", ...
    before_exec: bool = False  # run just before the module executes (e.g. to stand in for its imports)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, before, after):
        self._inner = inner
        self._before = before
        self._after = after

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def __getattr__(self, name):
        # get_source, get_filename, is_package, ...: inspect and tracebacks ask the loader
        return getattr(self._inner, name)

    def exec_module(self, module):
        for patch in self._before:
            patch.fn(module)
        self._inner.exec_module(module)
        for patch in self._after:
            patch.fn(module)


class _PatchFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.pending: dict[str, list[Patch]] = {}

    def find_spec(self, fullname, path=None, target=None):
        patches = self.pending.pop(fullname, None)
        if not patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        before = [p for p in patches if p.before_exec]
        after = [p for p in patches if not p.before_exec]
        spec.loader = _PatchingLoader(spec.loader, before, after)
        return spec


_FINDER = _PatchFinder()
_INSTALLED: set[str] = set()


def install_hooks(patches: Iterable[Patch]) -> None:
    """Register patches; each runs once per process."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    for patch in patches:
        if patch.name in _INSTALLED:
            continue
        _INSTALLED.add(patch.name)
        module = sys.modules.get(patch.module)
        if module is not None:
            patch.fn(module)
        else:
            _FINDER.pending.setdefault(patch.module, []).append(patch)
