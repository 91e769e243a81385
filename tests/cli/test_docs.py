"""The README and docs/ stay true to the tree: a short README, links and script paths that exist, every
CLI flag documented, every recorded result named in docs/results.md, every quoted figure equal to what
its result file renders, and no work-log counts."""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tailsieve_verl.cli import SUBCOMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SCRIPT_PATH = re.compile(r"(?<![\w/$])scripts/[\w./-]*[\w/]")
BRACES = re.compile(r"([\w./-]+)\.\{([\w,]+)\}")


def _expand_braces(text: str) -> str:
    """``stem.{json,txt}`` -> ``stem.json stem.txt``, as a shell would."""
    return BRACES.sub(lambda m: " ".join(f"{m.group(1)}.{ext}" for ext in m.group(2).split(",")), text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("#")}


def unmentioned_results(results_dir: Path, doc: str) -> list[str]:
    """Files under ``results_dir`` that ``doc`` does not name. A file is named by its file name
    (``stem.{json,txt}`` counts for both); a README by its folder (``folder/``); a file inside a run
    folder two levels down (``real_engine_vllm_cpu/one_step_quiet/calibration.json``) by that folder."""
    text = _expand_braces(doc)

    def named(word: str) -> bool:
        return re.search(rf"(?<![\w.]){re.escape(word)}(?![\w])", text) is not None

    missing = []
    for path in sorted(p for p in results_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(results_dir)
        by_folder = (len(rel.parts) > 2 or path.name == "README.md") and named(f"{rel.parent.name}/")
        if not (named(path.name) or by_folder):
            missing.append(rel.as_posix())
    return missing


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 200, f"README.md has {lines} lines; move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_point_at_files_and_headings_that_exist(page):
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        assert linked.exists(), f"{page.name}: link to a missing {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{page.name}: no heading #{anchor} in {linked.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_scripts_path_named_exists(page):
    for path in SCRIPT_PATH.findall(_expand_braces(page.read_text(encoding="utf-8"))):
        assert (ROOT / path).exists(), f"{page.name} names {path}, which does not exist"


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_usage_documents_every_flag(command):
    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for flag in (s for a in action.choices[command]._actions for s in a.option_strings):
        if flag in ("-h", "--help"):
            continue
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", usage), f"docs/usage.md lacks {command} {flag}"


def test_every_recorded_result_is_named_in_docs_results():
    doc = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert unmentioned_results(ROOT / "scripts" / "results", doc) == []


def test_a_result_file_added_without_a_mention_is_caught(tmp_path):
    (tmp_path / "question" / "run").mkdir(parents=True)
    for rel in ("question/README.md", "question/a.json", "question/a.txt", "question/run/cal.json", "question/new.json"):
        (tmp_path / rel).write_text("{}")
    doc = "`question/` holds `a.{json,txt}`; the raw run is in `run/`."
    assert unmentioned_results(tmp_path, doc) == ["question/new.json"]
    assert unmentioned_results(tmp_path, doc.replace("`run/`", "elsewhere")) == ["question/new.json",
                                                                                 "question/run/cal.json"]


def _docs_numbers():
    """``scripts/docs_numbers.py``, the one generator of every figure the README and docs/ quote."""
    spec = importlib.util.spec_from_file_location("docs_numbers", ROOT / "scripts" / "docs_numbers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_generated_figure_matches_its_result_file():
    """README.md and docs/ quote figures only through generated blocks, each equal to what its source
    renders now (run ``python scripts/docs_numbers.py --write`` after a new result)."""
    completed = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_numbers.py"), "--check"],
                               capture_output=True, text=True, cwd=ROOT)
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_the_readme_shows_the_current_table():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "<!-- numbers:current-table -->" in readme
    assert "<!-- numbers:current-detail -->" in (ROOT / "docs" / "results.md").read_text(encoding="utf-8")


def test_a_hand_edited_figure_is_caught(tmp_path):
    """One digit changed inside a generated block of a copy of the README fails the check, naming the block."""
    docs_numbers = _docs_numbers()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- numbers:current-table -->.*?<!-- /numbers -->", readme, re.S)[0]
    first = re.search(r"\d\.\d{3}", block)
    digit = block[first.end() - 1]
    edited_block = block[:first.end() - 1] + str((int(digit) + 1) % 10) + block[first.end():]
    copy = tmp_path / "README.md"
    copy.write_text(readme.replace(block, edited_block), encoding="utf-8")
    assert docs_numbers.main(["--check", "--pages", str(copy)]) == 1
    _, problems = docs_numbers.check_page(copy, strict=True)
    assert [p.split(":")[1] for p in problems] == ["current-table"]
    copy.write_text(readme, encoding="utf-8")
    assert docs_numbers.main(["--check", "--pages", str(copy)]) == 0


def test_a_figure_typed_outside_a_block_is_caught():
    docs_numbers = _docs_numbers()
    assert docs_numbers.hand_figures("TailSieve reads 1.108× stock verl.") != []
    assert docs_numbers.hand_figures("verl 0.9.1, P90/P50 1.5, <!-- numbers:lowest-cell -->0.981<!-- /numbers -->") == []


WORK_LOG_COUNT = re.compile(r"session ?[0-9]+", re.I)
SOURCE_TREES = ("README.md", "setup.py", "docs", "recipes", "scripts", "tailsieve_verl", "tests")


def test_no_work_log_counts_in_the_repository():
    """The repository speaks of dates, commits and versions; a work-log label means nothing to a reader."""
    paths = [ROOT / p for p in SOURCE_TREES if (ROOT / p).is_file()]
    paths += [f for p in SOURCE_TREES if (ROOT / p).is_dir() for f in sorted((ROOT / p).rglob("*"))
              if f.is_file() and "__pycache__" not in f.parts]
    hits = [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]}" for path in paths
            for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if WORK_LOG_COUNT.search(line)]
    hits += [f"{path.relative_to(ROOT)}: in its path" for path in paths if WORK_LOG_COUNT.search(str(path.relative_to(ROOT)))]
    assert hits == []
