"""Concurrency–throughput models: seconds per decode step as a function of a replica's active
requests and their mean context (KV tokens per request).

Every model is vectorised: ``step_time(active, context)`` takes scalars or equal-shape numpy arrays.
Prefill is ignored (decode dominates long-tail rollouts); a step with 0 active requests costs 0.

Specs accepted by :func:`parse_perf_model` (the CLI's ``--perf-model``):

* ``linear:a=A,c=C`` — each step takes ``A + C·active`` seconds, whatever the context. A replica
  that admits everything at t=0 then finishes in exactly ``A·max_len + C·Σ len``.
* ``table:NAME_OR_PATH[:MODEL]`` — a measured calibration table (bundled names: ``h200-dense``,
  ``h200-moe``; or a JSON file as written by ``tailsieve calibrate``). See :class:`TablePerf`.
* ``fitted:NAME_OR_PATH[:MODEL]`` — a smooth ``a + b·active + k·active·context`` least-squares fit
  to the same measurements (useful when a user measured only a few points).

A replica wider than one GPU (tensor parallelism) prices its steps from any of these through
:class:`TensorParallel` (:class:`TensorParallelPerf`): the tables measure one GPU.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import numpy as np

from ..errors import TailSieveError

BUNDLED_TABLES = {
    "h200-dense": ("h200_dense_decode_curve.json", "qwen3-1.7b"),
    "h200-moe": ("h200_moe_decode_curve.json", "qwen3-30b-a3b"),
}
KNOWN_SPECS = "linear:a=A,c=C | table:{h200-dense,h200-moe,PATH.json}[:MODEL] | fitted:{...}[:MODEL]"
DEFAULT_PERF_MODEL = "table:h200-dense"
# One decode step's sane range in seconds: a microsecond is below any engine's step, a minute far above
# one at any batch. Outside it a spec is a typo: linear:a=1e200 priced steps at 1e204 s, 1e308 overflowed.
MIN_STEP_S, MAX_STEP_S = 1e-6, 60.0


class PerfModelError(TailSieveError):
    """An unknown or malformed performance-model spec or calibration file."""


class PerfModel:
    """Base class: seconds per decode step for ``active`` requests at mean ``context`` tokens."""

    name = "perf"

    def step_time(self, active, context=0.0):
        raise NotImplementedError

    def per_request_tok_s(self, active: int, context: float = 1024.0) -> float:
        """Decode speed one request sees at this concurrency (tokens per second)."""
        return 1.0 / float(self.step_time(np.asarray([active]), np.asarray([float(context)]))[0])


@dataclass
class LinearPerf(PerfModel):
    """``a + c·active`` seconds per step; the closed-form model used by tests and quick studies."""

    a: float
    c: float

    def __post_init__(self) -> None:
        if not (0 <= self.a <= MAX_STEP_S and 0 <= self.c <= MAX_STEP_S and self.a + self.c >= MIN_STEP_S):
            raise PerfModelError(f"linear model needs 0 <= a <= {MAX_STEP_S:g} s, 0 <= c <= {MAX_STEP_S:g} s and "
                                 f"a + c >= {MIN_STEP_S:g} s (a decode step's sane range), "
                                 f"got a={self.a:g}, c={self.c:g}")
        self.name = f"linear:a={self.a:g},c={self.c:g}"

    def step_time(self, active, context=0.0):
        active = np.asarray(active, dtype=float)
        return np.where(active > 0, self.a + self.c * active, 0.0)


@dataclass(frozen=True)
class Calibration:
    """Measured decode steps of one model shape: arrays of batch, context and step seconds."""

    model: str
    batch: np.ndarray
    context: np.ndarray
    step_s: np.ndarray
    source: str
    engine: dict | None = None
    """The engine facts ``tailsieve calibrate`` measured with the table (the file's ``"engine"``
    section, read by :func:`core.engine.engine.measured_engine_fields`); None in files from before it did."""

    @classmethod
    def load(cls, name_or_path: str, model: str | None = None) -> "Calibration":
        if name_or_path in BUNDLED_TABLES:
            filename, default_model = BUNDLED_TABLES[name_or_path]
            text = resources.files("tailsieve_verl.data").joinpath(filename).read_text()
            model = model or default_model
        elif os.path.exists(name_or_path):
            text = _read_calibration_text(Path(name_or_path))
        else:
            raise PerfModelError(
                f"unknown calibration {name_or_path!r}: not a bundled table ({', '.join(BUNDLED_TABLES)}) "
                "and no such file; measure one with `tailsieve calibrate` or pick a bundled table")
        data = parse_calibration_json(text, name_or_path)
        if not isinstance(data, dict):
            return cls.from_rows(data, name_or_path, model)
        engine = data.get("engine")
        return replace(cls.from_rows(data.get("rows"), name_or_path, model),
                       engine=engine if isinstance(engine, dict) else None)

    @classmethod
    def from_rows(cls, rows, source: str, model: str | None = None) -> "Calibration":
        """One model's rows of a loaded calibration (``{model, batch, context, step_ms}`` each), checked."""
        if not isinstance(rows, list) or not rows:
            raise PerfModelError(f"{source}: calibration needs a non-empty 'rows' list of "
                                 "{model, batch, context, step_ms}")
        seen: dict[tuple, int] = {}
        for i, r in enumerate(rows):
            if not isinstance(r, dict) or not {"batch", "context", "step_ms"} <= set(r):
                raise PerfModelError(f"{source}: row {i} lacks batch/context/step_ms: {r!r}"[:300])
            if not all(_is_number(r[k]) for k in ("batch", "context", "step_ms")):
                raise PerfModelError(f"{source}: row {i} has a non-numeric batch, context or step_ms: {r!r}"[:300])
            if r["batch"] < 1 or r["context"] < 0 or r["step_ms"] <= 0:
                raise PerfModelError(f"{source}: row {i} has batch < 1, context < 0 or step_ms <= 0: {r!r}")
            if not 1000 * MIN_STEP_S <= r["step_ms"] <= 1000 * MAX_STEP_S:
                raise PerfModelError(f"{source}: row {i} has step_ms = {r['step_ms']:g}, outside a decode step's sane "
                                     f"range {1000 * MIN_STEP_S:g}..{1000 * MAX_STEP_S:g} ms")
            point = (str(r.get("model", "")), float(r["batch"]), float(r["context"]))
            if point in seen:
                raise PerfModelError(f"{source}: rows {seen[point]} and {i} both measure batch {r['batch']} at "
                                     f"context {r['context']}; keep one measurement per point")
            seen[point] = i
        models = sorted({str(r.get("model", "")) for r in rows})
        if model is None:
            if len(models) > 1:
                raise PerfModelError(f"{source} holds several models ({', '.join(models)}); "
                                     f"pick one: table:{source}:MODEL")
            model = models[0]
        rows = [r for r in rows if str(r.get("model", "")) == model]
        if not rows:
            raise PerfModelError(f"{source}: no rows for model {model!r}; known: {', '.join(models)}")
        return cls(model=model,
                   batch=np.array([r["batch"] for r in rows], dtype=float),
                   context=np.array([r["context"] for r in rows], dtype=float),
                   step_s=np.array([r["step_ms"] for r in rows], dtype=float) / 1000.0,
                   source=source)


