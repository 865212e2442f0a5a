"""The lab's tests: the ablation schedules are registered for every test (as `python -m oppo_lab`
does); folders have no __init__.py, as in tests/ (pytest runs with --import-mode=importlib)."""

from oppo_lab import schedules  # noqa: F401 (registers the ablation schedules)
