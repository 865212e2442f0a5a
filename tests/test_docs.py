"""The product's docs (README.md and docs/*.md) cite only paths the repository holds, link only
to headings that exist, and carry no dated or re-run section headings: a re-run updates its row
in docs/evidence.md. A `runs/...` folder is never in the repository (`.gitignore`), so a doc may
name one only as the output of a command it gives (`--output runs/x`, or `openrlhf-oppo train`'s
default `runs/<config>-<schedule>`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT_DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

TOP_FOLDERS = ("configs", "docs", "scripts", "examples", "openrlhf_oppo", "oppo_lab", "tests", "runs", "dockerfile",
               ".ci")
# a path token: a top folder, then anything up to whitespace, a quote, a bracket or a separator
PATH_TOKEN = re.compile(r"(?<![\w./~$-])((?:" + "|".join(re.escape(f) for f in TOP_FOLDERS)
                        + r")/[^\s`'\"()\[\]|,;]*)")
TEMPLATE_CHARS = "<{$…"  # the path is a pattern from here on: `runs/<name>`, `{sync,oppo}-0`, `$OUT`
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
OUTPUT_FLAG = re.compile(r"(?:(?:--output_dir|--ckpt\.output_dir|--calls-json|--output|--out)[ =]|\bOUT=)"
                         r"([^\s`'\"|;]+)")
TRAIN_COMMAND = re.compile(r"openrlhf-oppo train\b[^\n]*")
HEADING = re.compile(r"^(#{1,6})\s+(.*)$", re.M)
DATE = re.compile(r"\b(?:19|20)\d\d-\d\d(?:-\d\d)?\b|\b(?:January|February|March|April|May|June|July|August|"
                  r"September|October|November|December) \d{4}\b")
RERUN = re.compile(r"\b(?:again|a (?:second|third|fourth|fifth|sixth) time|replicated|re-?runs?)\b", re.I)


def _clean(token: str) -> str:
    """A path token without its anchor, test id or trailing punctuation."""
    for sep in ("#", "::"):
        token = token.split(sep, 1)[0]
    return token.rstrip(".:")


def declared_outputs(text: str) -> set[str]:
    """Folders and files the doc's own commands write: the argument of an output flag, and the
    run directory `openrlhf-oppo train` picks when it is given none (runs/<config stem>-<schedule>)."""
    joined = text.replace("\\\n", " ")
    outputs = {_clean(m).rstrip("/") for m in OUTPUT_FLAG.findall(joined)}
    for command in TRAIN_COMMAND.findall(joined):
        schedule = re.search(r"--schedule\s+(\S+)", command)
        config = re.search(r"--config\s+configs/(\S+?)\.yaml", command)
        if schedule and config and "--output" not in command:
            outputs.add(f"runs/{Path(config[1]).name}-{schedule[1].strip('`')}")
    return outputs


def cited_paths(text: str) -> tuple[list[str], list[str]]:
    """(repository paths named in code spans and fenced blocks, link targets)."""
    code = FENCE.findall(text)
    prose = FENCE.sub("", text)
    code += CODE_SPAN.findall(prose)
    paths = [_clean(m) for block in code for m in PATH_TOKEN.findall(block)]
    links = [m for m in LINK.findall(prose) if not re.match(r"[a-z]+:|#", m)]
    return paths, links


def _written_by(path: str, outputs: set[str]) -> bool:
    return any(path == out or path.startswith(out + "/") for out in outputs)


def missing_paths(text: str, doc_dir: Path, repo: Path = REPO) -> list[str]:
    """What the doc cites that the repository does not hold: a path in code (from the repository
    root) or a link (from the doc's folder) that does not exist, and a `runs/` path no command of
    the doc writes."""
    outputs = declared_outputs(text)
    paths, links = cited_paths(text)
    missing = []
    for path in paths:
        cut = min((path.index(c) for c in TEMPLATE_CHARS if c in path), default=None)
        if cut is not None:
            path = path[:cut].rsplit("/", 1)[0]
            if "/" not in path and path in TOP_FOLDERS:
                continue  # a placeholder such as `runs/<name>`
        if _written_by(path, outputs):
            continue
        if path.startswith("runs/") or path == "runs":
            missing.append(f"{path} (runs/ is not in the repository and no command here writes it)")
        elif "*" in path:
            if not list(repo.glob(path)):
                missing.append(f"{path} (matches nothing)")
        elif not (repo / path).exists():
            missing.append(path)
    for link in links:
        target = link.split("#", 1)[0]
        if target and not (doc_dir / target).exists():
            missing.append(f"{link} (link)")
    return missing


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading.strip())
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_anchors(text: str, doc: Path) -> list[str]:
    """Links `file.md#anchor` (or `#anchor`) into README.md or docs/*.md whose heading is gone."""
    broken = []
    for link in LINK.findall(FENCE.sub("", text)):
        if "#" not in link or re.match(r"[a-z]+:", link):
            continue
        target, anchor = link.split("#", 1)
        path = (doc.parent / target).resolve() if target else doc
        if path in PRODUCT_DOCS and anchor not in anchors(path.read_text()):
            broken.append(link)
    return broken


def diary_headings(text: str) -> list[str]:
    """Headings that date a section or announce a re-run; code blocks are not headings."""
    return [f"{hashes} {heading}" for hashes, heading in HEADING.findall(FENCE.sub("", text))
            if DATE.search(heading) or RERUN.search(heading)]


@pytest.mark.parametrize("doc", PRODUCT_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_a_product_doc_cites_is_in_the_repository(doc):
    assert missing_paths(doc.read_text(), doc.parent) == []


@pytest.mark.parametrize("doc", PRODUCT_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_anchor_a_product_doc_links_to_is_a_heading(doc):
    assert broken_anchors(doc.read_text(), doc) == []


@pytest.mark.parametrize("doc", PRODUCT_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_product_doc_heading_carries_a_date_or_a_rerun(doc):
    assert diary_headings(doc.read_text()) == []


def test_the_lab_notebooks_are_not_among_the_product_docs():
    names = {p.name for p in PRODUCT_DOCS}
    assert not names & {"benchmarks.md", "simulator.md", "convergence.md"}
    assert "evidence.md" in names


def test_missing_paths_finds_a_cited_folder_that_is_not_there(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "real.md").write_text("x")
    text = ("The data is in `runs/bench-foo/summary.json` and `docs/gone.md`; see [the page](real.md) "
            "and [the other](missing.md).\n\n```bash\nopenrlhf-oppo plot timeline runs/bench-bar\n```\n")
    assert sorted(missing_paths(text, tmp_path / "docs", repo=tmp_path)) == [
        "docs/gone.md", "missing.md (link)",
        "runs/bench-bar (runs/ is not in the repository and no command here writes it)",
        "runs/bench-foo/summary.json (runs/ is not in the repository and no command here writes it)"]


def test_missing_paths_accepts_what_a_command_of_the_doc_writes(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny-cpu.yaml").write_text("x")
    text = ("```bash\nopenrlhf-oppo bench schedules --config configs/tiny-cpu.yaml \\\n  --output runs/bench\n"
            "openrlhf-oppo train --schedule oppo --config configs/tiny-cpu.yaml\n"
            "python -m x --out docs/img/new.png\n```\n"
            "Each run is in `runs/bench/oppo-0`; the train run in `runs/tiny-cpu-oppo/train.log`; a template: "
            "`runs/<name>/ledger.jsonl`, `configs/{a,b}.yaml`.")
    assert missing_paths(text, tmp_path, repo=tmp_path) == []


def test_broken_anchors_finds_a_link_to_a_heading_that_is_gone():
    readme = REPO / "README.md"
    assert broken_anchors("[x](docs/evidence.md#no-such-heading) [y](docs/evidence.md#speed-per-step)", readme) == [
        "docs/evidence.md#no-such-heading"]


def test_slug_follows_githubs_anchor_rule():
    expected = "streamed-prefill-on-a-gpu-h100-qwen25-7bs-shape"
    assert slug("Streamed prefill on a GPU (H100, Qwen2.5-7B's shape)") == expected
    assert slug("`oppo` against `sync`: 1.5×") == "oppo-against-sync-15"


def test_diary_headings_finds_dated_and_rerun_headings_but_not_code():
    text = ("# Results\n\n### Again, 3 repeats (2026-11-27)\n\n## A third time, on a slower machine\n\n"
            "## Lag 4, December 2026\n\n```bash\n# 2026-12-02: a comment in a code block\n```\n## Speed per step\n")
    assert diary_headings(text) == ["### Again, 3 repeats (2026-11-27)", "## A third time, on a slower machine",
                                    "## Lag 4, December 2026"]
