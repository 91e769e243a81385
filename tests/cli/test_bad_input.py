"""Every class of bad input to every subcommand: exit status 2, exactly one line on stderr, no
traceback, and every file the command was given left byte-identical."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tailsieve_verl.cli import main

SERVER = "http://127.0.0.1:9"  # nothing listens there; every bench/calibrate case fails before contacting it


def make_inputs(d: Path) -> None:
    """Good and bad inputs, each named for what it is."""
    (d / "ok.jsonl").write_text("".join(json.dumps({"prompt_id": f"p{i}", "lengths": [100 + 37 * i, 50, 700]}) + "\n"
                                        for i in range(40)))
    (d / "binary.jsonl").write_bytes(bytes(range(128, 256)) * 32)  # no valid UTF-8, no newline
    (d / "fake.parquet").write_text("not parquet\n")
    (d / "empty.jsonl").write_text("")
    (d / "huge.jsonl").write_text('{"prompt_id":"p1","lengths":[1000000000000,5]}\n')
    (d / "longnum.jsonl").write_text('{"prompt_id":"p1","lengths":[' + "9" * 5000 + "]}\n")
    (d / "nested.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    (d / "a_dir").mkdir()
    (d / "out").mkdir()
    (d / "out" / "study.json").write_text((d / "ok.jsonl").read_text())  # a trace where study writes its report
    (d / "a_file").write_text("x\n")
    dump = d / "dump"
    dump.mkdir()
    for step in (1, 2):
        (dump / f"{step}.jsonl").write_text("".join(
            json.dumps({"input": f"q{i}", "output": "a b c " * (i + 1), "uid": f"u{i}_0_{j}", "step": step}) + "\n"
            for i in range(6) for j in range(2)))
    (d / "run_a.jsonl").write_text("".join(json.dumps({"step": s, "data": {"timing_s/gen": 10.0, "timing_s/step": 20.0}})
                                           + "\n" for s in (1, 2, 3)))
    (d / "run_b.jsonl").write_text((d / "run_a.jsonl").read_text())
    (d / "again").mkdir()
    (d / "again" / "run_a.jsonl").write_text((d / "run_a.jsonl").read_text())
    for name, gen, step in (("gen_nan", "NaN", 20.0), ("gen_negative", -1.0, 20.0), ("gen_zero", 0.0, 20.0),
                            ("step_inf", 10.0, "Infinity")):
        (d / f"run_{name}.jsonl").write_text((d / "run_a.jsonl").read_text().replace(
            '{"step": 2, "data": {"timing_s/gen": 10.0, "timing_s/step": 20.0}}',
            f'{{"step": 2, "data": {{"timing_s/gen": {gen}, "timing_s/step": {step}}}}}'))
    (d / "cal_words.json").write_text('{"rows": [{"batch": "x", "context": 0, "step_ms": 1}]}')
    (d / "cal_ok.json").write_text('{"rows": [{"batch": 1, "context": 0, "step_ms": 1}, '
                                   '{"batch": 2, "context": 0, "step_ms": 2}]}')
    (d / "cal_huge.json").write_text('{"rows": [{"batch": 1, "context": 0, "step_ms": 1e200}, '
                                     '{"batch": 2, "context": 0, "step_ms": 2e200}]}')
    (d / "cal_nan.json").write_text('{"rows": [{"batch": 1, "context": 0, "step_ms": NaN}, '
                                    '{"batch": 2, "context": 0, "step_ms": 1}]}')


# (case id, argv, a piece of the one error line)
CASES = [
    # input files: missing, a directory, binary / not UTF-8, empty, not Parquet, absurd lengths, bad JSON numbers
    ("trace-missing", "route --trace missing.jsonl -R 2", "missing.jsonl: no such file"),
    ("trace-dir-not-dump", "route --trace a_dir -R 2", "no verl rollout dump"),
    ("trace-binary", "route --trace binary.jsonl -R 2", "binary.jsonl:1: not UTF-8 text"),
    ("trace-empty", "route --trace empty.jsonl -R 2", "no groups found"),
    ("trace-not-parquet", "route --trace fake.parquet -R 2", "fake.parquet: not a readable Parquet file"),
    ("trace-absurd-length", "route --trace huge.jsonl -R 2", "above the 10,000,000-token limit"),
    ("trace-number-too-long", "route --trace longnum.jsonl -R 2", "longnum.jsonl:1: not usable JSON"),
    ("trace-nesting-too-deep", "route --trace nested.jsonl -R 2", "nested.jsonl:1: not usable JSON"),
    ("trace-device", "route --trace /dev/null -R 2", "not a regular file"),
    ("prompts-binary", "simulate --prompts binary.jsonl --out out", "not UTF-8 text"),
    ("prompts-absurd-length", "simulate --prompts huge.jsonl --out out", "10,000,000-token limit"),
    ("plan-binary", "plan --trace binary.jsonl", "not UTF-8 text"),
    ("plan-not-parquet", "plan --trace fake.parquet", "not a readable Parquet file"),
    ("study-workload-binary", "study --workload binary.jsonl --out out", "not UTF-8 text"),
    ("study-workload-absurd", "study --workload huge.jsonl --out out", "10,000,000-token limit"),
    ("dump-binary", "trace binary.jsonl -o t.jsonl", "not UTF-8 text"),
    ("dump-missing", "trace missing -o t.jsonl", "no such file"),
    ("dump-is-a-trace", "trace ok.jsonl -o t.jsonl", "not a verl rollout dump line"),
    ("tokenizer-file", "trace dump -o t.jsonl --tokenizer a_file", "--tokenizer a_file: not a directory"),
    ("compare-binary", "compare run_a.jsonl binary.jsonl", "binary.jsonl:1: not UTF-8 text"),
    ("compare-empty", "compare run_a.jsonl empty.jsonl", "no metrics found"),
    ("compare-dir", "compare run_a.jsonl a_dir", "found no verl logs"),
    ("compare-gen-nan", "compare run_a.jsonl run_gen_nan.jsonl", "run_gen_nan.jsonl: step 2 logs timing_s/gen = nan"),
    ("compare-gen-negative", "compare run_a.jsonl run_gen_negative.jsonl", "step 2 logs timing_s/gen = -1.0, not a "
                                                                          "positive finite time"),
    ("compare-gen-zero", "compare run_gen_zero.jsonl run_a.jsonl",
     "run_gen_zero.jsonl: step 2 logs timing_s/gen = 0.0"),
    ("compare-step-inf", "compare run_a.jsonl run_step_inf.jsonl", "step 2 logs timing_s/step = inf"),
    ("compare-metric-unknown", "compare run_a.jsonl run_b.jsonl --metric timing_s/gne",
     "--metric 'timing_s/gne': no run logs this metric; did you mean timing_s/gen"),
    ("compare-names-twice", "compare run_a.jsonl run_b.jsonl --names x,x", "--names gives 'x' to more than one run"),
    ("compare-same-default-name", "compare run_a.jsonl again/run_a.jsonl", "are both named 'run_a'; tell them apart "
                                                                           "with --names"),
    ("bench-trace-binary", f"bench --trace binary.jsonl -R 2 --url {SERVER}", "not UTF-8 text"),
    ("bench-calibration-binary", f"bench --trace ok.jsonl -R 2 --url {SERVER} --calibration binary.jsonl",
     "binary.jsonl: not UTF-8 text"),
    # output paths: a directory for a file, a file for a directory, an input, inside the dump it reads
    ("simulate-out-file", "simulate --out a_file", "--out a_file is a file; --out is a directory"),
    ("study-out-file", "study --out a_file", "--out a_file is a file; --out is a directory"),
    ("study-out-holds-workload", "study --workload out/study.json --out out", "refusing to overwrite an input"),
    ("trace-o-dir", "trace dump -o a_dir", "-o a_dir is a directory"),
    ("trace-o-is-input", "trace dump/1.jsonl -o dump/1.jsonl", "refusing to overwrite an input"),
    ("trace-o-in-dump-dir", "trace dump -o dump/3.jsonl", "inside the rollout-dump directory"),
    ("trace-o-next-to-step-file", "trace dump/1.jsonl -o dump/3.jsonl", "inside the rollout-dump directory"),
    ("trace-o-under-a-file", "trace dump -o a_file/t.jsonl", "a_file is a file, not a directory"),
    ("compare-plot-dir", "compare run_a.jsonl run_b.jsonl --plot a_dir", "--plot a_dir is a directory"),
    ("compare-plot-format", "compare run_a.jsonl run_b.jsonl --plot cmp.xyz", "unsupported file type '.xyz'"),
    ("bench-out-is-trace", f"bench --trace ok.jsonl -R 2 --url {SERVER} --out ok.jsonl", "refusing to overwrite"),
    ("bench-out-is-calibration", f"bench --trace ok.jsonl -R 2 --url {SERVER} --calibration run_a.jsonl "
                                 "--out run_a.jsonl", "refusing to overwrite an input"),
    ("calibrate-out-dir", f"calibrate --url {SERVER} --out a_dir", "--out a_dir is a directory"),
    # numbers: nan, inf, negative, zero, huge, not a number
    ("time-limit-nan", "route --trace ok.jsonl -R 2 --time-limit nan", "argument --time-limit: expected a finite"),
    ("time-limit-inf", "study --time-limit inf", "argument --time-limit: expected a finite"),
    ("time-limit-negative", "route --trace ok.jsonl -R 2 --time-limit -1", "argument --time-limit"),
    ("replicas-zero", "route --trace ok.jsonl -R 0", "argument --replicas/-R: expected an integer in 1..4,096"),
    ("replicas-huge", "route --trace ok.jsonl -R 1000000000", "expected an integer in 1..4,096"),
    ("replicas-nan", "simulate -R nan", "argument --replicas/-R"),
    ("steps-float", "simulate --steps 2.5", "argument --steps"),
    ("seed-negative", "simulate --seed -1", "argument --seed"),
    ("pool-size-huge", "simulate --pool-size 1000000000000", "argument --pool-size"),
    ("n-zero", "plan --trace ok.jsonl --n 0", "argument --n"),
    ("seeds-zero", "plan --trace ok.jsonl --seeds 0", "argument --seeds"),
    ("instances-zero", "study -N 0", "argument --instances/-N"),
    ("skip-steps-negative", "compare run_a.jsonl run_b.jsonl --skip-steps -1", "argument --skip-steps"),
    ("step-window-words", "compare run_a.jsonl run_b.jsonl --steps x:y", "--steps 'x:y'"),
    ("timeout-nan", f"calibrate --url {SERVER} --timeout nan", "argument --timeout"),
    ("batches-zero", f"calibrate --url {SERVER} --batches 0,4", "argument --batches"),
    ("length-scale-inf", f"bench --trace ok.jsonl -R 2 --url {SERVER} --length-scale inf", "argument --length-scale"),
    ("length-scale-absurd", f"bench --trace ok.jsonl -R 2 --url {SERVER} --length-scale 100000",
     "above the 10,000,000-token limit"),
    ("max-num-seqs-zero", "route --trace ok.jsonl -R 2 --max-num-seqs 0", "argument --max-num-seqs"),
    ("trace-step-negative", "trace dump -o t.jsonl --step -1", "argument --step"),
    # performance-model specs
    ("perf-linear-word", "route --trace ok.jsonl -R 2 --perf-model linear:a=x", "bad linear model 'linear:a=x'"),
    ("perf-linear-nan", "route --trace ok.jsonl -R 2 --perf-model linear:a=nan,c=1", "finite number of seconds"),
    ("perf-linear-inf", "simulate --perf-model linear:a=0.1,c=inf", "finite number of seconds"),
    ("perf-table-unknown", "route --trace ok.jsonl -R 2 --perf-model table:nope", "unknown calibration 'nope'"),
    ("perf-table-model-unknown", "route --trace ok.jsonl -R 2 --perf-model table:h200-dense:gpt", "no rows for model"),
    ("perf-table-dir", "route --trace ok.jsonl -R 2 --perf-model table:a_dir", "a_dir: not a calibration file"),
    ("perf-table-binary", "plan --trace ok.jsonl --perf-model table:binary.jsonl", "not UTF-8 text"),
    ("perf-table-empty", "study --perf-model table:empty.jsonl", "calibration is not valid JSON"),
    ("perf-table-words", "route --trace ok.jsonl -R 2 --perf-model table:cal_words.json", "non-numeric batch"),
    ("perf-table-nan", "route --trace ok.jsonl -R 2 --perf-model table:cal_nan.json", "NaN is not a measurement"),
    ("perf-linear-huge", "route --trace ok.jsonl -R 2 --perf-model linear:a=1e200,c=1", "0 <= a <= 60 s"),
    ("perf-linear-overflow", "route --trace ok.jsonl -R 2 --perf-model linear:a=1e308,c=1e308", "0 <= c <= 60 s"),
    ("perf-linear-tiny", "route --trace ok.jsonl -R 2 --perf-model linear:a=0,c=1e-300", "a + c >= 1e-06 s"),
    ("perf-table-huge", "route --trace ok.jsonl -R 2 --perf-model table:cal_huge.json",
     "row 0 has step_ms = 1e+200, outside a decode step's sane range 0.001..60000 ms"),
    ("perf-empty", "route --trace ok.jsonl -R 2 --perf-model=", "unknown performance model ''"),
    ("perf-kind-unknown", "study --perf-model roofline:h200", "unknown performance model"),
    # usage
    ("required-flag-missing", "route --trace ok.jsonl", "the following arguments are required: --replicas/-R"),
    ("unknown-command", "frobnicate", "invalid choice: 'frobnicate'"),
    ("unknown-flag", "simulate --plot x.png", "unrecognized arguments: --plot x.png"),
    ("simulate-workload-and-prompts", "simulate --workload weak --prompts ok.jsonl --out out",
     "argument --prompts: not allowed with argument --workload"),
    ("spec-schedule-alone", "route --trace ok.jsonl -R 2 --spec-schedule 1-64:3,65-256:1",
     "--spec-schedule (speculating up to k = 3) needs --spec-acceptance"),
    ("bench-q-without-m", f"bench --trace ok.jsonl -R 2 --url {SERVER} --q 2", "give --q and --m together"),
    # a replica's width: a divisor of an 8-GPU node and of the model's KV heads, priced from a bundled model shape
    ("tp-not-a-node-divisor", "simulate --tensor-parallel-size 3 --out out",
     "argument --tensor-parallel-size: invalid choice: 3"),
    ("tp-not-a-kv-head-divisor", "plan --workload real --perf-model table:h200-moe --tensor-parallel-size 8",
     "--tensor-parallel-size 8: tensor_parallel_size must divide qwen3-30b-a3b's 4 KV heads"),
    ("tp-without-a-model-shape", "simulate --engine-defaults none --tensor-parallel-size 2 --out out",
     "--tensor-parallel-size 2 prices a wider replica from a bundled model shape"),
    ("verl-tp-without-a-model-shape", "simulate --engine-defaults none --policies verl,verl-tp --out out",
     "verl-tp prices stock verl at other single widths"),
    # closed-loop: everything checked before a server is contacted
    ("closed-loop-calibration-binary", f"closed-loop --url {SERVER} --calibration binary.jsonl", "not UTF-8 text"),
    ("closed-loop-out-is-calibration", f"closed-loop --url {SERVER} --calibration cal_nan.json --out cal_nan.json",
     "refusing to overwrite an input"),
    ("closed-loop-warmup-all-steps", f"closed-loop --url {SERVER} --calibration cal_ok.json --steps 4 --warmup 4",
     "leaves no step"),
    ("closed-loop-pool-too-small", f"closed-loop --url {SERVER} --calibration cal_ok.json -B 16 --pool-size 20",
     "below 2 x --batch"),
    ("closed-loop-baseline-missing", f"closed-loop --url {SERVER} --calibration cal_ok.json --policies tailsieve",
     "must include verl"),
]


def _snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse usage errors
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("argv, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_inputs_unchanged(tmp_path, monkeypatch, capsys, argv, needle):
    make_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path)
    code, _, err = run_cli(argv.split(), capsys)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert needle in lines[0], lines[0]
    assert lines[0].startswith("tailsieve"), lines[0]
    after = _snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before  # inputs byte-identical
    assert set(after) - set(before) <= {"t.jsonl"} and "t.jsonl" not in after  # and nothing written


# (missing package, argv, a piece of the one error line): each optional package named with its install
MISSING = [
    ("transformers", "trace dump -o t.jsonl --tokenizer a_dir", "counting tokens needs the transformers package"),
    ("wandb", "compare run_a.jsonl wandb://entity/project/run1", "needs the wandb package (not installed); "
                                                                 "install it with: pip install wandb"),
    ("wandb", "compare run_a.jsonl run-1.wandb", "run-1.wandb: reading a W&B run needs the wandb package"),
    ("tensorboard", "compare run_a.jsonl events.out.tfevents.1", "needs the tensorboard package"),
    ("mlflow", "compare run_a.jsonl sqlite:///runs.db#r", "install it with: pip install mlflow-skinny"),
]


@pytest.mark.parametrize("package, argv, needle", MISSING,
                         ids=["transformers", "wandb-synced", "wandb-offline", "tensorboard", "mlflow"])
def test_a_missing_optional_package_is_one_line_naming_it(tmp_path, monkeypatch, capsys, package, argv, needle):
    make_inputs(tmp_path)
    (tmp_path / "run-1.wandb").write_bytes(b"")
    (tmp_path / "events.out.tfevents.1").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, package, None)  # what `import package` meets where it is not installed
    code, _, err = run_cli(argv.split(), capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert needle in err and "internal error" not in err


@pytest.mark.parametrize("package", ["ray", "verl"])
def test_the_rollout_only_run_without_ray_or_verl_is_one_line(package):
    script = (f"import runpy, sys; sys.modules[{package!r}] = None; sys.argv = ['rollout_only', '--steps', '1']; "
              "runpy.run_module('tailsieve_verl.integration.rollout_only', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"needs the {package} package (not installed); install it with: pip install" in proc.stderr


def test_the_installed_command_prints_one_line_for_a_binary_trace(tmp_path):
    (tmp_path / "b.jsonl").write_bytes(os.urandom(4096).replace(b"\n", b"\xff"))
    proc = subprocess.run([sys.executable, "-c", "import sys; from tailsieve_verl.cli import main; sys.exit(main())",
                           "route", "--trace", str(tmp_path / "b.jsonl"), "-R", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "not UTF-8 text" in proc.stderr


def test_an_unexpected_failure_is_one_line_exit_1(tmp_path, monkeypatch, capsys):
    from tailsieve_verl.cli import plan as plan_cli

    def broken(args):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(plan_cli, "run", broken)
    monkeypatch.delenv("TAILSIEVE_DEBUG", raising=False)
    parser_main = main  # register() binds func=run at build time, so patch before building
    code, _, err = run_cli(["plan", "--trace", "x"], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "internal error: RuntimeError: boom; second line" in err and "TAILSIEVE_DEBUG=1" in err
    monkeypatch.setenv("TAILSIEVE_DEBUG", "1")
    with pytest.raises(RuntimeError):
        parser_main(["plan", "--trace", "x"])
