"""Every point where openrlhf_oppo touches OpenRLHF (written against 0.11.2):

    openrlhf_flags    the flag table of `openrlhf.cli.train_ppo_ray`, read from its source
    schedules         schedule name -> OpenRLHF flags (sync, async, partial, oversample, ...)
    yaml_config       our YAML -> OpenRLHF's own dotted flags
    launcher          runs `python -m openrlhf.cli.train_ppo_ray` unmodified (+ compat on CPU)
    seeding           per-request vLLM seeds under --train.full_determinism_enable (every schedule)

The CPU-only patches of OpenRLHF internals live in `openrlhf_oppo.compat.patches`.
"""

OPENRLHF_VERSION = "0.11.2"
