"""`--help-openrlhf` on both entry points: every flag of OpenRLHF's `train_ppo_ray`, with its
default and help text, grouped by dotted section, read from OpenRLHF's source. OpenRLHF's own
`--help` imports flash_attn, which the CPU install lacks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from openrlhf_oppo.integrations.launch.openrlhf_flags import asks_help, parse_flags, train_flags

ENTRY_POINTS = {
    "openrlhf-oppo train": ["-m", "openrlhf_oppo.cli.main", "train", "--help-openrlhf"],
    "train_ppo_ray": ["-m", "openrlhf_oppo.cli.train_ppo_ray", "--help-openrlhf"],
}


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module", params=list(ENTRY_POINTS))
def printed(request) -> str:
    proc = run(*ENTRY_POINTS[request.param])
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    return proc.stdout


def sections(text: str) -> dict[str, list[str]]:
    """{section header: the lines of the flags under it}."""
    found: dict[str, list[str]] = {}
    header = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and (line.endswith(".") or line == "other") and " " not in line:
            header = line
            found[header] = []
        elif header is not None and line.startswith("  --"):
            found[header].append(line)
    return found


def test_every_openrlhf_flag_is_listed_once_with_the_default_openrlhf_flags_reads(printed):
    flags = train_flags()
    lines = {line.split()[0][2:]: line for lines in sections(printed).values() for line in lines}
    assert set(lines) == set(flags)
    for name, flag in flags.items():
        assert lines[name].endswith(f"(default: {flag.default_text})"), lines[name]
        if flag.default is not None:  # a literal: what `resolve` gives when the flag is not set
            shown = repr(flag.default) if isinstance(flag.default, str) else str(flag.default)
            assert flag.default_text == shown, name


def test_flags_are_grouped_under_their_dotted_section(printed):
    found = sections(printed)
    assert {"actor.", "critic.", "rollout.", "vllm.", "train.", "algo.", "ds."} <= set(found)
    for header, lines in found.items():
        for line in lines:
            name = line.split()[0][2:]
            assert name.startswith(header) if header != "other" else "." not in name, (header, line)


def test_help_texts_and_well_known_defaults_are_shown(printed):
    assert "\n  --rollout.batch_size INT  (default: 1024)\n" in printed
    text = " ".join(printed.split())  # help is wrapped
    assert "--vllm.enforce_eager (default: False) Disable CUDA graph in vLLM" in text
    assert "--algo.advantage.is_correction_level {off,token,seq} (default: 'off')" in text
    assert "--actor.adam.lr FLOAT (default: 1e-06)" in text  # `1e-6 if prefix == "actor" else 9e-6`
    assert "--critic.adam.lr FLOAT (default: 9e-06)" in text
    assert "--critic.muon.lr FLOAT (default: 0.02) LR for critic's Muon 2D-weight group" in text


def test_the_listing_imports_neither_flash_attn_nor_openrlhfs_trainer():
    code = ("import sys\n"
            "sys.modules['flash_attn'] = None\n"
            "from openrlhf_oppo.cli.main import main\n"
            "assert main(['train', '--help-openrlhf']) == 0\n"
            "assert 'openrlhf.cli.train_ppo_ray' not in sys.modules\n")
    proc = run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert "--actor.model_name_or_path" in proc.stdout


def test_both_helps_point_at_the_listing():
    train = run("-m", "openrlhf_oppo.cli.main", "train", "--help")
    assert train.returncode == 0 and "--help-openrlhf" in train.stdout
    cluster = run("-m", "openrlhf_oppo.cli.train_ppo_ray", "--help")
    assert cluster.returncode == 0 and "--help-openrlhf" in cluster.stdout
    assert "openrlhf.cli.train_ppo_ray --help" not in cluster.stdout


def test_the_flag_counts_only_before_the_separator():
    assert asks_help(["--help-openrlhf"])
    assert asks_help(["--schedule", "sync", "--help-openrlhf", "--", "--rollout.batch_size", "2"])
    assert not asks_help(["--schedule", "sync", "--", "--help-openrlhf"])


def test_parse_flags_reads_help_and_defaults_per_loop_value():
    source = '''
p.add_argument("--a.x", action="store_true", help="an " "x")
p.add_argument("--a.run", default="r_%s" % now())
for prefix in ("actor", "critic"):
    p.add_argument(f"--{prefix}.lr", type=float, default=1.0 if prefix == "actor" else 2.0, help=f"{prefix} lr")
'''
    flags = parse_flags(source)
    assert (flags["a.x"].help, flags["a.x"].default_text) == ("an x", "False")
    assert flags["a.run"].default_text == "computed: 'r_%s' % now()"
    assert (flags["actor.lr"].help, flags["actor.lr"].default_text) == ("actor lr", "1.0")
    assert (flags["critic.lr"].help, flags["critic.lr"].default_text) == ("critic lr", "2.0")
