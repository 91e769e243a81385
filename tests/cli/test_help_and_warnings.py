"""Help text (every flag explained, each default once, the default model's rows named, no
unexplained references), one rule per numeric flag, and the warnings that replace silent choices."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from tailsieve_verl.cli import SUBCOMMANDS, build_parser, main
from tailsieve_verl.cli.checks import FloatRule, HelpFormatter, IntRule

ROOT = Path(__file__).resolve().parents[2]
UNEXPLAINED = re.compile(r"seed §|\bthe seed\b|seed's|\(seed:|seed paper|seed best-k")


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_flag_has_help_and_each_default_appears_once(command):
    parser = subparsers()[command]
    formatter = HelpFormatter(prog=parser.prog)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings or action.dest}: no help text"
        shown = formatter._expand_help(action)
        assert shown.lower().count("default") <= 1, f"{command} {action.option_strings}: {shown}"
        assert "(default: None)" not in shown and "(default: False)" not in shown


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_numeric_flag_is_range_checked(command):
    for action in subparsers()[command]._actions:
        assert action.type not in (int, float), f"{command} {action.option_strings}: unchecked number"
        if isinstance(action.type, (IntRule, FloatRule)):
            assert action.type.lo <= action.type.hi


@pytest.mark.parametrize("command", ["simulate", "route", "study", "plan"])
def test_help_names_the_rows_of_the_default_model(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "table:h200-dense (qwen3-1.7b rows)" in " ".join(capsys.readouterr().out.split())


def test_help_readme_and_docs_name_the_paper_not_the_seed(capsys):
    texts = [page.read_text(encoding="utf-8") for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]
    assert len(texts) > 1, "docs/ is missing"
    for command in SUBCOMMANDS:
        with pytest.raises(SystemExit):
            main([command, "--help"])
        texts.append(capsys.readouterr().out)
    for text in texts:
        assert not UNEXPLAINED.search(text), UNEXPLAINED.search(text).group(0)


def test_simulate_and_study_both_write_into_an_out_directory():
    parsers = subparsers()
    for command in ("simulate", "study"):
        out = next(a for a in parsers[command]._actions if a.dest == "out")
        assert "directory" in out.help


def _file_log(path: Path, steps, gen) -> Path:
    path.write_text("".join(json.dumps({"step": s, "data": {"timing_s/gen": g, "timing_s/step": 2 * g}}) + "\n"
                            for s, g in zip(steps, gen)))
    return path


def test_compare_warns_once_about_repeated_steps_and_keeps_the_last(tmp_path, capsys):
    resumed = _file_log(tmp_path / "resumed.jsonl", [1, 2, 3, 2, 3, 4], [10, 99, 99, 10, 10, 10])
    base = _file_log(tmp_path / "base.jsonl", [1, 2, 3, 4], [20, 20, 20, 20])
    assert main(["compare", str(base), str(resumed), "--json"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0] == (f"tailsieve compare: warning: {resumed} logs step(s) 2, 3 more than once (a resumed run?); "
                        "keeping the last record of each")
    report = json.loads(captured.out)
    assert report["runs"][1]["gen_s"] == 10.0  # the resumed records (10), not the first ones (99)


def test_compare_is_silent_without_repeats(tmp_path, capsys):
    a = _file_log(tmp_path / "a.jsonl", [1, 2], [10, 10])
    b = _file_log(tmp_path / "b.jsonl", [1, 2], [5, 5])
    assert main(["compare", str(a), str(b), "--json"]) == 0
    assert capsys.readouterr().err == ""
