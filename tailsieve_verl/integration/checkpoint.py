"""``tailsieve.pt``: TailSieve's carried queue and learned state, saved next to verl's checkpoint.

The file holds the prompt rows of the carried groups and of the prompts drawn from verl's loader but
not yet dispatched (both fetched from the dataset but not yet trained: verl's dataloader state has
moved past them), the selector's queue, the controller's learned (q, m) and the per-prompt length
record. Three promises:

* **Atomic.** It is written to a temporary file in the same folder, flushed to disk and renamed
  over the old one: a kill mid-save leaves the previous complete file (or none), never half a file.
* **Versioned and checked before anything launches.** The file carries a format version and the run
  shape its state depends on (batch size, rollout replicas, ``candidate_factor``), with the plugin
  version that wrote it and the split the run pinned, if any. The trainer reads it in ``init()``,
  before verl starts a worker or a replica, and a file it cannot use as is stops the run with one
  line saying what differs and how to go on. A plugin upgrade alone resumes: only the format version
  says whether a file can be read.
* **A pinned split is the one the resumed run uses.** A run resumed with ``mode=fixed`` (or per-pool
  engine settings) whose pinned split — (q0, tail_replicas) and the inner loop — differs from the
  checkpoint's starts at that split: the learned (q, m) of another split is not restored (the carried
  prompts, their scores and the per-prompt record are). An adaptive resume continues from the
  learned (q, m), whichever run wrote it: ``q0`` / ``tail_replicas`` seed only a fresh start.
* **No prompt silently lost or trained twice.** ``tailsieve.on_checkpoint_mismatch`` decides what a
  mismatch does:

  - ``stop`` (default): stop, naming the difference and the settings that resume as saved;
  - ``keep_carried``: the carried prompts (their rows are in the file) are regenerated in the next
    step as carried candidates and trained exactly once, whatever the new batch size, replicas or
    dataset — possible while they fit in one step (fewer than ``data.train_batch_size``). The
    per-prompt record is kept; the controller's learned state only when batch size, replicas and
    ``candidate_factor`` are unchanged (else it restarts from ``q0`` / ``tail_replicas``); the
    record-planned steps' state and guard (``core.tailsieve.cycle``) start afresh;
  - ``drop_carried``: the carried prompts are not regenerated (a warning counts and names them:
    they come back in the next epoch); the only way on when the file is unreadable.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, BinaryIO, Callable, Mapping

from tailsieve_verl import __version__
from tailsieve_verl.core.tailsieve.controller import ControllerConfig, initial_split
from tailsieve_verl.core.errors import TailSieveError
from tailsieve_verl.integration.prompts import prompt_key

logger = logging.getLogger(__name__)

STATE_FILE = "tailsieve.pt"
FORMAT_VERSION = 1  # 0: the unversioned layout of tailsieve-verl before checkpoints were versioned
_POLICY_KEY = "+tailsieve.on_checkpoint_mismatch"


class CheckpointMismatchError(TailSieveError):
    """A ``tailsieve.pt`` the resuming run cannot use as is (unreadable, another format or run shape)."""


def pinned_split(config: ControllerConfig, n_replicas: int, batch_size: int) -> tuple[int, int, bool] | None:
    """(q0, m, inner loop) of a controller that pins its split (``fixed_tail_replicas``), else None."""
    if config.fixed_tail_replicas is None:
        return None
    return (*initial_split(config, n_replicas, batch_size), bool(config.inner_loop))


@dataclass(frozen=True)
class RunShape:
    """What the saved state depends on; a resume under another shape needs a decision. The plugin
    version (which release wrote the file) and the pinned split never stop a resume."""

    batch_size: int
    n_replicas: int
    candidate_factor: float
    plugin_version: str = __version__
    split: tuple[int, int, bool] | None = None  # the pinned split (:func:`pinned_split`); None: the controller's own

    _SETTING = {"batch_size": "data.train_batch_size", "n_replicas": "rollout replicas",
                "candidate_factor": "tailsieve.controller.candidate_factor"}

    @classmethod
    def of(cls, config: Any, settings: Any) -> "RunShape":
        from tailsieve_verl.integration.config import rollout_replica_count

        batch_size, n_replicas = int(config.data.train_batch_size), rollout_replica_count(config)
        controller = settings.controller_config()
        return cls(batch_size, n_replicas, float(controller.candidate_factor),
                   split=pinned_split(controller, n_replicas, batch_size))

    def differences(self, saved: "RunShape") -> list[str]:
        return [f"{setting} {getattr(saved, name)} (this run {getattr(self, name)})"
                for name, setting in self._SETTING.items() if getattr(saved, name) != getattr(self, name)]

    def same_controller(self, saved: "RunShape") -> bool:
        """The controller's learned state fits: same batch, replicas and candidate factor, and, where
        this run pins its split, the same pinned split (else it starts at its own)."""
        return (saved.batch_size, saved.n_replicas, saved.candidate_factor) == (
            self.batch_size, self.n_replicas, self.candidate_factor) and self.split in (None, saved.split)

    def how_to_resume_as_saved(self, saved: "RunShape") -> str:
        steps = []
        if saved.batch_size != self.batch_size:
            steps.append(f"data.train_batch_size={saved.batch_size}")
        if saved.n_replicas != self.n_replicas:
            steps.append(f"a layout of {saved.n_replicas} rollout replicas (trainer.n_gpus_per_node x trainer.nnodes"
                         f" / rollout tp x dp x pp)")
        if saved.candidate_factor != self.candidate_factor:
            steps.append(f"+tailsieve.controller.candidate_factor={saved.candidate_factor:g}")
        return " and ".join(steps)


@dataclass(frozen=True)
class Restore:
    """What a resume puts back: the cycle's state (``TailSieveCycle.load_state_dict``) and the rows
    of the carried prompts."""

    cycle_state: dict
    carried_rows: dict
    drawn_rows: tuple = ()  # the loader's next prompts, in order: they go first whatever else differs


# ---- writing -----------------------------------------------------------------------------------
def write_atomically(path: str, write: Callable[[BinaryIO], None]) -> None:
    """``write`` into a temporary file next to ``path``, fsync it, rename it over ``path``, fsync the
    folder: readers (and a resume after a kill at any point) see the old file or the new one."""
    folder = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(folder, f".{os.path.basename(path)}.partial")  # one writer: the trainer
    try:
        with open(temporary, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)


def checkpoint_state(cycle_state: Mapping, carried_rows: Mapping, shape: RunShape, drawn_rows=()) -> dict:
    """The content of ``tailsieve.pt``: the cycle's state dict, the carried and drawn rows, a header."""
    return {"format_version": FORMAT_VERSION, "run": asdict(shape), **cycle_state, "carried_rows": dict(carried_rows),
            "drawn_rows": list(drawn_rows)}


