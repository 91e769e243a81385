"""Read runs that verl 0.9.1's ``wandb`` and ``mlflow`` trackers wrote (``trainer.logger``).

verl (``verl/utils/tracking.py``) logs each step as one ``log(metrics, step=global_step)`` call:

* ``wandb``: ``wandb.init(project=project_name, name=experiment_name)``, then
  ``wandb.log(metrics, step=step)``. An offline run (``WANDB_MODE=offline``) is a folder
  ``wandb/offline-run-<date>-<id>/`` holding ``run-<id>.wandb``: wandb's transaction log, LevelDB's
  log framing (32 KiB blocks of CRC-checked FULL/FIRST/MIDDLE/LAST chunks) after a 7-byte
  ``:W&B`` header, each record a ``wandb.proto.wandb_internal_pb2.Record``. wandb 0.31 writes it from
  its Go core and ships no Python reader (``wandb.sdk.internal.datastore`` is gone), so the framing
  is read here and the records with wandb's own protobuf. A synced run is read with ``wandb.Api()``
  from ``wandb://ENTITY/PROJECT/RUN_ID``.
* ``mlflow``: ``MLFLOW_TRACKING_URI`` (verl's default ``sqlite:////tmp/mlruns.db``), experiment =
  project_name, run name = experiment_name, ``mlflow.log_metrics(metrics, step=step)``. verl renames
  keys MLflow refuses: ``@`` becomes ``_at_`` (``val-core/.../mean@1`` → ``mean_at_1``), other
  characters outside ``[/\\w.\\- :]`` become ``_``, repeated ``/`` one ``/``; ``/`` is kept, so
  ``timing_s/gen`` reads as is, and ``_at_`` is turned back into ``@`` here so that validation
  scores line up with the other trackers'.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from contextlib import contextmanager
from pathlib import Path

from ..core.errors import needs_package
from .run_logs import CompareError, RunLog

WANDB_URL = "wandb://"
_BLOCK = 32768
_HEADER = struct.Struct("<4sHB")  # ident, magic, version
_CHUNK = struct.Struct("<IHB")  # crc32 of type byte + data, length, type
_WANDB_IDENT, _WANDB_MAGIC = b":W&B", 0xBEE1
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
MLFLOW_SCHEMES = ("sqlite:", "file:", "mlflow:")


def _reason(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# ---------------------------------------------------------------------------------------------- wandb


def _wandb_records(path: Path):
    """Each record's bytes from a ``run-*.wandb`` transaction log; a run still being written (or
    killed) ends in zeros or a cut record, read up to there."""
    data = path.read_bytes()
    if len(data) < _HEADER.size or _HEADER.unpack_from(data)[:2] != (_WANDB_IDENT, _WANDB_MAGIC):
        raise CompareError(f"{path}: not a W&B transaction log (no ':W&B' header)")
    pos, pending = _HEADER.size, None
    while pos + _CHUNK.size <= len(data):
        if _BLOCK - pos % _BLOCK < _CHUNK.size:  # a block's zero trailer
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = _CHUNK.unpack_from(data, pos)
        chunk = data[pos + _CHUNK.size:pos + _CHUNK.size + length]
        if kind == 0 and length == 0 or len(chunk) < length:  # the writer stopped here: a run still open or killed
            return
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            raise CompareError(f"{path}: corrupt W&B record at byte {pos} (bad checksum)")
        pos += _CHUNK.size + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind in (_MIDDLE, _LAST) and pending is not None:
            pending += chunk
            if kind == _LAST:
                yield pending
                pending = None
        else:
            raise CompareError(f"{path}: corrupt W&B record at byte {pos} (chunk type {kind} out of order)")


def read_wandb_file(path: Path, run_folder: Path | None = None) -> RunLog:
    """A W&B offline run's history: every numeric item of each ``history`` record at its step."""
    with needs_package("wandb", f"{path}: reading a W&B run"):
        from google.protobuf.message import DecodeError
        from wandb.proto import wandb_internal_pb2

    folder = run_folder or path.parent
    run = RunLog(folder.name, str(folder), "wandb")
    for raw in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        try:
            record.ParseFromString(raw)
        except DecodeError:
            raise CompareError(f"{path}: a W&B record is not a wandb Record protobuf") from None
        kind = record.WhichOneof("record_type")
        if kind == "run" and record.run.display_name:
            run.name = record.run.display_name  # verl's experiment_name
        if kind != "history":
            continue
        for item in record.history.item:
            key = item.key or ".".join(item.nested_key)
            if key.startswith("_"):  # wandb's own _step, _runtime, _timestamp
                continue
            try:
                value = json.loads(item.value_json)
            except ValueError:
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                run.add(record.history.step.num, key, float(value))
    return run


def wandb_run_file(directory: Path) -> Path | None:
    """The ``run-*.wandb`` file of a W&B run folder, or of the one run in a ``wandb/`` folder."""
    own = sorted(directory.glob("run-*.wandb"))
    if own:
        return own[0]
    runs = {p.resolve() for p in directory.glob("*/run-*.wandb")}  # latest-run is a link to one of them
    runs |= {p.resolve() for p in directory.glob("wandb/*/run-*.wandb")}
    if len(runs) > 1:
        shown = ", ".join(sorted(p.parent.name for p in runs)[:4])
        raise CompareError(f"{directory}: several W&B runs ({shown}, ...); pass the run folder you mean")
    return runs.pop() if runs else None


