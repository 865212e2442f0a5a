"""The lab: the studies behind openrlhf_oppo's evidence, kept apart from what a cluster user installs.

Simulator calibration and validation (`sim`), the convergence studies (`convergence`), the
control-plane and soak harnesses, micro-benchmarks of the scheduler, vLLM's decode and the
advantage computation, the learn task's build pipeline (`learn`) and the ablation schedules
(`schedules`). It imports the product; the product never imports it (tests/package/test_layout.py).
Not in the wheel: run it from a checkout, `python -m oppo_lab <command>` (oppo_lab/README.md).
"""
