"""The README and docs/ stay true to the tree: a short README, links and script paths that exist, every
CLI flag documented, and every recorded result named in docs/results.md."""

from __future__ import annotations

import argparse
import re
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


def _headline_cells() -> dict[str, dict[str, float]]:
    """Per cell of the headline table, the numbers its files hold: mean (and worst seed) speedup over stock
    verl of verl-redraw, tailsieve-fixed and tailsieve, best-static re-run on other draws, and the
    clairvoyant references."""
    import json

    import numpy as np

    folder = ROOT / "scripts" / "results" / "controller_vs_stock_verl"
    cells = {}
    for scale, name in (("64x8", "no_starvation_64x8.json"), ("256x16", "no_starvation_256x16.json"),
                        ("oracle", "controller_v2_64x8_oracle_crn.json")):
        rows = json.loads((folder / name).read_text())
        for cell in {r["cell"] for r in rows}:
            speedups = [r["speedup"] for r in rows if r["cell"] == cell]
            stats = cells.setdefault(f"{'64x8' if scale == 'oracle' else scale} {cell}", {})
            policies = (("clairvoyant-group", "clairvoyant-sample") if scale == "oracle" else
                        ("verl-redraw", "tailsieve-fixed", "tailsieve"))
            for policy in policies:
                    stats[policy] = float(np.mean([s[policy] for s in speedups]))
                    stats[policy + " worst"] = float(np.min([s[policy] for s in speedups]))
            if scale != "oracle":
                stats["best-static"] = float(np.mean([np.mean([v for k, v in s.items() if k.startswith("best-static (regen")])
                                                      for s in speedups]))
    return cells


def test_the_headline_table_is_computed_from_its_files():
    """Every number of the README's and docs/results.md's table against stock verl, from the JSON rows."""
    cells = _headline_cells()

    def mean_worst(cell, policy):
        return f"{cells[cell][policy]:.3f} [{cells[cell][policy + ' worst']:.3f}]"

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    labels = {"dense-weak": "dense 8 replicas, 64 × 8, weak", "dense-real": "dense, 64 × 8, real",
              "dense-strong": "dense, 64 × 8, strong", "moe-weak": "MoE 4 replicas, 64 × 8, weak",
              "moe-real": "MoE, 64 × 8, real", "moe-strong": "MoE, 64 × 8, strong"}
    for name, label in labels.items():
        c = f"64x8 {name}"
        redraw, adaptive = mean_worst(c, "verl-redraw"), mean_worst(c, "tailsieve")
        best, group, sample = (f"{cells[c][k]:.3f}" for k in ("best-static", "clairvoyant-group", "clairvoyant-sample"))
        assert f"| {label} | {redraw} | **{adaptive.split()[0]}** {adaptive.split()[1]} | {best} | {sample} |" in readme
        fixed = mean_worst(c, "tailsieve-fixed")
        assert (f"| {label} | {redraw} | {fixed} | **{adaptive.split()[0]}** {adaptive.split()[1]} | {best} | {group} "
                f"| {sample} |") in results
    for setup in ("dense", "moe"):
        c = [f"256x16 {setup}-{tails}" for tails in ("weak", "real", "strong")]

        def three(key):
            return " / ".join(f"{cells[x][key]:.3f}" for x in c)

        label = f"{'MoE' if setup == 'moe' else 'dense'}, 256 × 16, weak / real / strong"
        redraw, adaptive, best = three("verl-redraw"), three("tailsieve"), three("best-static")
        assert f"| {label} | {redraw} | **{adaptive}** | {best} | |" in readme
        assert f"| {label} | {redraw} | {three('tailsieve-fixed')} | **{adaptive}** | {best} | | |" in results
