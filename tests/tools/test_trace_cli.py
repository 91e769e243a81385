"""`tailsieve trace` on rollout dumps written by verl 0.9.1's own dump writer
(PPOTrainer._write_generations, the function behind trainer.rollout_data_dir), with V1's
per-step uuid group keys."""

from __future__ import annotations

import argparse
import json
import uuid

import pytest

from tailsieve_verl.cli import trace as trace_cli
from tailsieve_verl.core.data.trace import TraceError, read_trace
from tailsieve_verl.cli.trace import tokenizer_counter
from tailsieve_verl.core.data.rollout_dump import build_trace, prompt_identity

PROMPTS = ["What is 2 + 2?", "Prove that the sum of two even numbers is even.", "Count the primes below 30."]
N = 4


def response(step: int, p: int, s: int) -> str:
    return " ".join(["word"] * (10 * (p + 1) + step + s))  # whitespace length 10(p+1) + step + s


def write_step(dump_dir, step: int, prompts=PROMPTS, extra: dict | None = None) -> None:
    """One step's dump through verl's writer; V1 uids are '{sample uuid}_{session}_{output}'."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    inputs, outputs, uids = [], [], []
    for p, text in enumerate(prompts):
        sample = str(uuid.uuid4())  # fresh per step, as in _add_batch_to_generate
        for s in range(N):
            inputs.append(text)
            outputs.append(response(step, p, s))
            uids.append(f"{sample}_{s}_0")
    extras = {"uid": uids, **(extra or {})}
    PPOTrainer._write_generations(inputs, outputs, [None] * len(inputs), [0.0] * len(inputs), extras,
                                  str(dump_dir), step)


@pytest.fixture()
def dump(tmp_path):
    d = tmp_path / "rollouts"
    for step in (1, 2, 10):
        write_step(d, step)
    return d


def test_prompt_pool_follows_prompts_across_steps(dump):
    build = build_trace(dump)
    assert build.steps == (1, 2, 10) and build.responses == 3 * 3 * N and not build.exact
    assert [g.prompt_id for g in build.trace] == [prompt_identity(p) for p in PROMPTS]
    for p, group in enumerate(build.trace):
        assert group.lengths == tuple(10 * (p + 1) + step + s for step in (1, 2, 10) for s in range(N))
        assert group.prompt_len == len(PROMPTS[p].split())
    assert "approximated" in build.trace.name


def test_step_trace_has_one_group_per_prompt_group(dump):
    build = build_trace(dump, step=2)
    assert [g.lengths for g in build.trace] == [tuple(10 * (p + 1) + 2 + s for s in range(N)) for p in range(3)]


def test_duplicate_prompt_within_a_step_is_two_groups(tmp_path):
    d = tmp_path / "dup"
    write_step(d, 1, prompts=[PROMPTS[0], PROMPTS[0]])
    step = build_trace(d, step=1).trace
    assert [g.prompt_id for g in step] == [prompt_identity(PROMPTS[0]), prompt_identity(PROMPTS[0]) + "#2"]
    pool = build_trace(d).trace
    assert len(pool) == 1 and pool[0].n == 2 * N


def test_token_counts_from_a_local_tokenizer(dump, tmp_path):
    from transformers import AutoTokenizer

    from tailsieve_verl.tools.tiny_qwen3 import build_tokenizer

    tok_dir = tmp_path / "tok"
    build_tokenizer(tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    build = build_trace(dump, count=tokenizer_counter(tok_dir))
    assert build.exact and "approximated" not in build.trace.name
    for p, group in enumerate(build.trace):
        want = [len(tokenizer.encode(response(step, p, s), add_special_tokens=False))
                for step in (1, 2, 10) for s in range(N)]
        assert list(group.lengths) == want
        assert group.prompt_len == len(tokenizer.encode(PROMPTS[p], add_special_tokens=False))
    # a response generated as canonical token ids and decoded the way verl dumps it counts back exactly
    ids = tokenizer.encode("the model routes long tail groups to a small pool", add_special_tokens=False)
    d = tmp_path / "ids"
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    PPOTrainer._write_generations(["q"], [tokenizer.decode(ids, skip_special_tokens=True)], [None], [0.0],
                                  {"uid": ["a_0_0"]}, str(d), 1)
    assert build_trace(d, count=tokenizer_counter(tok_dir)).trace[0].lengths == (len(ids),)


def test_dump_token_count_fields_win(tmp_path):
    d = tmp_path / "counted"
    n = len(PROMPTS) * N
    write_step(d, 3, extra={"response_length": list(range(100, 100 + n)), "prompt_length": [7] * n})
    build = build_trace(d)
    assert build.exact
    assert build.trace[0].lengths == (100, 101, 102, 103) and build.trace[0].prompt_len == 7


def cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    trace_cli.register(parser.add_subparsers())
    return parser.parse_args(["trace", *argv])


def test_cli_writes_a_trace_the_other_commands_read(dump, tmp_path, capsys):
    out = tmp_path / "pool.jsonl"
    assert trace_cli.run(cli(str(dump), "-o", str(out), "--json")) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["prompts"] == 3 and summary["responses"] == 36 and summary["kind"] == "prompt pool"
    assert summary["exact_token_counts"] is False and summary["rollout_n"] == N
    trace = read_trace(out)
    assert [g.n for g in trace] == [3 * N] * 3
    assert trace.groups == build_trace(dump).trace.groups

    assert trace_cli.run(cli(str(dump), "-o", str(out))) == 0
    assert f"pass --n {N} to `tailsieve plan`" in capsys.readouterr().out

    out_step = tmp_path / "step10.parquet"
    assert trace_cli.run(cli(str(dump), "-o", str(out_step), "--step", "10")) == 0
    assert "3 prompts, 12 responses" in capsys.readouterr().out
    assert [g.n for g in read_trace(out_step)] == [N] * 3


def test_bad_inputs_are_clear_errors(tmp_path, dump):
    with pytest.raises(TraceError, match="no such file"):
        build_trace(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no verl rollout dump"):
        build_trace(tmp_path / "empty")
    with pytest.raises(TraceError, match="99.jsonl"):
        build_trace(dump, step=99)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "1.jsonl").write_text('{"input": "q", "output": "a b"}\n{"lengths": [1, 2]}\n')
    with pytest.raises(TraceError, match="1.jsonl:2: not a verl rollout dump line"):
        build_trace(bad)
    with pytest.raises(TraceError, match="--tokenizer .*not a directory"):
        tokenizer_counter(tmp_path / "nope")
    (tmp_path / "not_a_tokenizer").mkdir()
    with pytest.raises(TraceError, match="cannot load a tokenizer"):
        tokenizer_counter(tmp_path / "not_a_tokenizer")


def write_preset_dump(dump_dir, preset: str, groups: int = 128, n: int = 8) -> None:
    """One step of a bundled preset as verl's dump lines with token counts (response_length, prompt_length)."""
    from tailsieve_verl.core.data.workload import generate_trace

    dump_dir.mkdir(parents=True)
    with open(dump_dir / "1.jsonl", "w", encoding="utf-8") as f:
        for g in generate_trace(preset, groups, n, seed=3):
            for s, length in enumerate(g.lengths):
                f.write(json.dumps({"input": f"prompt {g.prompt_id}", "output": "", "uid": f"{g.prompt_id}_{s}_0",
                                    "step": 1, "response_length": length, "prompt_length": 0}) + "\n")


