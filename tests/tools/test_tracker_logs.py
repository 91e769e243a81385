"""`tailsieve compare` on runs that verl 0.9.1's own Tracking wrote to Weights & Biases (offline) and
MLflow (sqlite and file stores), next to the same runs' file-logger JSONL; bad tracker input is one
error line with exit status 2."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from tailsieve_verl.cli import main
from tailsieve_verl.tools.run_logs import GEN_TIME, STEP_TIME, CompareError, compare_runs, read_run
from tailsieve_verl.tools.tracker_logs import parse_wandb_url, read_wandb_online

STEPS = 40
VALIDATION = "val-core/tailsieve_math/reward/mean@1"
RNG = np.random.default_rng(11)
# Baseline (stock verl) and a run 10 % faster in generation, both with 8 % per-step noise.
GEN = {"verl": 100 * (1 + 0.08 * RNG.standard_normal(STEPS)),
       "tailsieve": 100 / 1.10 * (1 + 0.08 * RNG.standard_normal(STEPS))}


def step_metrics(name: str, i: int) -> dict:
    metrics = {GEN_TIME: np.float64(GEN[name][i]), STEP_TIME: float(GEN[name][i] + 30.0),
               "critic/score/mean": 0.5, "response_length/mean": 800.0 + i}
    if name == "tailsieve":
        metrics["tailsieve/q"] = 2.0
    return metrics


def log_with_verl(backends: list[str], env: dict, config: dict | None = None, names=tuple(GEN)) -> None:
    """Both runs through verl's Tracking with ``backends``, under the environment ``env``."""
    from verl.utils.tracking import Tracking

    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        for name in names:
            mp.setenv("VERL_FILE_LOGGER_PATH", env.get("FILE_DIR", "/nonexistent") + f"/{name}.jsonl")
            tracker = Tracking("tailsieve", name, default_backend=backends, config=config)
            tracker.log({VALIDATION: 0.25}, step=0)
            for i in range(STEPS):
                tracker.log(step_metrics(name, i), step=i + 1)
            tracker.log({VALIDATION: 0.5 if name == "verl" else 0.375}, step=STEPS)
            tracker.finish()


def wandb_env(directory: Path) -> dict:
    return {"WANDB_MODE": "offline", "WANDB_DIR": str(directory), "WANDB_SILENT": "true",
            "WANDB_CONSOLE": "off", "FILE_DIR": str(directory)}


@pytest.fixture(scope="module")
def wandb_logs(tmp_path_factory) -> Path:
    """verl's Tracking with the wandb (offline) and file backends; the config, as verl passes its
    whole trainer config, is large enough that the run record spans several 32 KiB blocks."""
    root = tmp_path_factory.mktemp("wandb_logs")
    log_with_verl(["wandb", "file"], wandb_env(root), config={"trainer": {"note": "x" * 100_000}})
    return root


def offline_runs(root: Path) -> dict[str, Path]:
    folders = [p for p in sorted((root / "wandb").glob("offline-run-*")) if p.is_dir()]
    return {read_run(p).name: p for p in folders}


def test_wandb_offline_run_reads_what_the_file_logger_read(wandb_logs):
    runs = offline_runs(wandb_logs)
    assert set(runs) == set(GEN)  # named by verl's experiment_name
    wandb_file = next(runs["verl"].glob("run-*.wandb"))
    assert wandb_file.stat().st_size > 3 * 32768  # records crossed block boundaries
    for name, folder in runs.items():
        from_wandb, from_file = read_run(folder), read_run(wandb_logs / f"{name}.jsonl")
        assert from_wandb.fmt == "wandb"
        assert from_wandb.series == from_file.series  # every value, every step, the '@' key included
        assert read_run(wandb_file if name == "verl" else folder).series == from_file.series
    assert sorted(read_run(runs["verl"]).series[GEN_TIME]) == list(range(1, STEPS + 1))


def test_a_wandb_run_still_being_written_reads_up_to_its_last_whole_record(wandb_logs, tmp_path):
    full = next(offline_runs(wandb_logs)["verl"].glob("run-*.wandb")).read_bytes()
    folder = tmp_path / "offline-run-open"
    folder.mkdir()
    (folder / "run-open.wandb").write_bytes(full[:len(full) - 3001])  # the last steps' records cut off
    steps = sorted(read_run(folder).series[GEN_TIME])
    assert steps == list(range(1, len(steps) + 1)) and STEPS // 2 < len(steps) < STEPS
    with pytest.raises(CompareError, match="several W&B runs"):
        read_run(wandb_logs / "wandb")


def test_compare_reads_wandb_against_a_file_log(wandb_logs, capsys):
    runs = offline_runs(wandb_logs)
    argv = ["compare", str(wandb_logs / "verl.jsonl"), str(runs["tailsieve"])]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    fast = out["runs"][1]
    want = GEN["verl"].mean() / GEN["tailsieve"].mean()
    assert fast["fmt"] == "wandb" and fast["gen_speedup"] == pytest.approx(want)
    interval = fast["gen_interval"]
    assert interval["ratio"] == pytest.approx(want) and interval["steps"] == STEPS
    assert interval["low"] < want < interval["high"]
    assert interval["verdict"] == ("faster" if interval["low"] > 1 else "not resolved")
    assert out["runs"][0]["gen_interval"] is None  # the baseline against itself
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "speedup vs verl" in table and f"[{interval['low']:.3f}, {interval['high']:.3f}]" in table
    assert "val tailsieve_math/reward/mean@1" in table


def log_to_mlflow(uri: str, extra_env: dict | None = None) -> None:
    log_with_verl(["mlflow"], {"MLFLOW_TRACKING_URI": uri, **(extra_env or {})})


