"""Input checks of `openrlhf-oppo train`, in the launcher before Ray starts (no model
is loaded): bad input is an error naming the flag, file or row, never a silent drop.

`check_config` (always; no download): the flags as OpenRLHF's parser reads them
(`openrlhf_flags.resolve`: YAML flags, then the extra flags after `--`), batch sizes
that OpenRLHF and DeepSpeed would take apart or assert on deep inside a Ray actor,
and OPPO's Δ against the rollout batch; the memory of every GPU in every phase of a step
(`memory_check`: model shapes from config.json or the shipped table, no weights), printed as
a table where the device's memory is known.

`check_inputs` (skippable with `--skip-input-checks`): the local JSON / JSONL files of
`--data.prompt_dataset` row by row, how many prompts OpenRLHF will cut to fit its
prompt budget (written to RUN_DIR/preflight.json), and that the reward model (and an
explicitly set critic) tokenize as the actor does. Hub ids are skipped with a notice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

NOTE = "openrlhf-oppo train: input checks:"
# Strings whose token ids must agree between the actor's and the reward model's tokenizer.
PROBES = ("Hello, world!", "The quick brown fox jumps over the lazy dog.", " 0123456789 +-*/=",
          "question: red cat answer:", "naïve café – 日本語 🙂\n\tend")
JSON_EXTS = (".json", ".jsonl")


def _note(message: str) -> None:
    print(f"{NOTE} {message}", flush=True)


def resolve(flags: dict[str, Any], extra_argv: list[str], oppo: bool):
    """({OpenRLHF flag: value} as the child's parser will see them, the final
    OppoConfig or None). `extra_argv`: the `--oppo.*` flags and the ones after `--`."""
    from openrlhf_oppo.integrations.launch import openrlhf_flags, yaml_config

    cfg, rest = None, list(extra_argv)
    if oppo:
        from openrlhf_oppo.integrations.launch import driver

        cfg, rest = driver.parse(rest)
    values, unknown = openrlhf_flags.resolve([*yaml_config.to_argv(flags), *rest])
    if unknown:
        raise ValueError(unknown_flag(next((a for a in unknown if a.startswith("-")), unknown[0]), oppo))
    return values, cfg


def unknown_flag(arg: str, oppo: bool) -> str:
    """The message for a flag neither OpenRLHF's parser nor OPPO's knows: what it is not, and
    the closest name it may have meant."""
    from openrlhf_oppo import config as oppo_config
    from openrlhf_oppo import settings
    from openrlhf_oppo.integrations.launch import openrlhf_flags

    name = arg.split("=", 1)[0]
    ours = [f"--{oppo_config.FLAG_PREFIX}.{dotted}" for dotted, _, _ in settings.leaves(oppo_config.OppoConfig)]
    if name.startswith("--oppo."):
        if name in ours:  # a real OPPO flag under one of OpenRLHF's schedules
            return f"{name}: an OPPO flag; --oppo.* flags apply to the oppo* schedules only"
        return f"{name}: not an OPPO flag{settings.suggest(name, ours)}; docs/flags.md lists them"
    theirs = [f"--{n}" for n in openrlhf_flags.train_flags()]
    return (f"{name}: not a flag of OpenRLHF's train_ppo_ray{settings.suggest(name, theirs + ours * oppo)}; "
            "openrlhf-oppo train --help-openrlhf lists them")


def preset_device(extra_argv: list[str]):
    """The `device:` section of the `--config` preset among `extra_argv` (the cluster entry's
    argv) as a `memory_check.Device`; None without a preset or a section."""
    import argparse

    from openrlhf_oppo.integrations.launch import memory_check, yaml_config

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", default=None)
    preset = parser.parse_known_args(extra_argv)[0].config
    if not preset:
        return None
    return memory_check.preset_device(yaml_config.load(preset).device, preset)


def check_config(flags: dict[str, Any], extra_argv: list[str], oppo: bool, device=None,
                 strict_memory: bool = False) -> dict[str, Any]:
    """ValueError naming the flags of an inconsistent batch / length set-up or a layout whose
    memory does not fit; the resolved values. `device`: the GPU a preset was sized for (a
    `memory_check.Device`; default: the `device:` of a `--config` among `extra_argv`), used where
    neither OPPO_DEVICE_MEMORY_GB nor a local GPU says; `strict_memory`: a model the check cannot
    count is an error, not a warning (`--dry-run`)."""
    v, cfg = resolve(flags, extra_argv, oppo)
    for name in ("rollout.batch_size", "rollout.n_samples_per_prompt", "rollout.micro_batch_size",
                 "train.batch_size", "train.micro_batch_size", "data.max_len", "data.max_samples"):
        if not (isinstance(v[name], int) and v[name] >= 1):
            raise ValueError(f"--{name} must be an integer >= 1, got {v[name]!r}")
    max_len, new = v["data.max_len"], v["rollout.max_new_tokens"]
    if new is not None and not 1 <= new < max_len:
        raise ValueError(f"--rollout.max_new_tokens ({new}) must be >= 1 and < --data.max_len ({max_len}): "
                         "OpenRLHF gives the prompt what max_len - max_new_tokens leaves")
    rb = v["rollout.batch_size"]
    n = v["rollout.n_samples_per_prompt"]
    tb = v["train.batch_size"]
    mb = v["train.micro_batch_size"]
    if (rb * n) % tb:
        raise ValueError(
            f"--rollout.batch_size x --rollout.n_samples_per_prompt = {rb} x {n} = {rb * n} samples per step "
            f"must be a multiple of --train.batch_size ({tb}): OpenRLHF makes one optimizer step per "
            f"{tb} samples, so the last {(rb * n) % tb} would be dropped (dynamic batching) or accumulated "
            "into the next step's update (DeepSpeed)")
    split = v["ds.ring_attn_size"] * v["ds.tensor_parallel_size"]
    trained = ("actor", "critic") if v["algo.advantage.estimator"] == "gae" else ("actor",)
    for group in trained:
        dp = max(1, v[f"{group}.num_nodes"] * v[f"{group}.num_gpus_per_node"] // split)
        if tb % (mb * dp):
            raise ValueError(
                f"--train.batch_size ({tb}) must be a multiple of --train.micro_batch_size ({mb}) x the "
                f"{group}'s data-parallel size ({dp} = --{group}.num_nodes x --{group}.num_gpus_per_node / "
                "--ds.ring_attn_size / --ds.tensor_parallel_size): DeepSpeed asserts train_batch_size = "
                "micro_batch x gradient_accumulation x world size")
    if cfg is not None and cfg.delta.enable and cfg.delta.max > rb:
        raise ValueError(f"--oppo.delta.max ({cfg.delta.max}) must be <= --rollout.batch_size ({rb}): "
                         "at most B prompt groups can be carried into the next step")
    from openrlhf_oppo.integrations.launch import memory_check

    memory_check.check(v, cfg, preset=device or preset_device(extra_argv), strict=strict_memory)
    return v


# ------------------------------------------------------------------------- checkpoints

CKPT_MODELS = ("_actor", "_critic")  # under --ckpt.path: what OpenRLHF (and the Megatron actor) resume
LATEST = "latest"  # DeepSpeed's file naming the newest tag; the Megatron actor writes one too


def check_checkpoint(v: dict[str, Any]) -> None:
    """With `--ckpt.load_enable`, the checkpoint every trained model resumes from (the tag
    `--ckpt.path/_actor/latest` names, and `_critic`'s with a critic) is complete and readable:
    model and optimizer states present, every `.pt` file a whole torch archive (its zip
    directory, read without loading a tensor), nothing empty. A truncated file is an error naming
    it, before any process starts, not an OSError inside an actor after the cluster started."""
    if not v["ckpt.load_enable"]:
        return
    models = CKPT_MODELS if v["algo.advantage.estimator"] == "gae" else CKPT_MODELS[:1]
    for name in models:
        folder = Path(v["ckpt.path"]) / name
        if not folder.is_dir():
            _note(f"--ckpt.load_enable: no checkpoint in {folder}; {name[1:]} starts from its pretrained weights")
            continue
        try:
            tag = (folder / LATEST).read_text().strip()
        except OSError as exc:
            tag = ""
            problem = f"cannot read {folder / LATEST}, the file naming the checkpoint to resume ({exc.strerror})"
        else:
            problem = _checkpoint_problem(folder / tag, optimizer=v["ds.zero_stage"] >= 1)
        if problem:
            others = sorted(d.name for d in folder.iterdir() if d.is_dir() and d.name != tag)
            fix = f"write another tag ({', '.join(others)}) into {folder / LATEST}, or " if others else ""
            raise ValueError(f"--ckpt.load_enable: {problem}; {fix}move {folder} away to start afresh")


def _checkpoint_problem(tag_dir: Path, optimizer: bool) -> str | None:
    """What makes the checkpoint folder `tag_dir` unusable, or None."""
    import zipfile

    if not tag_dir.is_dir():
        return f"{tag_dir.parent / LATEST} names {tag_dir.name}, which is not a folder of {tag_dir.parent}"
    files = sorted(f for f in tag_dir.iterdir() if f.is_file())
    names = [f.name for f in files]
    if not any(n.endswith("model_states.pt") or n.startswith("model_") for n in names):
        return f"{tag_dir} holds no model states (an interrupted save?)"
    if optimizer and not any(n.endswith("optim_states.pt") or n.startswith("optimizer_") for n in names):
        return f"{tag_dir} holds no optimizer states (an interrupted save?)"
    for f in files:
        try:
            size = f.stat().st_size
            if size == 0:
                return f"{f} is empty (an interrupted save?)"
            if f.suffix == ".pt":
                with zipfile.ZipFile(f) as archive:
                    if any(i.header_offset + i.compress_size > size for i in archive.infolist()):
                        return f"{f} is truncated"
            else:
                with f.open("rb"):
                    pass
        except zipfile.BadZipFile:
            return f"{f} is truncated or not a torch checkpoint file ({size} bytes, no whole archive)"
        except OSError as exc:
            return f"cannot read {f} ({exc.strerror})"
    return None


# ----------------------------------------------------------------------- dataset rows


def _dataset_files(entry: str, split: str) -> tuple[list[Path], str]:
    """The JSON / JSONL files OpenRLHF's `blending_datasets` reads for one
    `--data.prompt_dataset` entry (`path[@data_dir]`); ([], why) when not checked."""
    path, _, data_dir = (s.strip() for s in entry.partition("@"))
    p = Path(path)
    if p.suffix == ".py" or (p.is_dir() and (p / f"{p.name}.py").exists()):
        return [], "a dataset script"
    if p.suffix in JSON_EXTS:  # as OpenRLHF: by extension, case-sensitive
        if not p.is_file():
            raise ValueError(f"--data.prompt_dataset: file not found: {path}")
        if split != "train":
            raise ValueError(f"--data.prompt_split '{split}': a single file {path} has only the 'train' split")
        return [p], ""
    if not p.is_dir():
        if _local_path(path):
            raise ValueError(f"--data.prompt_dataset: no such file or folder: {path} (a hub id is 'name' or "
                             "'org/name')")
        return [], "not a local JSON/JSONL file or directory (a hub id or another format)"
    if any((p / name).exists() for name in ("state.json", "dataset_dict.json")):
        return [], "saved with datasets' save_to_disk"
    from datasets.data_files import DataFilesDict, get_data_patterns

    root = p / data_dir if data_dir else p
    try:
        by_split = DataFilesDict.from_patterns(get_data_patterns(str(root)), base_path=str(root))
    except Exception:  # no data files at all: datasets' own error follows at load time
        return [], "no data files found"
    if split not in by_split:
        raise ValueError(f"--data.prompt_split '{split}': {root} has the splits {', '.join(map(str, by_split))}")
    files = [Path(f) for f in by_split[split] if Path(f).suffix.lower() in JSON_EXTS]
    return files, "" if files else "no JSON/JSONL files"


def _local_path(path: str) -> bool:
    """Whether `path` names a local file or folder, not a hub id (`name`, `org/name`): absolute,
    relative to `.`, `..` or `~`, deeper than `org/name`, or under a folder that exists here."""
    p = Path(path)
    return (p.is_absolute() or path.startswith((".", "~")) or len(p.parts) > 2
            or (len(p.parts) == 2 and p.parent.is_dir()))


def _rows(path: Path):
    """(row, where, record) for each row of a JSON-lines file or a JSON array file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--data.prompt_dataset {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--data.prompt_dataset {path}: line {exc.lineno} is not valid JSON ({exc.msg})") from None
        yield from ((i, f"row {i}", rec) for i, rec in enumerate(records, 1))
        return
    row = 0
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        row += 1
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--data.prompt_dataset {path}: line {lineno} is not valid JSON "
                             f"({exc.msg}, column {exc.colno})") from None
        yield row, f"row {row} (line {lineno})", rec


def _check_row(rec: Any, where: str, path: Path, v: dict[str, Any]) -> None:
    if not isinstance(rec, dict):
        raise ValueError(f"--data.prompt_dataset {path}: {where} is a JSON {type(rec).__name__}, not an object")
    keys = ", ".join(map(repr, rec)) or "none"
    for flag in ("data.input_key", "data.label_key"):
        key = v[flag]
        if key is None:
            continue
        if key not in rec or rec[key] is None:
            raise ValueError(f"--data.prompt_dataset {path}: {where} has no --{flag} '{key}'; its keys: {keys}")
    value = rec[v["data.input_key"]]
    chat = v["data.apply_chat_template"]
    if not ((isinstance(value, str) and value.strip())
            or (chat and isinstance(value, list) and value and all(isinstance(m, dict) for m in value))):
        wanted = "a non-empty string" + (" or a list of chat messages" if chat else "")
        raise ValueError(f"--data.prompt_dataset {path}: {where}: --data.input_key '{v['data.input_key']}' "
                         f"must be {wanted}, got {json.dumps(value)[:60]}")


# ------------------------------------------------------------------------- tokenizers


def _tokenizer(flag: str, path: str, v: dict[str, Any]):
    """The tokenizer as OpenRLHF's `get_tokenizer` loads it (pad falls back to eos)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True, use_fast=not v["data.disable_fast_tokenizer"])
    except Exception as exc:
        raise ValueError(f"--{flag} {path}: cannot load its tokenizer ({str(exc).splitlines()[0][:200]})") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def first_difference(actor, other, name: str = "reward") -> str | None:
    """The first way two tokenizers disagree on what the reward forward relies on."""
    def ids(tok, text):
        return tok(text, add_special_tokens=False)["input_ids"]

    checks = [("vocabulary size", len(actor), len(other))]
    specials = ("eos_token_id", "pad_token_id", "bos_token_id")
    checks += [(attr, getattr(actor, attr), getattr(other, attr)) for attr in specials]
    checks += [(f"token ids of {p!r}", ids(actor, p), ids(other, p)) for p in PROBES]
    return next((f"{what} {a} (actor) vs {b} ({name})" for what, a, b in checks if a != b), None)


def _prompt_text(rec: dict, v: dict[str, Any], tok) -> str:
    """The prompt as OpenRLHF's PromptDataset (preprocess_data) builds it."""
    prompt = rec[v["data.input_key"]]
    if v["data.apply_chat_template"]:
        chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        try:
            return tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise ValueError(f"--data.apply_chat_template: the actor's tokenizer cannot apply its chat "
                             f"template ({str(exc).splitlines()[0][:200]})") from None
    template = v["data.input_template"]
    return template.format(prompt) if template and "{}" in template else prompt  # OpenRLHF drops one without {}


def prompt_budget(v: dict[str, Any]) -> tuple[int, str]:
    """OpenRLHF's SingleTurnAgentExecutor keeps the last max_len - max_tokens prompt
    tokens, max_tokens being --rollout.max_new_tokens or, unset, max(1, max_len - prompt)."""
    max_len, new = v["data.max_len"], v["rollout.max_new_tokens"]
    if new is None:
        return max_len - 1, f"--data.max_len {max_len} - 1 (--rollout.max_new_tokens unset)"
    return max_len - new, f"--data.max_len {max_len} - --rollout.max_new_tokens {new}"


def check_inputs(flags: dict[str, Any], extra_argv: list[str], out: Path, oppo: bool) -> dict[str, Any]:
    """Dataset rows, prompt lengths and tokenizers; the report is written to `out` (JSON)."""
    v, _ = resolve(flags, extra_argv, oppo)
    report: dict[str, Any] = {"prompt_dataset": v["data.prompt_dataset"], "files": [], "rows": 0, "skipped": []}

    def skip(what: str, why: str) -> None:
        report["skipped"].append(f"{what}: {why}")
        _note(f"{what} not checked: {why}")

    # 1. dataset rows: every row of every local file; the first --data.max_samples of
    # each entry are the prompts OpenRLHF uses (of all entries, without --data.prompt_probs)
    used: list[tuple[dict, Path, int]] = []
    for entry in (v["data.prompt_dataset"] or "").split(","):
        if not entry.strip():
            continue
        files, why = _dataset_files(entry, v["data.prompt_split"])
        if not files:
            skip(f"--data.prompt_dataset {entry.strip()}", why)
        taken = 0
        for path in files:
            report["files"].append(str(path))
            for row, where, rec in _rows(path):
                _check_row(rec, where, path, v)
                report["rows"] += 1
                if taken < v["data.max_samples"]:
                    used.append((rec, path, row))
                    taken += 1
        if files and not taken:
            raise ValueError(f"--data.prompt_dataset {entry.strip()}: no rows in {', '.join(map(str, files))}")
    if v["data.prompt_probs"] is None:
        used = used[: v["data.max_samples"]]

    # 2. tokenizers: the reward model (and an explicitly set critic) get the actor's token ids
    actor_path = v["actor.model_name_or_path"]
    actor_tok = None
    if actor_path and os.path.isdir(actor_path):
        actor_tok = _tokenizer("actor.model_name_or_path", actor_path, v)
    else:
        skip(f"--actor.model_name_or_path {actor_path}", "not a local directory (prompt lengths and tokenizers)")
    others = []  # (flag, path) of the models that read the actor's token ids
    if not v["reward.remote_url"]:
        paths = (v["reward.model_name_or_path"] or "").split(",")
        others += [("reward.model_name_or_path", p.strip()) for p in paths if p.strip()]
    critic = v["critic.model_name_or_path"]
    if critic and v["algo.advantage.estimator"] == "gae" and critic not in [p for _, p in others]:
        others.append(("critic.model_name_or_path", critic))
    report["tokenizers_compared"] = []
    for flag, path in others if actor_tok is not None else []:
        if not os.path.isdir(path):
            skip(f"--{flag} {path}", "not a local directory")
            continue
        if os.path.realpath(path) != os.path.realpath(actor_path):
            diff = first_difference(actor_tok, _tokenizer(flag, path, v), flag.split(".")[0])
            if diff:
                raise ValueError(
                    f"--{flag} {path}: its tokenizer differs from the actor's (--actor.model_name_or_path "
                    f"{actor_path}): {diff}; OpenRLHF feeds the actor's token ids to it, so it would score garbage")
        report["tokenizers_compared"].append(path)

    # 3. prompt lengths against OpenRLHF's prompt budget
    limit, rule = prompt_budget(v)
    report.update(prompt_limit_tokens=limit, prompt_limit_rule=rule, prompts_counted=0, prompts_over_limit=0)
    if v["data.input_template"] and "{}" not in v["data.input_template"]:
        _note("warning: --data.input_template has no '{}'; OpenRLHF ignores it")
    if actor_tok is not None and used:
        texts = [_prompt_text(rec, v, actor_tok) for rec, _, _ in used]
        lengths = [len(ids) for ids in actor_tok(texts, add_special_tokens=False)["input_ids"]]
        over = [i for i, n in enumerate(lengths) if n > limit]
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        _, path, row = used[longest]
        if v["data.apply_chat_template"]:
            prompt_text = "chat template"
        elif "{}" in (v["data.input_template"] or ""):
            prompt_text = "input template"
        else:
            prompt_text = "raw input"
        report.update(prompts_counted=len(lengths), prompts_over_limit=len(over),
                      longest_prompt_tokens=lengths[longest], longest_prompt=f"{path} row {row}",
                      prompt_text=prompt_text)
        if len(over) == len(lengths):
            raise ValueError(f"all {len(lengths)} prompts are longer than the prompt budget of {limit} tokens "
                             f"({rule}); the shortest has {min(lengths)}: raise --data.max_len or lower "
                             "--rollout.max_new_tokens")
        if over:
            _note(f"warning: {len(over)} of {len(lengths)} prompts are longer than the prompt budget of {limit} "
                  f"tokens ({rule}); OpenRLHF keeps only their last {limit} tokens (longest: {lengths[longest]} "
                  f"tokens, {path} row {row}); counted in {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    _note(f"{report['rows']} rows in {len(report['files'])} file(s), {report['prompts_counted']} prompts counted, "
          f"{report['prompts_over_limit']} over the {limit}-token prompt budget; "
          f"tokenizers compared: {len(report['tokenizers_compared'])}")
    return report