@pytest.mark.parametrize("preset", ["weak", "real", "strong"])
def test_trace_names_the_closest_preset_by_its_tail(tmp_path, capsys, preset):
    """A pool drawn from a preset reads as that preset: P90/P50 beside the presets' 1.5 / 3.6 / 6.0, the
    share at the cap counted at --max-response-length."""
    write_preset_dump(tmp_path / "dump", preset)
    assert trace_cli.run(cli(str(tmp_path / "dump"), "-o", str(tmp_path / "pool.jsonl"),
                             "--max-response-length", "16384", "--json")) == 0
    lengths = json.loads(capsys.readouterr().out)["lengths"]
    assert lengths["closest_preset"] == preset and lengths["cap"] == 16384
    assert lengths["presets"]["weak"]["p90_p50"] == pytest.approx(1.5, abs=0.01)
    assert lengths["presets"]["strong"]["p90_p50"] == pytest.approx(6.0, abs=0.01)
    assert lengths["p90_p50"] == pytest.approx(lengths["p90"] / lengths["p50"])
    assert trace_cli.run(cli(str(tmp_path / "dump"), "-o", str(tmp_path / "pool2.jsonl"))) == 0
    out = capsys.readouterr().out
    assert f"closest: {preset} (by P90/P50)" in out and "at the longest response" in out
