"""Measured speculative verify cost (the JSON ``scripts/gpu/verify_cost.py`` writes), read two ways:
next to the engine model's first-order price (:meth:`VerifyTable.report`), and as the price of a
verify step (:attr:`core.engine.engine.SpeculativeConfig.verify_table`).

The first-order model charges a verify step of k draft tokens per request ``T(b·(k+1), 0) + T(b, c)
− T(b, 0)`` (weights at every query token, KV read once per request); a draft token costs
``draft_cost · T(b, c)``. The measured table replaces the first with the measured ratio
``V_k(b, c) / T(b, c)`` applied to the perf model's decode step, so a table measured on one GPU
carries over to a decode table measured elsewhere (and reproduces the measurement on its own table).
"""

from __future__ import annotations

import os

import numpy as np

from .perf import Calibration, PerfModel, PerfModelError, TablePerf, read_calibration_file

KINDS = ("decode", "verify", "draft")


class VerifyTable:
    """Measured decode, verify (per depth k) and one-layer draft steps of one model shape, each
    interpolated over (batch, context) by :class:`core.engine.perf.TablePerf`."""

    def __init__(self, rows, source: str, model: str | None = None):
        if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
            raise PerfModelError(f"{source}: a verify-cost table needs a non-empty 'rows' list of objects "
                                 "(as scripts/gpu/verify_cost.py writes)")
        for i, r in enumerate(rows):
            k = r.get("k")
            if r.get("kind") not in KINDS or not isinstance(k, int) or isinstance(k, bool) or k < 0 \
                    or (r["kind"] == "verify" and k < 1):
                raise PerfModelError(f"{source}: row {i} needs kind in {KINDS} and an integer k (>= 1 for "
                                     f"verify): {r!r}"[:300])
        models = sorted({str(r.get("model", "")) for r in rows})
        if model is None and len(models) > 1:
            raise PerfModelError(f"{source} holds several models ({', '.join(models)}); pick one: {source}:MODEL")
        self.model = model if model is not None else models[0]
        if self.model not in models:
            raise PerfModelError(f"{source}: no rows for model {self.model!r}; known: {', '.join(models)}")
        rows = [r for r in rows if str(r.get("model", "")) == self.model]
        self.source = source
        self.decode = self._table(rows, "decode", None)
        ks = sorted({r["k"] for r in rows if r["kind"] == "verify"})
        if not ks:
            raise PerfModelError(f"{source}: no verify rows for {self.model}; rerun scripts/gpu/verify_cost.py "
                                 "with a larger --budget-s")
        self.verify = {k: self._table(rows, "verify", k) for k in ks}
        self.draft_rows = {(r["batch"], r["context"]): r["step_ms"] / 1000 for r in rows if r["kind"] == "draft"}
        self.verify_rows = [r for r in rows if r["kind"] == "verify"]

    def _table(self, rows, kind: str, k: int | None) -> TablePerf:
        chosen = [r for r in rows if r["kind"] == kind and (k is None or r["k"] == k)]
        label = f"{self.source} ({kind}{'' if k is None else f' k={k}'})"
        if not chosen:
            raise PerfModelError(f"{label}: no rows; rerun scripts/gpu/verify_cost.py with a larger --budget-s")
        try:
            return TablePerf(Calibration.from_rows(chosen, label, self.model))
        except PerfModelError as e:
            raise PerfModelError(f"{e}; rerun scripts/gpu/verify_cost.py with a larger --budget-s "
                                 "or fewer --contexts") from None

    @classmethod
    def load(cls, spec: str) -> "VerifyTable":
        """``PATH`` or ``PATH:MODEL`` (a file holding several model shapes needs the model)."""
        path, model = spec, None
        head, sep, tail = spec.rpartition(":")
        if sep and head and not os.path.exists(spec) and os.path.exists(head):
            path, model = head, tail
        data = read_calibration_file(path)
        return cls(data.get("rows") if isinstance(data, dict) else data, path, model)

    @property
    def name(self) -> str:
        return f"{self.source}:{self.model}"

    @property
    def max_k(self) -> int:
        return max(self.verify)

    def ratio(self, batch, context, k) -> np.ndarray:
        """Measured verify step over decode step at (batch, context), linear in k between measured
        depths (k = 0: 1); k may be fractional (a step whose newly admitted requests do not verify)."""
        b, c, k = (np.atleast_1d(np.asarray(v, dtype=float)) for v in (batch, context, k))
        b = np.maximum(b, 1.0)  # a step with nobody verifying costs T(0, c) = 0 whatever the ratio
        depths = np.array([0.0] + sorted(self.verify), dtype=float)
        decode = self.decode.step_time(b, c)
        ratios = np.stack([np.ones_like(b)] + [self.verify[d].step_time(b, c) / decode for d in sorted(self.verify)])
        kk = np.clip(k, 0.0, depths[-1])
        j = np.clip(np.searchsorted(depths, kk, side="right") - 1, 0, len(depths) - 2)
        w = (kk - depths[j]) / (depths[j + 1] - depths[j])
        cols = np.arange(len(b))
        return (1 - w) * ratios[j, cols] + w * ratios[j + 1, cols]

    def first_order(self, batch, context, k, perf: PerfModel | None = None) -> np.ndarray:
        """The engine model's default verify price on this table's decode rows (or on ``perf``)."""
        perf = perf or self.decode
        b, c, k = (np.atleast_1d(np.asarray(v, dtype=float)) for v in (batch, context, k))
        zero = np.zeros_like(b)
        return perf.step_time(b * (k + 1), zero) + perf.step_time(b, c) - perf.step_time(b, zero)

    def report(self, perf: PerfModel | None = None) -> list[dict]:
        """Per measured verify step: milliseconds measured, first-order and their relative error, and
        the draft step at the same (batch, context) as a fraction of the decode step. Given ``perf``
        (say the bundled table of the same shape), also its decode step and first-order verify price."""
        out = []
        for r in sorted(self.verify_rows, key=lambda r: (r["context"], r["batch"], r["k"])):
            b, c, k = r["batch"], r["context"], r["k"]
            decode_s = float(self.decode.step_time(np.array([b], float), np.array([c], float))[0])
            predicted = float(self.first_order(b, c, k)[0])
            measured = r["step_ms"] / 1000
            draft = self.draft_rows.get((b, c))
            row = {"model": self.model, "batch": b, "context": c, "k": k, "decode_ms": 1000 * decode_s,
                   "verify_ms": 1000 * measured, "first_order_ms": 1000 * predicted,
                   "first_order_error": predicted / measured - 1,
                   "draft_fraction": None if draft is None else draft / decode_s}
            if perf is not None:
                row["perf_decode_ms"] = 1000 * float(np.asarray(perf.step_time(np.array([b], float),
                                                                               np.array([c], float)))[0])
                row["perf_first_order_ms"] = 1000 * float(self.first_order(b, c, k, perf)[0])
            out.append(row)
        return out


def format_report(rows: list[dict]) -> str:
    """The report as an aligned text table."""
    perf = bool(rows) and "perf_decode_ms" in rows[0]
    lines = [f"{'batch':>6} {'context':>8} {'k':>2} {'decode_ms':>10} {'verify_ms':>10} {'first_order_ms':>14} "
             f"{'error':>7} {'draft/decode':>12}" + (f" {'perf_decode_ms':>14} {'perf_first_order_ms':>19}" if perf else "")]
    for r in rows:
        draft = "-" if r["draft_fraction"] is None else f"{r['draft_fraction']:.4f}"
        lines.append(f"{r['batch']:>6} {r['context']:>8} {r['k']:>2} {r['decode_ms']:>10.3f} {r['verify_ms']:>10.3f} "
                     f"{r['first_order_ms']:>14.3f} {r['first_order_error']:>+7.1%} {draft:>12}"
                     + (f" {r['perf_decode_ms']:>14.3f} {r['perf_first_order_ms']:>19.3f}" if perf else ""))
    return "\n".join(lines)