def save_state(folder: str, state: Mapping) -> str:
    import torch

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE)
    write_atomically(path, lambda out: torch.save(dict(state), out))
    return path


# ---- reading and checking ----------------------------------------------------------------------
def resume_folder(trainer_config: Any) -> str | None:
    """The ``global_step_N`` folder verl's ``_load_checkpoint`` will resume from (its own rule), or None."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    mode = trainer_config.resume_mode
    if mode == "auto":
        return find_latest_ckpt_path(os.path.abspath(trainer_config.default_local_dir))
    if mode == "resume_path" and trainer_config.resume_from_path:
        return os.path.abspath(trainer_config.resume_from_path)
    return None


def read_state_file(path: str) -> dict:
    """The raw content of ``tailsieve.pt``, or one line saying it cannot be read."""
    import torch

    try:
        state = torch.load(path, weights_only=False)
    except Exception as exc:  # truncated zip, unpickling error, ...: every reader failure means "unreadable"
        raise CheckpointMismatchError(f"{path} cannot be read ({type(exc).__name__}: {str(exc)[:120]}; a truncated or "
                                      f"corrupt file)") from None
    if not isinstance(state, dict):
        raise CheckpointMismatchError(f"{path} holds a {type(state).__name__}, not TailSieve state")
    return state


def _saved_split(controller: Mapping | None) -> tuple[int, int, bool] | None:
    """The split a saved controller pinned, from its own config (for files whose header does not name it)."""
    if not controller:
        return None
    known = {f.name for f in fields(ControllerConfig)}
    config = ControllerConfig(**{k: v for k, v in controller["config"].items() if k in known})
    return pinned_split(config, int(controller["n_replicas"]), int(controller["batch_size"]))


def _saved_shape(state: Mapping, path: str) -> tuple[int, RunShape]:
    """Format version and run shape of a file's content (format 0 carried no header: read from its parts;
    a format-1 header written before it named the pinned split: read from the controller's config)."""
    version = state.get("format_version", 0 if "selector" in state else None)
    if version == FORMAT_VERSION:
        run = dict(state["run"])
        if "split" not in run:
            run["split"] = _saved_split(state.get("controller"))
        return version, RunShape(**run)
    if version == 0:
        controller = state.get("controller") or {}
        return 0, RunShape(int(state["selector"]["batch_size"]), int(controller.get("n_replicas", 0)),
                           float((controller.get("config") or {}).get("candidate_factor", 0.0)),
                           split=_saved_split(controller))
    writer = (state.get("run") or {}).get("plugin_version") if isinstance(state.get("run"), Mapping) else None
    raise CheckpointMismatchError(f"{path} has checkpoint format version {version!r}"
                                  + (f" (written by tailsieve-verl {writer}: resume with that version)" if writer else "")
                                  + f", this tailsieve-verl ({__version__}) reads {FORMAT_VERSION}")


