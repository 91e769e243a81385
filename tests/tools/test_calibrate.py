"""`tailsieve calibrate` logic and the forced-length client, against a local fake endpoint
(protocol and file format only; decode timings come from the real vLLM tier)."""

from __future__ import annotations

import argparse
import json

import pytest
from fake_openai_server import FakeOpenAIServer

from tailsieve_verl.cli import calibrate as cli_calibrate
from tailsieve_verl.core.engine.perf import Calibration, TablePerf, parse_perf_model
from tailsieve_verl.tools.calibrate import CalibrationPlanError, SweepPlan, calibrate, write_calibration
from tailsieve_verl.tools.openai_client import EndpointError, ForcedRequest, OpenAIServer, synthetic_prompt


def test_forced_length_request_carries_exact_prompt_and_length():
    with FakeOpenAIServer() as fake:
        server = OpenAIServer(fake.url + "/v1")
        assert server.model == "tiny" and server.max_model_len == 1024
        prompt = synthetic_prompt(37, key=5)
        assert server.complete(ForcedRequest(prompt, 12)) == 12
    body = fake.bodies[0]
    assert body["prompt"] == list(prompt) and len(prompt) == 37
    assert body["max_tokens"] == body["min_tokens"] == 12
    assert body["ignore_eos"] is True and body["model"] == "tiny"


def test_synthetic_prompts_are_deterministic_and_distinct_per_key():
    assert synthetic_prompt(20, 3) == synthetic_prompt(20, 3)
    assert synthetic_prompt(20, 3) != synthetic_prompt(20, 4)
    assert len(synthetic_prompt(0, 1)) == 1


def test_model_selection_errors_name_the_fix():
    with FakeOpenAIServer(models=("a", "b")) as fake:
        with pytest.raises(EndpointError, match="--model"):
            OpenAIServer(fake.url)
        with pytest.raises(EndpointError, match="does not serve 'c'"):
            OpenAIServer(fake.url, model="c")
        assert OpenAIServer(fake.url, model="b").model == "b"


def test_unreachable_server_is_one_clear_error():
    with FakeOpenAIServer() as fake:
        url = fake.url
    with pytest.raises(EndpointError, match="cannot reach"):
        OpenAIServer(url, timeout_s=5)


def test_server_that_ignores_forced_length_is_rejected():
    with FakeOpenAIServer(short_by=1) as fake:
        with pytest.raises(EndpointError, match="generated 7 tokens where 8 were forced"):
            OpenAIServer(fake.url).complete(ForcedRequest((101, 102), 8))


def test_http_error_is_surfaced_with_the_servers_message():
    with FakeOpenAIServer(reject_over=50) as fake:
        with pytest.raises(EndpointError, match="HTTP 400.*maximum context length"):
            OpenAIServer(fake.url).complete(ForcedRequest(synthetic_prompt(40, 0), 20))


def test_run_together_returns_one_timing_per_request_in_order():
    with FakeOpenAIServer() as fake:
        server = OpenAIServer(fake.url)
        requests = [ForcedRequest(synthetic_prompt(4, i), length) for i, length in enumerate((3, 9, 1))]
        timings = server.run_together(requests)
    assert [t.completion_tokens for t in timings] == [3, 9, 1]
    assert all(t.finish_s > 0 for t in timings)
    assert sorted(b["max_tokens"] for b in fake.bodies) == [1, 3, 9]


@pytest.mark.parametrize("kwargs, match", [
    ({"batches": (4,)}, "two distinct batch sizes"),
    ({"prompt_lens": (0,)}, "prompt lengths"),
    ({"decode_short": 8, "decode_long": 8}, "decode_short < decode_long"),
    ({"repeats": 0}, "repeats"),
])
def test_bad_sweep_plans_are_refused(kwargs, match):
    with pytest.raises(CalibrationPlanError, match=match):
        SweepPlan(**kwargs)


def test_calibration_document_is_what_table_models_read(tmp_path):
    # the long runs sleep 0.76 s longer than the short ones: no scheduling hiccup on a loaded box inverts them
    plan = SweepPlan(batches=(1, 2), prompt_lens=(4, 32), decode_short=2, decode_long=40, repeats=1)
    with FakeOpenAIServer(seconds_per_token=0.02) as fake:
        doc = calibrate(OpenAIServer(fake.url), plan, device="test host")
    # warm-up + per point one short and one long run of `batch` requests + the prefill pairs
    assert len(fake.bodies) == 1 + sum(2 * b for b, _ in plan.points) + 2 * plan.prefill_batch * plan.repeats
    assert [(r["batch"], r["prompt_len"]) for r in doc["rows"]] == [(1, 4), (2, 4), (1, 32), (2, 32)]
    assert {r["context"] for r in doc["rows"]} == {4 + 21.0, 32 + 21.0}  # prompt + mean of short and long
    assert all(r["model"] == "tiny" and r["step_ms"] > 0 for r in doc["rows"])
    assert doc["device"] == "test host" and doc["server_version"] == "fake-0"
    path = tmp_path / "cal.json"
    cal = write_calibration(doc, path)
    assert isinstance(cal, Calibration) and cal.model == "tiny" and len(cal.batch) == 4
    assert isinstance(parse_perf_model(f"table:{path}"), TablePerf)
    assert parse_perf_model(f"fitted:{path}").name.startswith("fitted:")


