"""Where openrlhf_oppo meets OpenRLHF (written against the release in `openrlhf_oppo.upstream`),
split by the process the code runs in:

    launch/    the launcher and the Ray driver's set-up: flags, YAML, schedules, input checks,
               wandb; imports neither ray nor torch at module level (a test enforces it)
    runtime/   what runs inside Ray actors: the trainer, the samples generator and its
               collaborators, the streaming rollout and reward actors, seeding, timeline hooks

The CPU-only patches of OpenRLHF internals live in `openrlhf_oppo.compat`.
"""