def _read_calibration_text(path: Path) -> str:
    if not path.is_file():
        raise PerfModelError(f"{path}: not a calibration file (a directory?); give the JSON `tailsieve calibrate` wrote")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise PerfModelError(f"{path}: not UTF-8 text; a calibration is the JSON `tailsieve calibrate` wrote") from None


def read_calibration_file(path: str) -> object:
    """The parsed JSON of a calibration file (a measured table), or one clear error."""
    if not os.path.exists(path):
        raise PerfModelError(f"{path}: no such calibration file")
    return parse_calibration_json(_read_calibration_text(Path(path)), path)


def parse_calibration_json(text: str, source: str) -> object:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise PerfModelError(f"{source}: calibration is not valid JSON ({e.msg})") from None
    except (ValueError, RecursionError) as e:
        raise PerfModelError(f"{source}: calibration is not usable JSON ({str(e).splitlines()[0]})") from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a measurement")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_BATCH_TABLE_LIMIT = 1 << 16  # whole batch sizes read from TablePerf's table, below this


class TablePerf(PerfModel):
    """Interpolates a measured (batch × context) table.

    A step is modelled as ``u(b) + b·(ctx − c0)·κ(b, ctx)``: ``u`` is the measured curve at the
    smallest measured context ``c0`` (piecewise linear in batch, extrapolated with the last
    segment's slope), and ``κ`` the measured extra cost per request per context token, interpolated
    linearly in log-batch and in context between the measured levels and held constant beyond them.
    Every measured point is reproduced exactly; large batches at long contexts, which a GPU table
    often lacks, extrapolate with the per-request KV cost of the nearest measured batch.
    """

    def __init__(self, cal: Calibration):
        self.calibration = cal
        self.name = f"table:{cal.source}:{cal.model}"
        levels = np.unique(cal.context)
        self.c0 = float(levels[0])
        base = cal.context == self.c0
        order = np.argsort(cal.batch[base])
        self.u_batch = cal.batch[base][order]
        self.u_step = cal.step_s[base][order]
        if len(self.u_batch) < 2:
            raise PerfModelError(f"{cal.source}: need at least two batch sizes at context {self.c0:g}")
        self.kappa_levels: list[float] = []
        self.kappa_curves: list[tuple[np.ndarray, np.ndarray]] = []
        for level in levels[1:]:
            sel = cal.context == level
            b = cal.batch[sel]
            u = self._u(b)
            kappa = (cal.step_s[sel] - u) / (b * (level - self.c0))
            order = np.argsort(b)
            self.kappa_levels.append(float(level))
            self.kappa_curves.append((np.log(b[order]), np.maximum(kappa[order], 0.0)))
        self._levels = np.asarray(self.kappa_levels)
        self._table_u, self._table_kappa = np.zeros(0), np.zeros((len(self.kappa_curves), 0))

    def _u(self, b: np.ndarray) -> np.ndarray:
        x, y = self.u_batch, self.u_step
        out = np.interp(b, x, y)
        hi = b > x[-1]
        if np.any(hi):
            slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
            out[hi] = y[-1] + slope * (b[hi] - x[-1])
        return out

    def _curves(self, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``u(b)`` and every context level's ``κ(b)`` (one row per level)."""
        logb = np.log(np.maximum(b, 1.0))
        kappa = np.array([np.interp(logb, xb, yk) for xb, yk in self.kappa_curves]).reshape(-1, len(b))
        return self._u(b), kappa

    def _at_batch(self, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_curves` as (u, κ rows, column of each b): read from a table over whole batch sizes when
        every b is one (a walk prices ~10⁴ steps of a few hundred distinct batch sizes; the table's values
        are the curves' own), else computed."""
        whole = b.astype(np.int64)
        if not len(b) or whole.min() < 0 or whole.max() >= _BATCH_TABLE_LIMIT or not np.array_equal(whole, b):
            u, kappa = self._curves(b)
            return u, kappa, np.arange(len(b))
        if whole.max() >= len(self._table_u):
            self._table_u, self._table_kappa = self._curves(np.arange(max(2 * (whole.max() + 1), 512), dtype=float))
        return self._table_u[whole], self._table_kappa, whole

    def step_time(self, active, context=0.0):
        scalar = np.ndim(active) == 0 and np.ndim(context) == 0
        b, ctx = np.atleast_1d(np.asarray(active, dtype=float)), np.atleast_1d(np.asarray(context, dtype=float))
        if b.shape != ctx.shape:
            b, ctx = (x.astype(float) for x in np.broadcast_arrays(b, ctx))
        u, kappa, col = self._at_batch(b)
        levels = self.kappa_levels
        if len(levels) > 1:  # linear in context between the two levels around it, constant beyond them
            c = np.minimum(np.maximum(ctx, levels[0]), levels[-1])
            if len(levels) == 2:
                w = (c - levels[0]) / (levels[1] - levels[0])
                kappa = (1 - w) * kappa[0, col] + w * kappa[1, col]
            else:
                j = np.minimum(np.searchsorted(levels, c, side="right") - 1, len(levels) - 2)
                w = (c - self._levels[j]) / (self._levels[j + 1] - self._levels[j])
                flat, width = kappa.ravel(), kappa.shape[1]
                kappa = (1 - w) * flat[j * width + col] + w * flat[(j + 1) * width + col]
        else:
            kappa = kappa[0, col] if levels else 0.0
        step = u + b * (ctx - self.c0) * kappa
        step = np.where(b > 0, np.maximum(step, 0.5 * u), 0.0)
        return float(step[0]) if scalar else step


class FittedPerf(PerfModel):
    """Non-negative least-squares fit ``a + b·active + k·active·context`` to measured points."""

    def __init__(self, batch, context, step_s, source: str = "points"):
        from scipy.optimize import nnls

        batch, context, step_s = (np.asarray(v, dtype=float) for v in (batch, context, step_s))
        if len(batch) < 3:
            raise PerfModelError(f"{source}: a fitted model needs at least 3 measured points, got {len(batch)}")
        design = np.stack([np.ones_like(batch), batch, batch * context], axis=1)
        # Relative error matters (small batches are as important as large ones): weight by 1/step.
        w = 1.0 / step_s
        (self.a, self.b, self.k), _ = nnls(design * w[:, None], step_s * w)
        self.name = f"fitted:{source}"

    @classmethod
    def from_calibration(cls, cal: Calibration) -> "FittedPerf":
        return cls(cal.batch, cal.context, cal.step_s, source=f"{cal.source}:{cal.model}")

    def step_time(self, active, context=0.0):
        active = np.asarray(active, dtype=float)
        return np.where(active > 0, self.a + self.b * active + self.k * active * np.asarray(context, dtype=float), 0.0)


HBM_BYTES_PER_S = 4.8e12
"""H200 HBM3e peak bandwidth, 4.8 TB/s (NVIDIA H200 datasheet): the least time reading a replica's weights takes,
which separates a measured step into what tensor parallelism splits and what it does not (:func:`step_floor_s`)."""
NVLINK_BYTES_PER_S = 450e9
"""NVLink 4 on H100/H200 SXM: 900 GB/s bidirectional per GPU (NVIDIA H200 datasheet), 450 GB/s each way: the
bandwidth term of an all-reduce."""
ALLREDUCE_LATENCY_S = 8e-6
"""One small all-reduce inside a CUDA graph over NVLink: about 6 µs on 2 H100s with NCCL's NVLS algorithm for
128 B–64 KiB messages, rising with the GPU count (NVIDIA/nccl issue #1259); a decode step's messages are
``batch × hidden × 2`` bytes, 8 KiB–2 MiB. 8 µs is the first-order figure, a parameter to be measured
(``scripts/gpu/verify_tp_cost.py``)."""


@dataclass(frozen=True)
class TensorParallel:
    """A replica's tensor-parallel width and the first-order price of its decode step (issue 58).

    A replica of width ``size`` holds one copy of the weights over ``size`` GPUs. From a one-GPU step
    ``T₁(b, c)`` (any :class:`PerfModel`), its step is ``F + (T₁ − F)/size + 2·layers·AR(b)``:

    * ``F`` (``floor_s``): the part of a step no width shortens (kernel launches and the small kernels every GPU
      runs whole); :func:`step_floor_s` reads it from the table as the batch-1 step less the time its weights
      take to read at HBM peak;
    * the rest — reading the weights and the KV cache (each GPU holds 1/size of both: heads and MLP columns
      split), and the matmuls of a large batch — divides by ``size`` (first order: ideal splitting, no loss of
      kernel efficiency on the narrower matrices);
    * two all-reduces per layer (after attention and after the MLP), each ``latency + 2(size−1)/size ·
      b·hidden·bytes / link`` (ring bandwidth term), the latency not shrinking with width.

    ``size`` 1 is the one-GPU model itself, unchanged."""

    size: int = 1
    """GPUs per replica (vLLM/verl ``tensor_model_parallel_size``)."""
    floor_s: float = 0.0
    """Seconds of each step that do not shrink with width (see :func:`step_floor_s`)."""
    layers: int = 0
    """Decoder layers: two all-reduces each."""
    hidden: int = 0
    """Hidden size: an all-reduce carries ``batch × hidden`` activations."""
    allreduce_latency_s: float = ALLREDUCE_LATENCY_S
    """Fixed seconds of one all-reduce (see :data:`ALLREDUCE_LATENCY_S`)."""
    link_bytes_per_s: float = NVLINK_BYTES_PER_S
    """Per-GPU link bandwidth one way (see :data:`NVLINK_BYTES_PER_S`)."""
    bytes_per_element: int = 2
    """bf16 activations."""

    def __post_init__(self) -> None:
        for name in ("size", "layers", "hidden", "bytes_per_element"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < (1 if name in (
                    "size", "bytes_per_element") else 0):
                raise PerfModelError(f"tensor parallel {name} must be an integer >= "
                                     f"{1 if name in ('size', 'bytes_per_element') else 0}, got {value!r}")
        for name in ("floor_s", "allreduce_latency_s"):
            value = getattr(self, name)
            if not (_is_number(value) and value >= 0):
                raise PerfModelError(f"tensor parallel {name} must be >= 0 seconds, got {value!r}")
        if not (_is_number(self.link_bytes_per_s) and self.link_bytes_per_s > 0):
            raise PerfModelError(f"tensor parallel link_bytes_per_s must be > 0, got {self.link_bytes_per_s!r}")
        if self.size > 1 and (self.layers < 1 or self.hidden < 1):
            raise PerfModelError(f"a replica of width {self.size} needs the model's layers and hidden size to price "
                                 "its all-reduces")

    def allreduce_s(self, active) -> np.ndarray:
        """Seconds of one step's all-reduces at ``active`` requests (0 at width 1)."""
        active = np.asarray(active, dtype=float)
        if self.size == 1:
            return np.zeros_like(active)
        t = self.size
        message = active * self.hidden * self.bytes_per_element
        return 2 * self.layers * (self.allreduce_latency_s + 2 * (t - 1) / t * message / self.link_bytes_per_s)


class TensorParallelPerf(PerfModel):
    """``base`` (one GPU's step) at the width of ``tp`` (:class:`TensorParallel`)."""

    def __init__(self, base: PerfModel, tp: TensorParallel):
        self.base, self.tp = base, tp
        self.name = f"{base.name}@tp{tp.size}"

    def step_time(self, active, context=0.0):
        one = np.asarray(self.base.step_time(active, context), dtype=float)
        if self.tp.size == 1:
            return one
        floor = np.minimum(self.tp.floor_s, one)
        step = floor + (one - floor) / self.tp.size + self.tp.allreduce_s(active)
        step = np.where(np.asarray(active, dtype=float) > 0, step, 0.0)
        return float(step) if np.ndim(step) == 0 else step


def at_width(perf: PerfModel, tp: TensorParallel) -> PerfModel:
    """``perf`` for a replica of ``tp``'s width: ``perf`` itself at width 1 (the one-GPU model, untouched)."""
    return perf if tp.size == 1 else TensorParallelPerf(perf, tp)


def step_floor_s(perf: PerfModel, weight_bytes: float, context: float = 1024.0,
                 hbm_bytes_per_s: float = HBM_BYTES_PER_S) -> float:
    """The part of a one-GPU step that no width shortens: the batch-1 step at ``context`` (the bundled tables'
    shortest) less reading ``weight_bytes`` (the weights one token reads: the active ones of a MoE) at HBM peak.
    First order: the batch-1 KV read (0.1 GB at 1k tokens) is counted in the floor, and all of the floor is
    taken as fixed, though some of it (attention and norm kernels' own work) would shrink with width."""
    return max(float(perf.step_time(np.asarray([1.0]), np.asarray([context]))[0]) - weight_bytes / hbm_bytes_per_s,
               0.0)


def cached_per_model(cache: dict, limit: int, perf: PerfModel, key: tuple, build):
    """``build()`` once per (perf model, key), keeping the ``limit`` newest: tables derived from a
    model are costly and searches reuse a handful of them. The entry holds the model, so its id
    cannot be reused by another model while cached."""
    full_key = (id(perf), *key)
    entry = cache.get(full_key)
    if entry is None or entry[0] is not perf:
        if len(cache) >= limit:
            cache.pop(next(iter(cache)))
        entry = cache[full_key] = (perf, build())
    return entry[1]


def _split_table_spec(body: str) -> tuple[str, str | None]:
    if body in BUNDLED_TABLES or os.path.exists(body):
        return body, None
    head, sep, model = body.rpartition(":")
    if sep and (head in BUNDLED_TABLES or os.path.exists(head)):
        return head, model
    return body, None


def parse_perf_model(spec: str | PerfModel) -> PerfModel:
    """Build a model from a spec string (see module docstring); errors list the known specs."""
    if isinstance(spec, PerfModel):
        return spec
    kind, sep, body = str(spec).partition(":")
    if kind == "linear" and sep:
        params = {}
        for part in body.split(","):
            key, eq, value = part.partition("=")
            try:
                params[key.strip()] = float(value)
            except ValueError:
                raise PerfModelError(f"bad linear model {spec!r}; expected linear:a=A,c=C (seconds)") from None
            if not math.isfinite(params[key.strip()]):
                raise PerfModelError(f"bad linear model {spec!r}: {key.strip()} must be a finite number of seconds")
        if set(params) != {"a", "c"}:
            raise PerfModelError(f"bad linear model {spec!r}; expected exactly a and c, e.g. linear:a=0.01,c=0.0001")
        return LinearPerf(params["a"], params["c"])
    if kind in ("table", "fitted") and body:
        cal = Calibration.load(*_split_table_spec(body))
        return TablePerf(cal) if kind == "table" else FittedPerf.from_calibration(cal)
    raise PerfModelError(f"unknown performance model {spec!r}; known: {KNOWN_SPECS}")