def test_cli_writes_the_file_and_prints_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    cli_calibrate.register(parser.add_subparsers())
    out = tmp_path / "c.json"
    with FakeOpenAIServer(seconds_per_token=0.02) as fake:
        args = parser.parse_args(["calibrate", "--url", fake.url, "--out", str(out), "--batches", "1,2",
                                  "--prompt-lens", "4", "--decode-short", "2", "--decode-long", "40",
                                  "--repeats", "1", "--json"])
        assert args.func(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert len(printed["rows"]) == 2


def test_cli_rejects_a_malformed_batch_list():
    parser = argparse.ArgumentParser()
    cli_calibrate.register(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["calibrate", "--url", "http://x", "--batches", "1,two"])


def test_every_repeat_sweeps_every_point_so_a_slow_spell_hits_many_points_once():
    plan = SweepPlan(batches=(1, 2, 3), prompt_lens=(4,), decode_short=2, decode_long=8, repeats=3)
    visits = []
    with FakeOpenAIServer(seconds_per_token=0.02) as fake:
        doc = calibrate(OpenAIServer(fake.url), plan,
                        on_sample=lambda done, total, batch, context, step_s: visits.append((done, total, batch)))
    assert [b for _, _, b in visits] == [1, 2, 3, 3, 2, 1, 1, 2, 3]
    assert visits[-1][:2] == (9, 9)
    assert all(r["repeats"] == 3 and r["step_ms_spread"][0] <= r["step_ms"] <= r["step_ms_spread"][1]
               for r in doc["rows"])


def test_cli_temperature_reaches_every_request_and_prints_the_engine(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    cli_calibrate.register(parser.add_subparsers())
    with FakeOpenAIServer(seconds_per_token=0.02) as fake:
        args = parser.parse_args(["calibrate", "--url", fake.url, "--out", str(tmp_path / "c.json"), "--batches",
                                  "1,2", "--prompt-lens", "4", "--decode-short", "2", "--decode-long", "40",
                                  "--repeats", "1", "--prefill-lens", "4,32", "--prefill-batch", "1",
                                  "--temperature", "0"])
        assert args.func(args) == 0
    assert {body["temperature"] for body in fake.bodies} == {0.0}
    assert sorted({len(body["prompt"]) for body in fake.bodies if body["max_tokens"] == 1}) == [4, 32]
    out = capsys.readouterr().out
    assert "KV cache: unknown" in out and "prefill:" in out
    from tailsieve_verl.cli import build_parser

    with pytest.raises(SystemExit):  # the CLI's range check: one line, exit status 2
        build_parser().parse_args(["calibrate", "--url", "http://x", "--temperature", "-1"])
    assert "--temperature: expected a number >= 0 and <= 10, got -1" in capsys.readouterr().err


def test_speculation_facts_record_the_acceptance_per_position_at_the_temperature():
    """The counters of two points at k = 3 pool into one conditional acceptance per draft position, which
    the engine section records with the sampling temperature and calibrate prints."""
    from tailsieve_verl.core.engine.engine import engine_from_calibration
    from tailsieve_verl.tools.calibrate import engine_facts, speculation_rows
    from tailsieve_verl.tools.vllm_metrics import SpecCounters

    plan = SweepPlan(batches=(1, 2), prompt_lens=(4,))
    rows = [{"batch": b, "prompt_len": 4, "context": plan.context_of(4), "step_ms": 10.0} for b in (1, 2)]
    windows = {(1, 4): SpecCounters(60, 180, 60, (40, 15, 5)), (2, 4): SpecCounters(40, 120, 55, (30, 20, 5))}
    facts = engine_facts(None, None, speculation_rows(rows, windows), temperature=1.0)
    spec = facts["speculative"]
    assert (spec["temperature"], spec["k"], spec["drafts"]) == (1.0, 3, 100)
    assert spec["acceptance"] == [0.7, round(35 / 70, 4), round(10 / 35, 4)]  # pooled, conditional on the position before
    assert [r["acceptance"] for r in spec["rows"]] == [[round(40 / 60, 4), 0.375, 0.3333], [0.75, round(20 / 30, 4), 0.25]]
    out = cli_calibrate.describe_engine(facts, engine_from_calibration({"engine": facts}))
    assert "acceptance per draft position at temperature 1: 0.700, 0.500, 0.286 (k = 3, 100 drafts)" in out
    assert "--spec-acceptance FILE" in out
    assert engine_facts(None, None, None, temperature=1.0).get("speculative") is None  # a server that did not speculate