def parse_wandb_url(url: str) -> str:
    """``wandb://ENTITY/PROJECT/RUN_ID`` (or ``.../PROJECT/runs/RUN_ID``, as in the web address) →
    the ``ENTITY/PROJECT/RUN_ID`` path ``wandb.Api().run`` takes."""
    parts = url[len(WANDB_URL):].strip("/").split("/")
    if len(parts) == 4 and parts[2] == "runs":
        parts = [parts[0], parts[1], parts[3]]
    if len(parts) != 3 or not all(parts):
        raise CompareError(f"{url}: expected wandb://ENTITY/PROJECT/RUN_ID")
    return "/".join(parts)


def read_wandb_online(url: str) -> RunLog:
    """A synced run's history through ``wandb.Api()`` (needs the network and ``WANDB_API_KEY``)."""
    path = parse_wandb_url(url)
    with needs_package("wandb", f"{url}: reading a synced W&B run"):
        import wandb

    try:
        api_run = wandb.Api(timeout=60).run(path)
        run = RunLog(api_run.name or path.rsplit("/", 1)[1], url, "wandb")
        for row in api_run.scan_history():
            step = row.get("_step")
            if not isinstance(step, int):
                continue
            for key, value in row.items():
                if not key.startswith("_") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    run.add(step, key, float(value))
    except Exception as e:  # wandb's UsageError (no API key), CommError (network, run not found), ...
        raise CompareError(f"{url}: cannot read the W&B run ({_reason(e)}); or compare its offline "
                           "folder wandb/offline-run-*") from None
    return run


# ---------------------------------------------------------------------------------------------- mlflow


def is_mlflow_run_folder(path: Path) -> bool:
    """``mlruns/<experiment id>/<run id>/`` of MLflow's file store."""
    return path.is_dir() and (path / "meta.yaml").is_file() and (path / "metrics").is_dir()


def is_mlflow_store(path: Path) -> bool:
    """An ``mlruns`` folder: experiment folders with a ``meta.yaml`` each."""
    return path.is_dir() and any(p.is_file() for p in path.glob("*/meta.yaml"))


def mlflow_store(spec: str) -> tuple[str, str | None]:
    """``STORE#RUN`` → (tracking URI, run selector or None). STORE is a tracking URI
    (``sqlite:///mlflow.db``, ``file:/abs/mlruns``), an ``mlruns`` folder, a ``.db`` file or an
    ``mlruns/<experiment id>/<run id>`` folder; RUN is a run id, a run name or EXPERIMENT/RUN_NAME
    (verl's project_name/experiment_name)."""
    store, _, selector = spec.partition("#")
    if store.startswith("mlflow:"):
        store = store[len("mlflow:"):]
    if store.startswith("sqlite:"):
        db = re.sub(r"^sqlite:/{3}", "", store)
        if db == store or not db:
            raise CompareError(f"{spec}: expected sqlite:///relative.db or sqlite:////absolute.db")
        if not Path(db).is_file():  # MLflow would create an empty store there
            raise CompareError(f"{db}: no such MLflow database file")
        return store, selector or None
    local = Path(store[len("file:"):] if store.startswith("file:") else store)
    if not local.exists():
        raise CompareError(f"{local}: no such file or directory")
    if is_mlflow_run_folder(local):
        return f"file:{local.resolve().parent.parent}", selector or local.name
    return (f"sqlite:///{local.resolve()}" if local.is_file() else f"file:{local.resolve()}"), selector or None


@contextmanager
def _file_store_allowed(uri: str):
    """MLflow 3 refuses its file store unless MLFLOW_ALLOW_FILE_STORE is set; reading one is fine."""
    if not uri.startswith("file:"):
        yield
        return
    saved = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = saved


def _find_mlflow_run(client, uri: str, selector: str | None):
    experiments = client.search_experiments()
    runs = client.search_runs([e.experiment_id for e in experiments]) if experiments else []
    names = {e.experiment_id: e.name for e in experiments}
    if selector is None:
        matches = runs
    else:
        matches = [r for r in runs if selector in (r.info.run_id, r.info.run_name,
                                                   f"{names.get(r.info.experiment_id)}/{r.info.run_name}")]
    if len(matches) == 1:
        return matches[0]
    listed = ", ".join(f"{names.get(r.info.experiment_id)}/{r.info.run_name} ({r.info.run_id})" for r in runs[:6])
    what = f"run {selector!r}" if selector else "a run (add #RUN_ID, #RUN_NAME or #EXPERIMENT/RUN_NAME)"
    found = "not found" if not matches else f"matches {len(matches)} runs"
    raise CompareError(f"{uri}: {what} {found}; runs: {listed or 'none'}")


def read_mlflow(spec: str) -> RunLog:
    """Every metric's history of one MLflow run (see ``mlflow_store`` for ``spec``), through
    ``MlflowClient.get_metric_history``; a step logged twice (a resumed run) keeps its newest value."""
    with needs_package("mlflow", f"{spec}: reading MLflow runs", "pip install mlflow-skinny sqlalchemy alembic"):
        from mlflow.tracking import MlflowClient
    uri, selector = mlflow_store(spec)
    try:
        with _file_store_allowed(uri):
            client = MlflowClient(tracking_uri=uri)
            found = _find_mlflow_run(client, uri, selector)
            run = RunLog(found.info.run_name or found.info.run_id, spec, "mlflow")
            for key in sorted(found.data.metrics):
                for metric in sorted(client.get_metric_history(found.info.run_id, key), key=lambda m: m.timestamp):
                    run.add(metric.step, key.replace("_at_", "@"), metric.value)
    except CompareError:
        raise
    except Exception as e:  # MlflowException, SQLAlchemy's errors for a file that is no MLflow database, ...
        raise CompareError(f"{spec}: cannot read the MLflow run ({_reason(e)})") from None
    return run
