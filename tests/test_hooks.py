"""Import hooks run a patch once, before or after its module executes."""

from __future__ import annotations

import sys

from openrlhf_oppo.hooks import Patch, install_hooks


def test_patches_run_around_the_first_import_of_their_module(tmp_path, monkeypatch):
    pkg = tmp_path / "oppo_hooktarget"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("import sys\nSEEN_BEFORE = getattr(sys, '_oppo_hook_marker', None)\nVALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []

    def before(module):
        calls.append("before")
        sys._oppo_hook_marker = "set-before-exec"

    def after(module):
        calls.append("after")
        module.VALUE = 2

    install_hooks([
        Patch("t_before", "oppo_hooktarget.mod", before, "test", before_exec=True),
        Patch("t_after", "oppo_hooktarget.mod", after, "test"),
    ])
    try:
        import oppo_hooktarget.mod as mod

        assert calls == ["before", "after"]
        assert mod.SEEN_BEFORE == "set-before-exec"
        assert mod.VALUE == 2
        install_hooks([Patch("t_after", "oppo_hooktarget.mod", after, "test")])  # same name: not again
        assert calls == ["before", "after"]
    finally:
        del sys._oppo_hook_marker
        sys.modules.pop("oppo_hooktarget.mod", None)
        sys.modules.pop("oppo_hooktarget", None)


def test_patch_for_an_already_imported_module_runs_at_once():
    import json

    seen = []
    install_hooks([Patch("t_now", "json", lambda m: seen.append(m), "test")])
    assert seen == [json]
