"""Loaded by every Python process started under an OpenRLHF CPU run (the launcher
puts this directory first on PYTHONPATH and sets OPPO_COMPAT=1). Cheap: it does
not import torch; the patches run only when their target modules are imported."""

import os

if os.environ.get("OPPO_COMPAT") == "1":
    try:
        from openrlhf_oppo.compat import _startup

        _startup.run()
    except Exception as exc:  # never break an unrelated Python process
        import sys

        print(f"openrlhf_oppo.compat: sitecustomize failed: {exc!r}", file=sys.stderr)
