"""integration.checkpoint: tailsieve.pt written atomically, versioned, and checked on resume
(the real file code and a real core cycle; the trainer path is in test_checkpoint_resume.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from verl.utils import tensordict_utils as tu

from tailsieve_verl.core.tailsieve.controller import AbortedGroup, ControllerConfig, GroupRecord
from tailsieve_verl.core.tailsieve.cycle import TailSieveCycle
from tailsieve_verl.core.engine.perf import LinearPerf
from tailsieve_verl.integration import checkpoint
from tailsieve_verl.integration.checkpoint import (STATE_FILE, CheckpointMismatchError, RunShape, checkpoint_state,
                                                    restore_for_resume, save_state)
from tailsieve_verl.integration.config import TailSieveConfigError, parse_tailsieve_section

B, R = 4, 4
SHAPE = RunShape(B, R, 2.0)
CONFIG = ControllerConfig(fixed_tail_replicas=1, q_init=1, inner_loop=False, candidate_factor=2.0)


def _rows(names: list[str]) -> dict:
    batch = tu.get_tensordict({"raw_prompt": np.array([[{"role": "user", "content": n}] for n in names], dtype=object),
                               "uid": np.array(names, dtype=object)})
    return {n: batch[i:i + 1] for i, n in enumerate(names)}


def _state_after_one_step() -> tuple[dict, list[str]]:
    """tailsieve.pt content after one real cycle step: two prompts carried."""
    cycle = TailSieveCycle(B, R, CONFIG, LinearPerf(0.01, 0.0001))
    fresh = [f"p{i}" for i in range(cycle.n_fresh())]
    plan, m = cycle.plan(fresh, R)
    done = list(plan.bulk_fresh_ids[:plan.bulk_quota])
    aborted = [p for p in plan.bulk_fresh_ids if p not in done]
    cycle.finish(plan, done, {p: 10.0 for p in aborted}, tail=[], bulk=[(p, GroupRecord((5,), 1.0)) for p in done],
                 m=m, cutoff_s=1.0, prompt_len=0.0, policy_version=1,
                 aborted={p: AbortedGroup((10,), (True,)) for p in aborted})
    carried = list(cycle.selector.carried)
    assert len(carried) == 2
    return checkpoint_state(cycle.state_dict(), _rows(carried), SHAPE), carried


def _write_folder(tmp_path, state: dict, step: int = 3):
    folder = tmp_path / f"global_step_{step}"
    save_state(str(folder), state)
    return folder


def test_a_crash_mid_write_leaves_the_previous_complete_file(tmp_path, monkeypatch):
    state, carried = _state_after_one_step()
    folder = _write_folder(tmp_path, state)
    before = (folder / STATE_FILE).read_bytes()

    def dies_half_way(obj, out):  # the writer dies after part of the new file reached the disk
        out.write(b"PK\x03\x04 half a new checkpoint")
        out.flush()
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(OSError, match="No space left"):
        save_state(str(folder), dict(state, selector=dict(state["selector"], carried=[])))
    monkeypatch.undo()
    assert (folder / STATE_FILE).read_bytes() == before
    assert os.listdir(folder) == [STATE_FILE]  # no partial file left behind
    restore = restore_for_resume(str(folder), SHAPE, "stop")
    assert restore.cycle_state["selector"]["carried"] == carried and set(restore.carried_rows) == set(carried)


def test_a_kill_mid_write_leaves_the_previous_complete_file(tmp_path):
    """SIGKILL while the new file is half written (a writer that stalls after its first bytes)."""
    state, carried = _state_after_one_step()
    folder = _write_folder(tmp_path, state)
    before = (folder / STATE_FILE).read_bytes()
    script = (
        "import sys, time\n"
        "from tailsieve_verl.integration.checkpoint import write_atomically\n"
        "def stall(out):\n"
        "    out.write(b'x' * 4096); out.flush(); print('written', flush=True); time.sleep(60)\n"
        f"write_atomically({str(folder / STATE_FILE)!r}, stall)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert child.stdout.readline().strip() == "written"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert (folder / f".{STATE_FILE}.partial").stat().st_size == 4096  # killed mid-write, beside the real file
    assert (folder / STATE_FILE).read_bytes() == before
    restore = restore_for_resume(str(folder), SHAPE, "stop")
    assert restore.cycle_state["selector"]["carried"] == carried


def test_a_truncated_file_stops_with_one_line_and_drop_carried_goes_on(tmp_path, caplog):
    state, _ = _state_after_one_step()
    _write_folder(tmp_path, state, step=2)  # an earlier checkpoint the message can point to
    folder = _write_folder(tmp_path, state, step=3)
    data = (folder / STATE_FILE).read_bytes()
    (folder / STATE_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointMismatchError) as error:
        restore_for_resume(str(folder), SHAPE, "stop")
    line = str(error.value)
    assert "\n" not in line and "cannot be read" in line and "truncated or corrupt" in line
    assert f"trainer.resume_from_path={tmp_path / 'global_step_2'}" in line
    assert "+tailsieve.on_checkpoint_mismatch=drop_carried" in line
    with pytest.raises(CheckpointMismatchError, match="cannot be read"):
        restore_for_resume(str(folder), SHAPE, "keep_carried")  # nothing to keep: the rows are in the lost part
    restore = restore_for_resume(str(folder), SHAPE, "drop_carried")
    assert restore.cycle_state["selector"]["carried"] == [] and restore.carried_rows == {}
    assert "up to 6 prompts of this epoch are not regenerated" in caplog.text


@pytest.mark.parametrize("field,value,named,fix", [
    ("batch_size", 8, "data.train_batch_size 4 (this run 8)", "data.train_batch_size=4"),
    ("n_replicas", 2, "rollout replicas 4 (this run 2)", "a layout of 4 rollout replicas"),
    ("candidate_factor", 1.5, "tailsieve.controller.candidate_factor 2.0 (this run 1.5)",
     "+tailsieve.controller.candidate_factor=2"),
])
def test_another_run_shape_stops_naming_the_difference_and_the_way_on(tmp_path, field, value, named, fix):
    state, _ = _state_after_one_step()
    folder = _write_folder(tmp_path, state)
    shape = RunShape(**{**vars(SHAPE), field: value})
    with pytest.raises(CheckpointMismatchError) as error:
        restore_for_resume(str(folder), shape, "stop")
    line = str(error.value)
    assert "\n" not in line and named in line and f"Resume with {fix}" in line
    assert "=keep_carried (its 2 carried prompts are trained once in the next step)" in line
    assert "controller fresh" not in line


def test_a_plugin_upgrade_alone_resumes_everything(tmp_path):
    """The plugin version is a note of who wrote the file; the format version decides readability."""
    state, carried = _state_after_one_step()
    folder = _write_folder(tmp_path, dict(state, run=dict(state["run"], plugin_version="0.0.1")))
    restore = restore_for_resume(str(folder), SHAPE, "stop")
    assert restore.cycle_state["controller"] == state["controller"] and set(restore.carried_rows) == set(carried)
    assert restore.cycle_state["record_plan"] == state["record_plan"]  # the record-planned steps' state and guard
    older = {k: v for k, v in state.items() if k != "record_plan"}  # written before record-planned steps
    restore = restore_for_resume(str(_write_folder(tmp_path, older, step=4)), SHAPE, "stop")
    cycle = TailSieveCycle(B, R, CONFIG, LinearPerf(0.01, 0.0001))
    cycle.load_state_dict(restore.cycle_state)
    assert restore.cycle_state["record_plan"] is None and not cycle.planning and not cycle.guard.off


def test_a_changed_pinned_split_starts_there_and_keeps_the_carried_prompts(tmp_path, caplog):
    """CONFIG pins (q0, m) = (1, 1), inner loop off; a resume pinning another split (or the same split
    with the inner loop on) starts at its own split; the same pin, or an adaptive resume, keeps the
    learned state. A header without the split (written before it named it) reads it from the controller."""
    state, carried = _state_after_one_step()
    saved_split = checkpoint.pinned_split(CONFIG, R, B)
    assert saved_split == (1, 1, False)
    old_header = dict(state, run={k: v for k, v in state["run"].items() if k != "split"})
    folder = _write_folder(tmp_path, old_header)
    for split, kept in [((1, 1, False), True), (None, True), ((2, 2, False), False), ((1, 1, True), False)]:
        restore = restore_for_resume(str(folder), RunShape(B, R, 2.0, split=split), "stop")
        assert (restore.cycle_state["controller"] is not None) == kept, split
        assert set(restore.carried_rows) == set(carried)
    assert "at the split this run pins, (q0, tail_replicas) = (2, 2) with the inner loop off; the checkpoint's " \
           "controller ran the pinned split (1, 1)" in caplog.text
    cycle = TailSieveCycle(B, R, ControllerConfig(fixed_tail_replicas=2, q_init=2, inner_loop=False), LinearPerf(0.01, 0.0001))
    cycle.load_state_dict(restore_for_resume(str(folder), RunShape(B, R, 2.0, split=(2, 2, False)), "stop").cycle_state)
    assert (cycle.decision.q, cycle.decision.m) == (2, 2)
    plan, m = cycle.plan([f"f{i}" for i in range(cycle.n_fresh())], R)
    assert m == 2 and sorted(plan.tail_ids + plan.requeued_ids) == sorted(carried)  # each regenerated once


def test_keep_carried_regenerates_the_carried_prompts_under_a_new_batch_size(tmp_path, caplog):
    state, carried = _state_after_one_step()
    folder = _write_folder(tmp_path, state)
    restore = restore_for_resume(str(folder), RunShape(8, R, 2.0), "keep_carried")
    assert set(restore.carried_rows) == set(carried)
    assert restore.cycle_state["controller"] is None  # its learned state is shaped by batch 4
    assert restore.cycle_state["prompt_record"] == state["prompt_record"]
    assert "record_plan" not in restore.cycle_state  # the record-planned steps' guard starts afresh
    cycle = TailSieveCycle(8, R, CONFIG, LinearPerf(0.01, 0.0001))
    cycle.load_state_dict(restore.cycle_state)  # the queue fits the new batch
    plan, _ = cycle.plan([f"f{i}" for i in range(cycle.n_fresh())], R)
    assert sorted(plan.tail_ids + plan.requeued_ids) == sorted(carried)  # each regenerated once, next step
    assert "its 2 carried prompts are regenerated in the next step" in caplog.text

    with pytest.raises(CheckpointMismatchError, match="carries 2 prompts, more than one step of data.train_batch_size=2"):
        restore_for_resume(str(folder), RunShape(2, R, 2.0), "keep_carried")


def test_drop_carried_names_the_prompts_it_does_not_regenerate(tmp_path, caplog):
    state, carried = _state_after_one_step()
    folder = _write_folder(tmp_path, state)
    restore = restore_for_resume(str(folder), RunShape(B, 2, 2.0), "drop_carried")
    assert restore.cycle_state["selector"]["carried"] == [] and restore.carried_rows == {}
    assert restore.cycle_state["prompt_record"] == state["prompt_record"] and "record_plan" not in restore.cycle_state
    assert "its 2 carried prompts are not regenerated (prompt keys " in caplog.text


def test_the_unversioned_format_and_an_unknown_version_stop_with_one_line(tmp_path):
    state, carried = _state_after_one_step()
    old = {k: v for k, v in state.items() if k not in ("format_version", "run")}  # the layout before versions
    folder = _write_folder(tmp_path, old)
    with pytest.raises(CheckpointMismatchError) as error:
        restore_for_resume(str(folder), SHAPE, "stop")
    assert str(error.value).endswith("another run shape: format version 0 (this run 1). Set "
                                     "+tailsieve.on_checkpoint_mismatch=keep_carried (its 2 carried prompts are trained "
                                     "once in the next step) or =drop_carried (they are not regenerated)")
    restore = restore_for_resume(str(folder), SHAPE, "keep_carried")  # its rows are readable: kept
    assert set(restore.carried_rows) == set(carried)

    newer = _write_folder(tmp_path, dict(state, format_version=7, run=dict(state["run"], plugin_version="3.0")), step=4)
    with pytest.raises(CheckpointMismatchError) as error:
        restore_for_resume(str(newer), SHAPE, "stop")
    line = str(error.value)
    assert "format version 7 (written by tailsieve-verl 3.0: resume with that version)" in line and "\n" not in line
    assert "drop_carried" in line


def test_a_file_with_carried_prompts_but_not_their_rows_is_unusable(tmp_path):
    state, carried = _state_after_one_step()
    folder = _write_folder(tmp_path, dict(state, carried_rows={}))
    with pytest.raises(CheckpointMismatchError, match="lacks the prompt rows of carried groups"):
        restore_for_resume(str(folder), SHAPE, "stop")


def test_the_policies_are_validated_with_the_other_settings():
    assert parse_tailsieve_section({"on_checkpoint_mismatch": "keep_carried"}).on_checkpoint_mismatch == "keep_carried"
    with pytest.raises(TailSieveConfigError, match="tailsieve.on_checkpoint_mismatch must be one of stop, keep_carried"):
        parse_tailsieve_section({"on_checkpoint_mismatch": "fresh"})
    with pytest.raises(TailSieveConfigError, match="tailsieve.on_refused_request must be one of stop, skip"):
        parse_tailsieve_section({"on_refused_request": "ignore"})
    with pytest.raises(TailSieveConfigError, match="tailsieve.sim.max_prompt_tokens must be an integer >= 1"):
        parse_tailsieve_section({"sim": {"max_prompt_tokens": 0}})


def test_a_checkpoint_without_tailsieve_state_restores_nothing(tmp_path):
    (tmp_path / "global_step_1").mkdir()
    assert restore_for_resume(str(tmp_path / "global_step_1"), SHAPE, "stop") is None
    assert restore_for_resume(None, SHAPE, "stop") is None
    assert checkpoint.FORMAT_VERSION == 1
