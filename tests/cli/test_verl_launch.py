"""A real `python -m verl.trainer.main_ppo` launch stops on a bad TailSieve override with one line
of ours: an unparsable override is named with its quoting fix, and TailSieve's settings are checked
before verl's own validation prints that every check passed."""

from __future__ import annotations

import subprocess
import sys
import tempfile


def launch(*overrides: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as cwd:  # Hydra writes outputs/<date>/ under the working directory
        return subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "trainer.v1.trainer_mode=tailsieve",
                               *overrides], capture_output=True, text=True, timeout=300, cwd=cwd)


def _tailsieve_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("tailsieve")]


def test_an_unquoted_spec_names_the_override_and_the_quoting():
    from tailsieve_verl.integration.plugin import bad_tailsieve_override

    line = bad_tailsieve_override(["trainer.v1.trainer_mode=tailsieve", "+tailsieve.perf_model=linear:a=x"])
    assert line.startswith("tailsieve: error: Hydra cannot parse the override '+tailsieve.perf_model=linear:a=x'")
    assert line.endswith("\"+tailsieve.perf_model='linear:a=x'\"") and "\n" not in line
    assert bad_tailsieve_override(["+tailsieve.perf_model='linear:a=0.1,c=0.2'", "tailsieve.q0=4", "x=y"]) is None


def test_tailsieve_settings_are_checked_before_verl_says_all_checks_passed():
    proc = launch("+tailsieve.q0=1", "+tailsieve.tail_replicas=2", "trainer.n_gpus_per_node=4",
                  "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=vllm")
    assert proc.returncode == 2
    assert "All configuration checks passed" not in proc.stdout + proc.stderr
    lines = _tailsieve_lines(proc)
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "tailsieve.q0=1 is below tailsieve.tail_replicas=2" in lines[0] and "set tailsieve.q0>=2" in lines[0]


def test_a_tailsieve_setting_on_a_stock_run_stops_the_launch_naming_it():
    """Issue 31: a launch used to check TailSieve's settings only in trainer_mode=tailsieve, so a forgotten
    trainer mode gave a plain stock run without a word (the dry run already refused it)."""
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "trainer.v1.trainer_mode=sync",
                               "+tailsieve.q0=8", "+tailsieve.stop=['<END>']"],
                              capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 2 and "All configuration checks passed" not in proc.stdout + proc.stderr
    lines = _tailsieve_lines(proc)
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith("tailsieve: error: tailsieve.q0 would be ignored: trainer.v1.trainer_mode is 'sync'")