@pytest.fixture(scope="module")
def mlflow_sqlite(tmp_path_factory, wandb_logs) -> tuple[Path, Path]:
    """Both runs in one sqlite store (verl's default kind of MLflow store); returns it and the JSONL dir."""
    db = tmp_path_factory.mktemp("mlflow") / "mlruns.db"
    log_to_mlflow(f"sqlite:///{db}")
    return db, wandb_logs


def test_mlflow_sqlite_run_by_name_experiment_and_id(mlflow_sqlite):
    db, logs = mlflow_sqlite
    by_path = read_run(f"{db}#tailsieve/verl")
    assert by_path.fmt == "mlflow" and by_path.name == "verl"
    file_logged = read_run(logs / "verl.jsonl").series
    assert by_path.series == file_logged  # 'mean_at_1', as verl renamed it for MLflow, reads as 'mean@1'
    from mlflow.tracking import MlflowClient

    run_id = next(r.info.run_id for r in MlflowClient(f"sqlite:///{db}").search_runs(["1"])
                  if r.info.run_name == "tailsieve")
    assert read_run(f"sqlite:///{db}#{run_id}").series == read_run(f"sqlite:///{db}#tailsieve").series
    with pytest.raises(CompareError, match="run 'nope' not found; runs: tailsieve/"):
        read_run(f"sqlite:///{db}#nope")
    with pytest.raises(CompareError, match="a run .* matches 2 runs"):
        read_run(db)
    steps, (_, fast) = compare_runs([read_run(f"{db}#verl"), read_run(f"{db}#tailsieve")])
    assert fast.gen_interval.ratio == pytest.approx(GEN["verl"].mean() / GEN["tailsieve"].mean())


def test_mlflow_file_store_run_folder_and_uri(tmp_path, wandb_logs):
    """MLflow 3 keeps its file store behind MLFLOW_ALLOW_FILE_STORE; runs written there still read."""
    mlruns = tmp_path / "mlruns"
    log_to_mlflow(f"file:{mlruns}", {"MLFLOW_ALLOW_FILE_STORE": "true"})
    folders = [p for p in mlruns.glob("*/*") if (p / "meta.yaml").is_file()]
    assert len(folders) == 2
    for folder in folders:
        run = read_run(folder)
        assert run.series == read_run(wandb_logs / f"{run.name}.jsonl").series
    assert read_run(f"file:{mlruns}#tailsieve/verl").series == read_run(f"{mlruns}#verl").series
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ


def test_wandb_urls_parse_and_fail_clearly_without_an_api_key(tmp_path, monkeypatch):
    assert parse_wandb_url("wandb://ent/proj/abc123") == "ent/proj/abc123"
    assert parse_wandb_url("wandb://ent/proj/runs/abc123/") == "ent/proj/abc123"
    for bad in ("wandb://ent/proj", "wandb://ent//abc", "wandb://a/b/c/d"):
        with pytest.raises(CompareError, match="expected wandb://ENTITY/PROJECT/RUN_ID"):
            parse_wandb_url(bad)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with pytest.raises(CompareError, match=r"wandb://ent/proj/abc123: cannot read the W&B run \(No API key"):
        read_wandb_online("wandb://ent/proj/abc123")


def _snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


@pytest.fixture
def bad_inputs(tmp_path, wandb_logs, mlflow_sqlite) -> Path:
    runs = offline_runs(wandb_logs)
    good = runs["verl"]
    garbage = tmp_path / "offline-run-garbage"
    garbage.mkdir()
    (garbage / "run-garbage.wandb").write_bytes(b"not a wandb log\n" * 10)
    corrupt = tmp_path / "offline-run-corrupt"
    corrupt.mkdir()
    data = bytearray(next(good.glob("run-*.wandb")).read_bytes())
    data[40000] ^= 0xFF
    (corrupt / "run-corrupt.wandb").write_bytes(bytes(data))
    no_gen = tmp_path / "nogen.jsonl"
    no_gen.write_text('{"step": 1, "data": {"critic/score/mean": 0.5}}\n')
    (tmp_path / "not_a_db.db").write_text("plain text\n")
    (tmp_path / "good").symlink_to(good)
    (tmp_path / "mlruns.db").symlink_to(mlflow_sqlite[0])
    return tmp_path


@pytest.mark.parametrize("argv, needle", [
    ("compare good offline-run-garbage", "not a W&B transaction log"),
    ("compare good offline-run-corrupt", "corrupt W&B record at byte"),
    ("compare good nogen.jsonl", "no 'timing_s/gen' metric"),
    ("compare good mlruns.db#no-such-run", "run 'no-such-run' not found"),
    ("compare good sqlite:///missing.db#verl", "missing.db: no such MLflow database file"),
    ("compare good not_a_db.db#verl", "cannot read the MLflow run"),
    ("compare good wandb://ent/proj", "expected wandb://ENTITY/PROJECT/RUN_ID"),
    ("compare good good --confidence 1.5", "argument --confidence: expected a number > 0 and <= 0.9999"),
], ids=["wandb-garbage", "wandb-corrupt", "missing-metric", "mlflow-run-not-found", "mlflow-db-missing",
        "mlflow-not-a-db", "wandb-url", "confidence"])
def test_bad_tracker_input_is_one_line_exit_2(bad_inputs, monkeypatch, capsys, argv, needle):
    monkeypatch.chdir(bad_inputs)
    before = _snapshot(bad_inputs)
    try:
        code = main(argv.split())
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    assert _snapshot(bad_inputs) == before  # nothing written, nothing changed