def _carried(state: Mapping, path: str) -> tuple[dict, dict]:
    """The selector's state and the carried rows, checked to name the same prompts."""
    selector, rows = state["selector"], state["carried_rows"]
    missing = [p for p in selector["carried"] if p not in rows]
    if missing:
        raise CheckpointMismatchError(f"{path} lacks the prompt rows of carried groups {missing[:3]}")
    return dict(selector), {p: rows[p] for p in selector["carried"]}


def plan_restore(state: Mapping, path: str, shape: RunShape, policy: str) -> Restore:
    """Check a file's content against the resuming run and apply ``policy`` (see the module
    docstring); raises :class:`CheckpointMismatchError` with one line when it cannot go on."""
    try:
        version, saved = _saved_shape(state, path)
        selector, rows = _carried(state, path)
        drawn = tuple(state.get("drawn_rows", ()))  # absent in files written before the loader kept stock batches
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointMismatchError):
            problem = str(exc)
        else:
            problem = f"{path} is not TailSieve state this version can read ({type(exc).__name__}: {exc})"
        return _unusable(problem, path, shape, policy)
    differences = shape.differences(saved) + ([f"format version {version} (this run {FORMAT_VERSION})"]
                                              if version != FORMAT_VERSION else [])
    controller = state.get("controller") if shape.same_controller(saved) else None
    carried = list(selector["carried"])
    if not differences:
        if controller is None and state.get("controller") is not None:
            logger.warning("TailSieve: resuming from %s at the split this run pins, (q0, tail_replicas) = (%d, %d) "
                           "with the inner loop %s; the checkpoint's controller ran %s, whose learned (q, m) is not "
                           "restored; its %d carried prompts are regenerated in the next step", path, shape.split[0],
                           shape.split[1], "on" if shape.split[2] else "off",
                           f"the pinned split {saved.split[:2]}" if saved.split else "adaptive", len(carried))
        # record_plan: the record-planned steps' state and guard (absent in older files: nothing planned yet)
        return Restore({"selector": selector, "controller": controller,
                        "prompt_record": state.get("prompt_record"), "abort_share": state.get("abort_share", 1.0),
                        "record_plan": state.get("record_plan")}, rows, drawn)
    if policy == "stop":
        as_saved = shape.how_to_resume_as_saved(saved)
        raise CheckpointMismatchError(
            f"{path} was written by another run shape: {'; '.join(differences)}. "
            f"{f'Resume with {as_saved}, or set' if as_saved else 'Set'} {_POLICY_KEY}=keep_carried (its "
            f"{len(carried)} carried prompts are trained once in the next step) or =drop_carried (they are not "
            f"regenerated)")
    if policy == "keep_carried" and len(carried) >= shape.batch_size:
        raise CheckpointMismatchError(
            f"{_POLICY_KEY}=keep_carried: {path} carries {len(carried)} prompts, more than one step of "
            f"data.train_batch_size={shape.batch_size} can regenerate; resume with data.train_batch_size>"
            f"{len(carried)} or set {_POLICY_KEY}=drop_carried")
    fate = "are regenerated in the next step"
    if policy == "drop_carried":
        fate = f"are not regenerated (prompt keys {', '.join(_prompt_keys(rows, carried))})"
        selector, rows = dict(selector, carried=[], scores=[]), {}
    logger.warning("TailSieve: resuming from %s under %s=%s despite %s: its %d carried prompts %s; the controller %s",
                   path, _POLICY_KEY, policy, "; ".join(differences), len(carried), fate,
                   "keeps its learned state" if controller is not None else "restarts from q0 / tail_replicas")
    # the queue is a list of prompts: it fits any batch it is shorter than (checked above). The per-prompt record
    # fits any shape and is kept; the record-planned steps' guard measured another shape's splits: it starts afresh
    return Restore({"selector": dict(selector, batch_size=shape.batch_size), "controller": controller,
                    "prompt_record": state.get("prompt_record")}, rows, drawn)


