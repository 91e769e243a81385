"""verl's length caps on `simulate`, `plan` and `study` (--max-response-length, --max-prompt-length), and
`plan` of one logged step at its own batch size."""

from __future__ import annotations

import json

import pytest

from tailsieve_verl.cli import main
from tailsieve_verl.core.data.trace import Group, Trace, read_trace, write_trace
from tailsieve_verl.core.data.workload import cap_trace, generate_trace

SMALL = ["--steps", "3", "--batch", "8", "--n", "4", "--replicas", "2", "--pool-size", "64", "--no-plots",
         "--policies", "verl,tailsieve", "--json", "--jobs", "1"]


def _consumed_mean(tmp_path, *flags) -> float:
    assert main(["simulate", *SMALL, "--out", str(tmp_path), *flags]) == 0
    return json.loads((tmp_path / "simulate.json").read_text())["policies"]["verl"]["consumed_mean_length"]


def test_simulate_stops_every_response_at_the_cap(tmp_path, capsys):
    free = _consumed_mean(tmp_path / "free")
    capped = _consumed_mean(tmp_path / "capped", "--max-response-length", "1100")
    assert capped <= 1100 < free  # the real preset's mean is far above its 1024-token median


def test_a_preset_prompt_is_as_long_as_the_prompt_cap(tmp_path, capsys):
    # prompts take KV blocks: 4000-token prompts on 200 blocks of 16 cannot hold 8 requests at once
    flags = ["--engine-defaults", "none", "--num-gpu-blocks", "2000", "--max-response-length", "2048"]
    assert main(["simulate", *SMALL, "--out", str(tmp_path / "a"), *flags]) == 0
    short = json.loads((tmp_path / "a" / "simulate.json").read_text())["policies"]["verl"]["mean_makespan_s"]
    assert main(["simulate", *SMALL, "--out", str(tmp_path / "b"), *flags, "--max-prompt-length", "4000"]) == 0
    long = json.loads((tmp_path / "b" / "simulate.json").read_text())["policies"]["verl"]["mean_makespan_s"]
    assert long > short


def test_a_logged_trace_is_cut_at_both_caps():
    trace = Trace((Group("a", (10, 5000, 300), 900), Group("b", (7,), 20)), name="t")
    capped = cap_trace(trace, max_response_length=400, max_prompt_length=512)
    assert [g.lengths for g in capped] == [(10, 400, 300), (7,)]
    assert [g.prompt_len for g in capped] == [512, 20]
    assert cap_trace(trace) is trace


def test_a_cap_below_the_presets_median_is_one_line(capsys):
    assert main(["simulate", *SMALL, "--max-response-length", "100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "median length (1024); raise the cap (--max-response-length)" in err[0]
    with pytest.raises(SystemExit) as stop:
        main(["study", "--max-prompt-length", "0"])
    assert stop.value.code == 2 and "--max-prompt-length: expected an integer in 1.." in capsys.readouterr().err


def test_plan_one_logged_step_at_its_own_batch_size(tmp_path, capsys):
    # 16 groups logged in one step, planned at --batch 16: each group copied once more to draw from
    trace = tmp_path / "step.jsonl"
    write_trace(generate_trace("real", 16, 4, seed=3), trace)
    assert main(["plan", "--trace", str(trace), "--batch", "16", "--replicas", "2", "--steps", "3", "--seeds", "1",
                 "--max-response-length", "3000", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["batch"], report["prompts"], report["prompt_copies"]) == (16, 16, 2)
    assert main(["plan", "--trace", str(trace), "--batch", "16", "--replicas", "2", "--steps", "3", "--seeds", "1"]) == 0
    assert "from 2 copies of each logged group" in capsys.readouterr().out
    assert main(["plan", "--trace", str(trace), "--batch", "17"]) == 2  # more than the trace holds
    assert len(read_trace(trace)) == 16  # the input is untouched


def test_study_records_its_caps(tmp_path, capsys):
    assert main(["study", "-N", "2", "-T", "8", "--group-size", "4", "--max-response-length", "2000",
                 "--max-prompt-length", "256", "--no-plots", "--out", str(tmp_path), "--json"]) == 0
    config = json.loads((tmp_path / "study.json").read_text())["config"]
    assert (config["max_response_length"], config["max_prompt_length"]) == (2000, 256)
