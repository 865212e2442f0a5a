"""`python -m oppo_lab engine`: what a decode iteration of vLLM costs on this host, by how many
sequences it decodes together.

A vLLM engine (this host's build) on a built-in task's actor decodes `--tokens` tokens for each
of N sequences at once (every response exactly that long), for each N of `--sequences`. Prints, per
N, the wall milliseconds an iteration, the CPU milliseconds an iteration of the engine's processes
(its engine core, and the worker process this vLLM build starts beside it offline; a run's TP-1
engine decodes inside its engine core) and of the front end (this process: `LLM`'s output
handling), and the CPU milliseconds a decoded token. On a host without a GPU every role of a run
shares the cores: an iteration that decodes a handful of stragglers beside training costs the
trainer nearly what a full one does, which is why OPPO holds carried groups there while the
trainer trains (`--oppo.staleness.carried_in_training auto`).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from openrlhf_oppo.bench import cpu_use

SEQUENCES = (1, 2, 4, 8, 16, 32, 64)


def _positive_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}; allowed: a comma-separated list of integers >= 1")
    return values


def main(argv: list[str] | None = None) -> int:
    from openrlhf_oppo import tasks

    p = argparse.ArgumentParser(prog="python -m oppo_lab engine", description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="longtail", choices=tasks.VARIANTS, help="built-in task whose actor decodes")
    p.add_argument("--tokens", type=int, default=200, help="tokens decoded for every sequence (>= 8)")
    p.add_argument("--sequences", type=_positive_list, default=list(SEQUENCES),
                   help="comma-separated counts of sequences decoded together")
    args = p.parse_args(argv)
    if args.tokens < 8:
        p.error(f"--tokens: {args.tokens}; allowed: an integer >= 8")

    from openrlhf_oppo.compat.env import launch_env, request_amx_permission

    actor = tasks.build(args.variant).actor
    saved = dict(os.environ)
    os.environ.update(launch_env())  # {} with CUDA: the GPU build's own settings; for the engine's processes
    request_amx_permission()
    try:
        _measure(args, actor)
    finally:  # a caller's later subprocesses must not inherit the compat layer
        os.environ.clear()
        os.environ.update(saved)
    return 0


def _measure(args: argparse.Namespace, actor: Path) -> None:
    from vllm import LLM, SamplingParams

    # as OpenRLHF 0.11.2 starts a TP-1 engine (`create_vllm_engines`: the "uni" executor)
    llm = LLM(str(actor), enforce_eager=True, max_model_len=args.tokens + 16, gpu_memory_utilization=0.5,
              seed=0, distributed_executor_backend="uni")
    params = SamplingParams(max_tokens=args.tokens, min_tokens=args.tokens, ignore_eos=True, temperature=1.0)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    llm.generate([prompt] * max(args.sequences), params, use_tqdm=False)  # warm-up: every batch shape compiled
    sampler = cpu_use.Sampler(Path(os.devnull))  # CPU seconds by process: this one is the "launcher"

    def cpu_s() -> tuple[float, float]:  # (this process's, the engine's processes')
        cpu = sampler.sample()["cpu"]
        return cpu.get("launcher", 0.0), sum(v for n, v in cpu.items() if n != "launcher")

    print(f"engine: {args.variant}'s actor, {args.tokens} tokens a sequence, one iteration a token")
    print(f"{'sequences':>9} {'wall ms/iter':>13} {'engine CPU ms/iter':>19} {'front end CPU ms/iter':>22} "
          f"{'CPU ms/token':>13}")
    for n in args.sequences:
        (mine0, core0), t0 = cpu_s(), time.perf_counter()
        llm.generate([prompt] * n, params, use_tqdm=False)
        (mine1, core1), t1 = cpu_s(), time.perf_counter()
        iters = args.tokens
        core, front = 1e3 * (core1 - core0) / iters, 1e3 * (mine1 - mine0) / iters
        print(f"{n:>9} {1e3 * (t1 - t0) / iters:>13.2f} {core:>19.2f} {front:>22.2f} {(core + front) / n:>13.3f}")