def _unrecoverable(shape: RunShape) -> int:
    """Prompts an unreadable file can hold: fewer than a step carried, fewer than a loader draw drawn."""
    return 2 * (shape.batch_size - 1)


def _unusable(problem: str, path: str, shape: RunShape, policy: str) -> Restore:
    if policy != "drop_carried":
        earlier = _earlier_checkpoint(os.path.dirname(path))
        instead = (f"resume from {earlier} (trainer.resume_mode=resume_path trainer.resume_from_path={earlier}), or "
                   if earlier else "")
        raise CheckpointMismatchError(
            f"{problem}; its carried prompts cannot be recovered from it: {instead}set {_POLICY_KEY}=drop_carried "
            f"to go on without them (up to {_unrecoverable(shape)} prompts of this epoch untrained)")
    logger.warning("TailSieve: %s; %s=drop_carried: going on with an empty carried queue (up to %d prompts of "
                   "this epoch are not regenerated; the per-prompt record restarts too)", problem, _POLICY_KEY,
                   _unrecoverable(shape))
    return Restore({"selector": {"batch_size": shape.batch_size, "step": 0, "carried": [], "scores": []},
                    "controller": None, "prompt_record": None}, {})


def _prompt_keys(rows: Mapping, carried: list[str]) -> list[str]:
    return [prompt_key(rows[p]) for p in carried]


def _earlier_checkpoint(step_folder: str) -> str | None:
    """The newest ``global_step_K`` beside ``step_folder`` with a smaller K, if any."""
    parent, name = os.path.split(os.path.abspath(step_folder))
    prefix = "global_step_"
    if not name.startswith(prefix) or not name[len(prefix):].isdigit():
        return None
    current = int(name[len(prefix):])
    steps = [int(n[len(prefix):]) for n in os.listdir(parent) if n.startswith(prefix) and n[len(prefix):].isdigit()]
    earlier = [k for k in steps if k < current and os.path.exists(os.path.join(parent, f"{prefix}{k}", STATE_FILE))]
    return os.path.join(parent, f"{prefix}{max(earlier)}") if earlier else None


def restore_for_resume(folder: str | None, shape: RunShape, policy: str) -> Restore | None:
    """Read and check ``folder/tailsieve.pt``; None when there is nothing to restore (no folder, or a
    checkpoint written by stock verl, which carries nothing)."""
    if folder is None:
        return None
    path = os.path.join(folder, STATE_FILE)
    if not os.path.exists(path):
        logger.warning("TailSieve: %s has no %s (not a TailSieve checkpoint); starting with an empty carried queue",
                       folder, STATE_FILE)
        return None
    try:
        state = read_state_file(path)
    except CheckpointMismatchError as exc:
        return _unusable(str(exc), path, shape, policy)
    return plan_restore(state, path, shape, policy)
