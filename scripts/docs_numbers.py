"""Every figure README.md and docs/ quote, rendered from the committed result files.

A page marks a generated figure or table as ``<!-- numbers:NAME -->…<!-- /numbers -->`` (inline, or a
table on the lines between). ``--check`` renders every block from ``scripts/results/`` (and the tail
presets from ``core/data/workload.py``) and exits 1 naming each block whose text differs, each unknown
block name, and each measured figure (a number with three decimals) the README or docs/design.md states
outside a block; ``--write`` rewrites the blocks. Figures typed by hand drift from their sources; these cannot.

    python scripts/docs_numbers.py --check
    python scripts/docs_numbers.py --write
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from functools import cache
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "scripts" / "results"
PAGES = ("README.md", "docs/results.md", "docs/changelog.md", "docs/design.md", "docs/usage.md", "docs/testing.md")
STRICT_PAGES = ("README.md", "design.md")  # every measured figure on these pages is generated
BLOCK = re.compile(r"<!-- numbers:(?P<name>[\w-]+) -->(?P<body>.*?)<!-- /numbers -->", re.S)
HAND_FIGURE = re.compile(r"(?<![\w.])\d\.\d{3}(?![\w.])")  # a measured speedup, e.g. 1.108
CODE_FENCE = re.compile(r"^```.*?^```", re.S | re.M)

SETUP_LABELS = {"dense": "dense Qwen3-1.7B, 8 replicas", "dense8b": "dense Qwen3-8B, 8 replicas",
                "moe": "MoE Qwen3-30B-A3B, 4 replicas"}
TAILS = ("weak", "real", "strong")
DAPO_SHAPES = ("512x16@32768", "256x16@16384")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _span(values, digits: int = 3, sep: str = "–") -> str:
    """``lo–hi`` of ``values`` at ``digits`` decimals, one figure when they round alike."""
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}{sep}{hi}"


# --- the default configuration: the adaptive controller with its planned probe and its judge, verl's rollout defaults ---

JUDGE_FILES = tuple(sorted((RESULTS / "at_worst_stock_verl").glob("judge_*.jsonl")))  # scripts/experiments/judge_check.py
EPOCHS = {1: "first epoch", 2: "later epochs"}


def _judge_runs(files: tuple[Path, ...] = ()) -> list[dict]:
    return [r for path in (files or JUDGE_FILES) for r in _jsonl(path)]


@cache
def default_cells() -> dict[tuple[str, str, int], dict]:
    """Per (cell, shape, epoch) of judge_check.py's runs of the default controller: seeds, mean and worst speedup
    over stock verl, split steps, and the per-prompt oracle's mean on the seeds it was run on (epoch 1)."""
    oracle: dict = {}
    for name in ("signal_gap.jsonl", "signal_gap_64x8.jsonl"):
        for r in _jsonl(RESULTS / "signal_gap" / name):
            oracle.setdefault((r["cell"], r["shape"]), []).append(r["speedup_vs_verl"]["prompt-oracle-split"])
    runs = [r for r in _judge_runs() if r["rule"] == "new"]
    cells = {}
    for key in dict.fromkeys((r["cell"], r["shape"], r["epoch"]) for r in runs):
        rs = [r for r in runs if (r["cell"], r["shape"], r["epoch"]) == key]
        ts = np.array([r["speedup_vs_verl"] for r in rs])
        noise = float(np.std([r["redraw_vs_verl"] for r in rs], ddof=1))  # one stock run against another's draws
        cells[key] = {"seeds": len(rs), "mean": float(ts.mean()), "worst": float(ts.min()), "noise": noise,
                      "below_noise": int((ts < 1 - 2 * noise).sum()), "below_097": int((ts < 0.97).sum()),
                      "split_steps": float(np.mean([r["split_steps"] for r in rs])),
                      "deferral": max(r["max_deferral_steps"] for r in rs),
                      "lost_dup_stale": sum(r["lost_dup_stale"] for r in rs),
                      "oracle": float(np.mean(oracle[key[:2]])) if key[2] == 1 and key[:2] in oracle else None}
    return cells


def _shape_label(shape: str) -> str:
    batch, cap = shape.split("@")
    return f"{batch.replace('x', ' × ')}, {int(cap) // 1024}k cap"


SHAPES = ("512x16@32768", "256x16@16384", "64x8@16384")


def current_table() -> str:
    """The README's table: setups × tails down; shapes across, the first epoch beside the later ones, mean [worst run]."""
    cells = default_cells()
    lines = ["| setup / tails | " + " | ".join(f"{_shape_label(s)}, {EPOCHS[e]}" for s in SHAPES for e in EPOCHS) + " |",
             "| --- |" + " --- |" * (len(SHAPES) * len(EPOCHS))]
    for setup, label in SETUP_LABELS.items():
        for tails in TAILS:
            row = []
            for shape in SHAPES:
                for epoch in EPOCHS:
                    c = cells.get((f"{setup}-{tails}", shape, epoch))
                    figure = f"{c['mean']:.3f} [{c['worst']:.3f}]" if c else "–"
                    row.append(f"**{figure}**" if c and c["mean"] >= 1.01 else figure)
            lines.append(f"| {label}, {tails} | " + " | ".join(row) + " |")
    return "\n" + "\n".join(lines) + "\n"


def current_seeds() -> str:
    """How many seeds the README's table rests on, per shape."""
    cells = default_cells()
    return "; ".join(f"{_shape_label(shape)}: {_span([c['seeds'] for (_, s, _), c in cells.items() if s == shape], 0, ' to ')}"
                     for shape in SHAPES)


def current_detail() -> str:
    """docs/results.md's current table: every cell and epoch with its seeds, split steps and, in the first epoch,
    the per-prompt oracle."""
    lines = ["| cell | shape | epoch | seeds | TailSieve, mean [worst run] | noise of a run (σ) | "
             "per-prompt oracle (first epoch) | share of the oracle's gain | split steps | most steps a prompt waited |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (cell, shape, epoch), c in sorted(default_cells().items(),
                                          key=lambda kv: (kv[0][2], SHAPES.index(kv[0][1]), kv[0][0])):
        oracle = c["oracle"]
        share = f"{(c['mean'] - 1) / (oracle - 1) * 100:.0f} %" if oracle is not None and oracle >= 1.05 else "–"
        lines.append(f"| {cell} | {shape} | {epoch} | {c['seeds']} | {c['mean']:.3f} [{c['worst']:.3f}] | "
                     f"{c['noise']:.3f} | {'–' if oracle is None else f'{oracle:.3f}'} | {share} | {c['split_steps']:.1f} | {c['deferral']} |")
    return "\n" + "\n".join(lines) + "\n"


def _where(pred, epoch: int = 1) -> list[dict]:
    """The default controller's cells of ``epoch`` whose (setup, tails, shape) satisfy ``pred``."""
    return [c for (cell, shape, e), c in default_cells().items() if e == epoch and pred(*cell.split("-"), shape)]


def _pays(setup: str, tails: str) -> bool:
    """Where isolation pays: weak tails on dense replicas."""
    return tails == "weak" and setup != "moe"


def weak_dense_dapo(epoch: int = 1) -> str:
    return _span([c["mean"] for c in _where(lambda s, t, shape: _pays(s, t) and shape in DAPO_SHAPES, epoch)])


def weak_dense_64x8(epoch: int = 1) -> str:
    return _span([c["mean"] for c in _where(lambda s, t, shape: _pays(s, t) and shape.startswith("64x8"), epoch)])


def _elsewhere(epoch: int = 1) -> list[dict]:
    return _where(lambda s, t, shape: not _pays(s, t), epoch)


def elsewhere_span(epoch: int = 1) -> str:
    return _span([c["mean"] for c in _elsewhere(epoch)])


def elsewhere_count() -> str:
    return f"{len(_elsewhere())} of {len(_where(lambda *_: True))}"


def elsewhere_oracle_gain() -> str:
    return f"{(max(c['oracle'] for c in _elsewhere()) - 1) * 100:.0f} %"


def lowest_run() -> str:
    """The worst run of any cell and epoch, and its cell."""
    (cell, shape, epoch), c = min(default_cells().items(), key=lambda kv: kv[1]["worst"])
    return f"{c['worst']:.3f} ({cell} {_shape_label(shape)}, {EPOCHS[epoch]})"


def runs_below_noise() -> str:
    """TailSieve's runs below 0.97x stock verl, and below 1 - 2σ of their cell and epoch, σ the spread of one stock
    verl run against another with its own length draws (``verl-redraw``): what an A/B of two stock runs reads."""
    cells = default_cells().values()
    return (f"{sum(c['below_097'] for c in cells)} of {sum(c['seeds'] for c in cells)} runs below 0.97×, "
            f"{sum(c['below_noise'] for c in cells)} below 1 − 2σ of their cell")


def plan_skill(shape: str = "64x8@16384") -> str:
    """How well the planned probe foresees a split at ``shape``: over the default's runs there whose split steps were
    measured, the correlation of the plan's predicted relative makespan with the split steps' makespan over stock
    verl's on the same steps, and how many runs."""
    runs = [r for r in _judge_runs() if r["rule"] == "new" and r["shape"] == shape and "plan" in r and "truth" in r]
    return f"{np.corrcoef([r['plan'][0] for r in runs], [r['truth'] for r in runs])[0, 1]:.2f} over {len(runs)} runs"


def noise_below() -> str:
    """σ, one stock verl run against another with its own length draws, in the cells and epochs that hold a run of
    TailSieve below 0.97x stock verl."""
    return _span([c["noise"] for c in default_cells().values() if c["below_097"]])


def lowest_mean() -> str:
    """The lowest cell mean of any cell and epoch."""
    return f"{min(c['mean'] for c in default_cells().values()):.3f}"


def real_tails_dapo() -> str:
    return _span([c["mean"] for e in EPOCHS for c in _where(lambda s, t, shape: t == "real" and shape in DAPO_SHAPES, e)])


def weak_dense_share() -> str:
    shares = [(c["mean"] - 1) / (c["oracle"] - 1) for c in
              _where(lambda s, t, shape: _pays(s, t) and shape in DAPO_SHAPES)]
    return f"{min(shares) * 100:.0f}–{max(shares) * 100:.0f} %"


# --- speculation on every replica (simulated, assumed acceptance) ---

@cache
def strongest_stock() -> list[dict]:
    return json.loads((RESULTS / "strongest_stock" / "strongest_stock_64x8.json").read_text(encoding="utf-8"))


def _per_cell_mean(key) -> list[float]:
    rows = strongest_stock()
    return [float(np.mean([key(r) for r in rows if r["cell"] == cell])) for cell in dict.fromkeys(r["cell"] for r in rows)]


def mtp_stock_gain() -> str:
    return _span(_per_cell_mean(lambda r: r["speedup_vs_verl"][r["best_stock"]]), digits=1)


def mtp_tailsieve_vs_best_stock() -> str:
    split = _per_cell_mean(lambda r: r["speedup_vs_best_stock"]["tailsieve-spec"])
    one = _per_cell_mean(lambda r: r["speedup_vs_best_stock"]["tailsieve-spec m=1"])
    return _span(split + one, digits=2)


@cache
def breakeven() -> list[dict]:
    """Per rollout step (``scripts/experiments/spec_breakeven.py``): where speculation on every replica pays."""
    return json.loads((RESULTS / "speculation" / "breakeven.json").read_text(encoding="utf-8"))["per_rollout_step"]


def spec_breakeven_acceptance() -> str:
    """The flat per-position acceptance at which k = 3 with MTP's draft cost breaks even, over the cells."""
    return _span([r["break_even_acceptance_mtp_draft"] for r in breakeven()
                  if r["k"] == 3 and "break_even_acceptance_mtp_draft" in r], digits=2)


def spec_breakeven_overhead() -> str:
    """The extra cost per draft token (decode steps) at which the assumed acceptance stops paying."""
    return _span([r["assumed_break_even_overhead"] for r in breakeven() if "assumed_break_even_overhead" in r], digits=2)


# --- the tail presets, from the workload model itself ---

def _preset_ratios() -> dict[str, object]:
    """Each preset's spec and its P90/P50 (``real`` keeps the length model's own)."""
    sys.path.insert(0, str(ROOT))
    from tailsieve_verl.core.data.workload import PRESETS

    return {name: (spec, spec.tail_ratio if spec.tail_ratio is not None else spec.model_p90_ratio)
            for name, spec in PRESETS.items()}


def presets_table() -> str:
    lines = ["| preset | P90/P50 of response length | median | cap (default) |", "| --- | --- | --- | --- |"]
    for name, (spec, ratio) in _preset_ratios().items():
        lines.append(f"| `{name}` | {ratio:.1f} | {spec.median_len:.0f} tokens | {spec.max_response_length} tokens |")
    return "\n" + "\n".join(lines) + "\n"


def preset_ratio(name: str) -> str:
    return f"{_preset_ratios()[name][1]:.1f}"


# --- history: the 2026-12-03 table against stock verl (the controller before the planned probe) ---

@cache
def headline_2026_12_03() -> dict[str, dict[str, float]]:
    """Per cell, mean (and worst seed) speedup over stock verl of verl-redraw, tailsieve-fixed and tailsieve,
    best-static re-run on other draws, and the clairvoyant references."""
    folder = RESULTS / "controller_vs_stock_verl"
    cells: dict[str, dict[str, float]] = {}
    for scale, name in (("64x8", "no_starvation_64x8.json"), ("256x16", "no_starvation_256x16.json"),
                        ("oracle", "controller_v2_64x8_oracle_crn.json")):
        rows = json.loads((folder / name).read_text(encoding="utf-8"))
        for cell in dict.fromkeys(r["cell"] for r in rows):
            speedups = [r["speedup"] for r in rows if r["cell"] == cell]
            stats = cells.setdefault(f"{'64x8' if scale == 'oracle' else scale} {cell}", {})
            policies = (("clairvoyant-group", "clairvoyant-sample") if scale == "oracle" else
                        ("verl-redraw", "tailsieve-fixed", "tailsieve"))
            for policy in policies:
                stats[policy] = float(np.mean([s[policy] for s in speedups]))
                stats[policy + " worst"] = float(np.min([s[policy] for s in speedups]))
            if scale != "oracle":
                stats["best-static"] = float(np.mean([np.mean([v for k, v in s.items() if k.startswith("best-static (regen")])
                                                      for s in speedups]))
    return cells


def history_table_2026_12_03() -> str:
    cells = headline_2026_12_03()

    def mw(c, p):
        return f"{cells[c][p]:.3f} [{cells[c][p + ' worst']:.3f}]"

    lines = ["| setup, B × n / tails | noise floor: stock verl, other draws | TailSieve fixed (m = R/2) | "
             "TailSieve adaptive | best static (q, m), out of sample | clairvoyant group | clairvoyant sample |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    labels = {"dense": "dense 8 replicas", "moe": "MoE 4 replicas"}
    for setup in ("dense", "moe"):
        for tails in TAILS:
            c = f"64x8 {setup}-{tails}"
            lines.append(f"| {labels[setup]}, 64 × 8, {tails} | {mw(c, 'verl-redraw')} | {mw(c, 'tailsieve-fixed')} | "
                         f"{mw(c, 'tailsieve')} | {cells[c]['best-static']:.3f} | {cells[c]['clairvoyant-group']:.3f} | "
                         f"{cells[c]['clairvoyant-sample']:.3f} |")
    for setup in ("dense", "moe"):
        cs = [f"256x16 {setup}-{t}" for t in TAILS]

        def three(key):
            return " / ".join(f"{cells[x][key]:.3f}" for x in cs)

        lines.append(f"| {labels[setup]}, 256 × 16, weak / real / strong | {three('verl-redraw')} | "
                     f"{three('tailsieve-fixed')} | {three('tailsieve')} | {three('best-static')} | | |")
    return "\n" + "\n".join(lines) + "\n"


# --- later epochs: steps planned from the per-prompt record (scripts/experiments/record_plan.py) ---

RECORD_PLAN_FILES = {2: ("record_plan.jsonl", "record_plan_64x8.jsonl"), 3: ("record_plan_epoch3.jsonl",)}
HISTORY_ORACLE_FILES = {2: "history_oracle.jsonl", 3: "history_oracle_epoch3.jsonl"}  # record_plan.py --ceiling
ROUTING_CEILING_FILE = "routing_ceiling_epoch3.jsonl"  # record_plan.py --epoch 3 --ceiling group-oracle-split
RECORD_HISTORY_FILES = {2: "record_history_oracle.jsonl", 3: "record_history_oracle_epoch3.jsonl"}  # --ceiling
#   verl,record-history-oracle-split: the record-planned steps fed what any number of visits can tell
NOW = "tailsieve-record-off"  # record_plan.py's name for TailSieve with record planning off


@cache
def record_plan_cells(files: tuple[Path, ...] = ()) -> dict[tuple[str, str], dict]:
    """Per (shape, cell) of the later-epoch runs in ``files`` (default: the committed ones): seeds, the mean and
    worst speedups, the record's rho, planned and split steps, TailSieve's share of prompt-oracle-split's gain
    (None where that gain is < 5 %)."""
    files = files or _epoch_files(2)[0]
    rows = [r for path in files for r in _jsonl(path)]
    cells = {}
    for key in dict.fromkeys((r["shape"], r["cell"]) for r in rows):
        rs = [r for r in rows if (r["shape"], r["cell"]) == key]
        speed = {name: [r["speedup_vs_verl"][name] for r in rs] for name in rs[0]["speedup_vs_verl"]}
        mean = {name: float(np.mean(v)) for name, v in speed.items()}
        gain = mean["prompt-oracle-split"] - 1
        cells[key] = {"seeds": len(rs), "mean": mean, "worst": {k: min(v) for k, v in speed.items()},
                      "rho": float(np.mean([r["tailsieve"]["record_rho"] for r in rs])),
                      "planned": float(np.mean([r["tailsieve"]["planned_steps"] for r in rs])),
                      "split": float(np.mean([r["tailsieve"]["split_steps"] for r in rs])),
                      "steps": rs[0]["steps"], "aborted": float(np.mean([r["tailsieve"]["aborted_share"] for r in rs])),
                      "deferral": max(r["tailsieve"]["max_deferral_steps"] for r in rs),
                      "share": (mean["tailsieve"] - 1) / gain if gain >= 0.05 else None}
    return cells


def _epoch_files(epoch: int) -> tuple[tuple[Path, ...], Path]:
    """The later-epoch runs of ``epoch`` (record_plan.py, then its --ceiling)."""
    folder = RESULTS / "per_prompt_record"
    return tuple(folder / name for name in RECORD_PLAN_FILES[epoch]), folder / HISTORY_ORACLE_FILES[epoch]


@cache
def history_oracle_cells(epoch: int = 2) -> dict[tuple[str, str], dict]:
    """Per (shape, cell) of ``record_plan.py --ceiling``'s runs of ``epoch``: the mean speedups of prompt-oracle-split
    and history-oracle-split (the most any record of past lengths can plan) over all its seeds and over the seeds
    of that epoch's record-planning runs (``paired``), and the mean ρ of each predictor. A seed of both must read
    the same prompt-oracle-split in both: the same draws."""
    plan_files, path = _epoch_files(epoch)
    rows = _jsonl(path)
    planned = {(r["shape"], r["cell"], r["seed"]): r["speedup_vs_verl"] for f in plan_files for r in _jsonl(f)}
    cells = {}
    for key in dict.fromkeys((r["shape"], r["cell"]) for r in rows):
        rs = [r for r in rows if (r["shape"], r["cell"]) == key]
        paired = [r for r in rs if (*key, r["seed"]) in planned]
        for r in paired:
            if abs(r["speedup_vs_verl"]["prompt-oracle-split"] - planned[*key, r["seed"]]["prompt-oracle-split"]) > 1e-9:
                raise SystemExit(f"{path.name} {key} seed {r['seed']}: prompt-oracle-split is not the record-planning "
                                 "run's (other draws?)")

        def mean(runs: list) -> dict:
            return {name: float(np.mean([r["speedup_vs_verl"][name] for r in runs])) for name in rs[0]["speedup_vs_verl"]}

        cells[key] = {"mean": mean(rs), "paired": mean(paired) if paired else None, "seeds": len(rs),
                      "rho": {name: float(np.mean([r["rho"][name] for r in rs])) for name in rs[0]["rho"]}}
    return cells


def _cell_order(cells: dict) -> list:
    order = {cell: i for i, cell in enumerate(f"{s}-{t}" for s in SETUP_LABELS for t in TAILS)}
    return sorted(cells.items(), key=lambda kv: (-int(kv[0][0].split("x")[0]), order[kv[0][1]]))


def later_epochs_table(files: tuple[Path, ...] = ()) -> str:
    """docs/results.md's later-epoch table (and ``record_plan.py --report``'s, of its files)."""
    lines = ["| cell | shape | seeds | record ρ | TailSieve now [worst seed] | TailSieve, planned steps [worst seed] | "
             "record-oracle-split | history-oracle-split | prompt-oracle-split | share of its gain | planned / split steps |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    history = history_oracle_cells()
    for (shape, cell), c in _cell_order(record_plan_cells(files)):
        m, w = c["mean"], c["worst"]
        share = f"{c['share']:.0%}" if c["share"] is not None else "–"
        paired = history[shape, cell]["paired"] if (shape, cell) in history else None
        ceiling = f"{paired['history-oracle-split']:.3f}" if paired else "–"
        lines.append(f"| {cell} | {shape} | {c['seeds']} | {c['rho']:.2f} | {m[NOW]:.3f} [{w[NOW]:.3f}] | "
                     f"{m['tailsieve']:.3f} [{w['tailsieve']:.3f}] | {m['record-oracle-split']:.3f} | {ceiling} | "
                     f"{m['prompt-oracle-split']:.3f} | {share} | {c['planned']:.1f} / {c['split']:.1f} of {c['steps']} |")
    return "\n" + "\n".join(lines) + "\n"


@cache
def record_history_cells(epoch: int = 2) -> dict[tuple[str, str], dict]:
    """Per (shape, cell): record-history-oracle-split's mean speedup over its seeds and over the record-planning
    runs' seeds (``paired``), and prompt-oracle-split's on its seeds (from ``record_plan.py --ceiling``'s runs of
    the same jobs: the same draws)."""
    folder = RESULTS / "per_prompt_record"
    rows = _jsonl(folder / RECORD_HISTORY_FILES[epoch])
    job = ("cell", "shape", "seed", "steps", "warm", "trend", "pool")
    oracle = {tuple(r[k] for k in job): r["speedup_vs_verl"]["prompt-oracle-split"]
              for r in _jsonl(folder / HISTORY_ORACLE_FILES[epoch])}
    planned = {(r["shape"], r["cell"], r["seed"]) for f in _epoch_files(epoch)[0] for r in _jsonl(f)}
    cells = {}
    for key in dict.fromkeys((r["shape"], r["cell"]) for r in rows):
        rs = [r for r in rows if (r["shape"], r["cell"]) == key]
        missing = [r["seed"] for r in rs if tuple(r[k] for k in job) not in oracle]
        if missing:
            raise SystemExit(f"{RECORD_HISTORY_FILES[epoch]} {key}: seeds {missing} have no --ceiling run of the same job")
        speed = [r["speedup_vs_verl"]["record-history-oracle-split"] for r in rs]
        paired = [x for x, r in zip(speed, rs) if (*key, r["seed"]) in planned]
        cells[key] = {"mean": float(np.mean(speed)), "paired": float(np.mean(paired)) if paired else None,
                      "oracle": float(np.mean([oracle[tuple(r[k] for k in job)] for r in rs])), "seeds": len(rs)}
    return cells


def _ceiling_shares(epoch: int = 2) -> dict:
    """Per cell of ``epoch`` where prompt-oracle-split gains >= 5 %: history-oracle-split's and
    record-history-oracle-split's shares of that gain, and TailSieve's (record planning off, on) share of
    record-history-oracle-split's (on the record-planning runs' own seeds)."""
    planned, history = record_plan_cells(_epoch_files(epoch)[0]), history_oracle_cells(epoch)
    fed = record_history_cells(epoch)
    out = {}
    for key, c in _cell_order(planned):
        if c["share"] is None:
            continue
        every = history[key]["mean"]
        ceiling = fed[key]["paired"] - 1  # on the record-planning runs' own seeds
        out[key] = {"history": (every["history-oracle-split"] - 1) / (every["prompt-oracle-split"] - 1),
                    "fed": (fed[key]["mean"] - 1) / (fed[key]["oracle"] - 1),
                    "now": (c["mean"][NOW] - 1) / ceiling, "planned": (c["mean"]["tailsieve"] - 1) / ceiling,
                    "rho": c["rho"], "seeds": history[key]["seeds"]}
    return out


def later_epochs_ceiling_table() -> str:
    """The cells where the per-prompt oracle gains >= 5 %: what each predictor ranks, what a record can reach (the
    grid and TailSieve's own planned steps fed the best record), and how much of the latter TailSieve reaches in
    the second and the third epoch."""
    lines = ["| cell | shape | ρ: one group an epoch ago / all history / the prompt now | seeds | history-oracle-split | "
             "record-history-oracle-split | prompt-oracle-split | share of the oracle's gain: history-oracle-split / "
             "record-history-oracle-split | TailSieve's share of record-history-oracle-split's gain, epoch 2: now / "
             "planned (record ρ) | epoch 3: now / planned (record ρ) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    history, fed, third = history_oracle_cells(), record_history_cells(), _ceiling_shares(3)

    def shares(s: dict | None) -> str:
        return f"{s['now']:.0%} / {s['planned']:.0%} ({s['rho']:.2f})" if s else "–"

    for (shape, cell), share in _ceiling_shares().items():
        h = history[shape, cell]
        rho = " / ".join(f"{h['rho'][name]:.2f}" for name in ("one_visit", "history", "truth"))
        lines.append(f"| {cell} | {shape} | {rho} | {h['seeds']} | {h['mean']['history-oracle-split']:.3f} | "
                     f"{fed[shape, cell]['mean']:.3f} | {h['mean']['prompt-oracle-split']:.3f} | "
                     f"{share['history']:.0%} / {share['fed']:.0%} | {shares(share)} | "
                     f"{shares(third.get((shape, cell)))} |")
    return "\n" + "\n".join(lines) + "\n"


def later_epochs_ceiling_share() -> str:
    """The span of history-oracle-split's share of prompt-oracle-split's gain where that is >= 5 %, in the second
    and the third epoch."""
    return _span([100 * s["history"] for epoch in (2, 3) for s in _ceiling_shares(epoch).values()], 0, " to ") + " %"


def later_epochs_fed_share() -> str:
    """The span of record-history-oracle-split's share of prompt-oracle-split's gain where that is >= 5 %, in the
    second and the third epoch."""
    return _span([100 * s["fed"] for epoch in (2, 3) for s in _ceiling_shares(epoch).values()], 0, " to ") + " %"


def later_epochs_fed_short() -> str:
    """In how many (cell, epoch) pairs of the ceiling table record-history-oracle-split stays under 80 % of the
    per-prompt oracle's gain (issue 48's goal for TailSieve)."""
    fed = [s["fed"] for epoch in (2, 3) for s in _ceiling_shares(epoch).values()]
    return f"{sum(x < 0.8 for x in fed)} of {len(fed)}"


def later_epochs_fed_reached(epoch: int, key: str) -> str:
    """The span of TailSieve's share of record-history-oracle-split's gain in ``epoch`` (``key``: planned with
    record planning, now without), over the cells where the per-prompt oracle gains >= 5 %."""
    return _span([100 * s[key] for s in _ceiling_shares(epoch).values()], 0, " to ") + " %"


def _routing_ceiling_ratios() -> list[float]:
    """Third epoch: TailSieve's speedup (record planning off and on) over group-oracle-split's on the same seed."""
    ceiling = {(r["shape"], r["cell"], r["seed"]): r["speedup_vs_verl"]["group-oracle-split"]
               for r in _jsonl(RESULTS / "per_prompt_record" / ROUTING_CEILING_FILE)}
    return [r["speedup_vs_verl"][name] / ceiling[r["shape"], r["cell"], r["seed"]]
            for path in _epoch_files(3)[0] for r in _jsonl(path) if (r["shape"], r["cell"], r["seed"]) in ceiling
            for name in (NOW, "tailsieve")]


def later_epochs_routing_ceiling() -> str:
    ratios = _routing_ceiling_ratios()
    return f"{sum(x <= 1 for x in ratios)} of {len(ratios)} runs, at most {max(ratios):.3f}× its speedup"


def later_epochs_ladder_rho(name: str) -> str:
    """The span over the later-epoch cells of one predictor's ρ in ``record_plan.py --ceiling``'s ladder."""
    return _span([c["rho"][name] for epoch in (2, 3) for c in history_oracle_cells(epoch).values()], 2)


def later_epochs_share() -> str:
    """The span of TailSieve's share of the per-prompt oracle's gain over the later-epoch cells where it is >= 5 %."""
    shares = [c["share"] for c in record_plan_cells().values() if c["share"] is not None]
    return _span([100 * x for x in shares], 0, " to ") + " %"


def later_epochs_lowest() -> str:
    return f"{min(c['mean']['tailsieve'] for c in record_plan_cells().values()):.3f}"


def later_epochs_lowest_now() -> str:
    """The later-epoch cell where TailSieve with record planning off (the default) reads lowest: its mean, its cell."""
    (shape, cell), c = min(record_plan_cells().items(), key=lambda kv: kv[1]["mean"][NOW])
    return f"{c['mean'][NOW]:.3f}× stock verl ({cell.replace('-', ' ')} {_shape_label(shape)}, {c['seeds']} seeds)"


def later_epochs_rho() -> str:
    """The span over the second-epoch runs of TailSieve's record rho, two decimals."""
    rhos = [r["tailsieve"]["record_rho"] for path in _epoch_files(2)[0] for r in _jsonl(path)
            if r["tailsieve"]["record_rho"] is not None]
    return _span(rhos, 2)


YARDSTICK_FILE = RESULTS / "per_prompt_record" / "yardstick_check.jsonl"  # scripts/experiments/yardstick_check.py


def _yardstick_runs(files: tuple[Path, ...] = ()) -> list[dict]:
    return [r for path in (files or (YARDSTICK_FILE,)) for r in _jsonl(path)]


def yardstick_table(files: tuple[Path, ...] = ()) -> str:
    """Per (epoch, shape, cell) of yardstick_check.py's runs: TailSieve against stock verl, and on the runs' split
    steps the truth beside the consumed and the pulled batches' prices relative to stock verl's own batch."""
    runs = _yardstick_runs(files)
    lines = ["| epoch | cell | shape | runs with split steps | TailSieve vs stock verl, mean [worst run] | "
             "its split steps' makespan / stock verl's, mean [range] | consumed batch / stock's: mean ± s.e. [range] | "
             "pulled batch / stock's, mean |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key in sorted({(r["epoch"], r["shape"], r["cell"]) for r in runs},
                      key=lambda k: (k[0], -int(k[1].split("x")[0]), k[2])):
        rs = [r for r in runs if (r["epoch"], r["shape"], r["cell"]) == key]
        split = [r for r in rs if r["split_steps"]]
        speed = [r["speedup_vs_verl"] for r in rs]
        row = f"| {key[0]} | {key[2]} | {key[1]} | {len(split)} of {len(rs)} | {np.mean(speed):.3f} [{min(speed):.3f}] | "
        if not split:
            lines.append(row + "– | – | – |")
            continue
        truth, consumed = [r["truth"] for r in split], np.array([r["consumed_vs_stock"] for r in split])
        error = consumed.std(ddof=1) / np.sqrt(len(consumed)) if len(consumed) > 1 else float("nan")
        lines.append(row + f"{np.mean(truth):.3f} [{_span(truth)}] | {consumed.mean():.3f} ± {error:.3f} "
                     f"[{_span(consumed)}] | {np.mean([r['pulled_vs_stock'] for r in split]):.3f} |")
    return "\n" + "\n".join(lines) + "\n"


def judge_table(files: tuple[Path, ...] = ()) -> str:
    """Per (epoch, shape, cell) of judge_check.py's runs with both judges where either split: the default controller
    against stock verl under the judge it replaced (before) and under its judge (after), on the same draws, and what
    each judge read on the split steps of the runs where the old one split and the split lost (truth > 1)."""
    runs = _judge_runs(files)
    lines = ["| epoch | cell | shape | seeds | before: mean [worst run] | after: mean [worst run] | "
             "split steps before / after | runs whose split steps lost: truth / old read / new read (mean) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key in sorted({(r["epoch"], r["shape"], r["cell"]) for r in runs if r["rule"] == "old"},
                      key=lambda k: (k[0], SHAPES.index(k[1]), k[2])):
        old, new = ([r for r in runs if (r["epoch"], r["shape"], r["cell"], r["rule"]) == (*key, rule)]
                    for rule in ("old", "new"))
        if not any(r["split_steps"] for r in old + new):
            continue
        cells = [f"{np.mean([r['speedup_vs_verl'] for r in rs]):.3f} [{min(r['speedup_vs_verl'] for r in rs):.3f}]"
                 for rs in (old, new)]
        splits = " / ".join(f"{np.mean([r['split_steps'] for r in rs]):.1f}" for rs in (old, new))
        lost = [r for r in old if r.get("truth", 0) > 1]
        reads = (f"{len(lost)}: {np.mean([r['truth'] for r in lost]):.3f} / {np.mean([r['consumed_read'] for r in lost]):.3f}"
                 f" / {np.mean([r['fair_read'] for r in lost]):.3f}" if lost else "0")
        lines.append(f"| {key[0]} | {key[2]} | {key[1]} | {len(new)} | {cells[0]} | {cells[1]} | {splits} | {reads} |")
    return "\n" + "\n".join(lines) + "\n"


def judge_worst_old() -> str:
    """The worst run under the judge the controller replaced, what both judges read on its split steps, and the same
    draws under the controller's judge."""
    runs = _judge_runs()
    r = min((r for r in runs if r["rule"] == "old"), key=lambda r: r["speedup_vs_verl"])
    now = next(n for n in runs if n["rule"] == "new" and all(n[k] == r[k] for k in ("cell", "shape", "seed", "epoch")))
    reads = (f"; on its {r['split_steps']} split steps it ran {r['truth']:.3f}× stock verl's makespan, which the consumed "
             f"batches' price read as {r['consumed_read']:.3f}× one shared pool and the pulls' price as "
             f"{r['fair_read']:.3f}×" if "truth" in r else "")
    return (f"{r['cell']} {_shape_label(r['shape'])}, seed {r['seed']}, {EPOCHS[r['epoch']]}: {r['speedup_vs_verl']:.3f}× "
            f"stock verl{reads}; under the judge, {now['speedup_vs_verl']:.3f}× with {now['split_steps']} split steps")


CLI_RECURRING_FILE = RESULTS / "at_worst_stock_verl" / "cli_recurring.jsonl"  # scripts/experiments/cli_recurring.py


def cli_recurring() -> str:
    """cli_recurring.py's runs of the controller's judge per tail preset: mean [worst run] and the runs below 0.97×
    stock verl."""
    runs = [r for r in _jsonl(CLI_RECURRING_FILE) if r["rule"] == "new"]
    parts = []
    for workload in dict.fromkeys(r["workload"] for r in runs):
        speed = [r["speedup_vs_verl"] for r in runs if r["workload"] == workload]
        parts.append(f"{workload} tails {np.mean(speed):.3f}× [{min(speed):.3f}], {sum(x < 0.97 for x in speed)} of "
                     f"{len(speed)} runs below 0.97×")
    return "; ".join(parts)


def yardstick_worst() -> str:
    """The worst run of yardstick_check.py: its speedup, its split steps' truth and the controller's verdict."""
    r = min(_yardstick_runs(), key=lambda r: r["speedup_vs_verl"])
    return (f"{r['cell']} {_shape_label(r['shape'])}, seed {r['seed']}, epoch {r['epoch']}: {r['speedup_vs_verl']:.3f}× "
            f"stock verl; on its {r['split_steps']} split steps {r['truth']:.3f}× stock verl's makespan, while the batches "
            f"it consumed priced {r['consumed_vs_stock']:.3f}× stock verl's own, so its yardstick read the split at "
            f"{r['truth'] / r['consumed_vs_stock']:.3f}")


def planner_cost() -> str:
    """The step planner's CPU seconds per 512 x 16 step on 8 and 16 replicas, with the record's error draws."""
    rows = [r for r in _jsonl(RESULTS / "per_prompt_record" / "planner_cost.jsonl") if r["spread"] > 0]
    return " and ".join(f"{r['cpu_s_mean']:.1f} CPU s on {r['replicas']} replicas" for r in rows)



SPEED_BENCH_FILE = RESULTS / "engine_model" / "speed_bench_512x16_jobs.txt"  # scripts/bench_speed.py's output


def speed_bench() -> str:
    """bench_speed.py's side-by-side runs in the speed bench file (before -> after): CPU seconds on one core, wall
    seconds on 2 processes (the CLI's default --jobs on 2 cores)."""
    runs: dict[tuple[str, str], dict[str, tuple[float, float]]] = {}
    mode = ""
    for line in SPEED_BENCH_FILE.read_text().splitlines():
        if line.startswith("512 x 16"):  # a run's header: how many processes each side had
            mode = "one core" if line.endswith("one core each") else "2 cores"
        fields = line.split()
        if len(fields) > 4 and fields[0] in ("default", "plan-quick", "plan") and fields[1] in ("before", "after"):
            runs.setdefault((mode, fields[0]), {})[fields[1]] = (float(fields[2]), float(fields[3]))
    labels = {"default": "30 steps of the default policies", "plan-quick": "a 3-step plan of one logged step",
              "plan": "the 30-step, 5-seed plan"}
    one = [f"{labels[name]} {r['before'][0]:.1f} → {r['after'][0]:.1f} CPU s" for (mode, name), r in runs.items()
           if mode == "one core"]
    two = [f"{labels[name]} {r['before'][1]:.1f} → {r['after'][1]:.1f} s" for (mode, name), r in runs.items()
           if mode == "2 cores"]
    return f"on one core, {'; '.join(one)}; wall on 2 cores, {'; '.join(two)}"


# --- issue 58: a tensor-parallel tail pool, the model and its ceiling ---

TP_FOLDER = RESULTS / "tp_ceiling"
TP_GPUS = {"dense": 8, "dense8b": 8, "moe": 4, "moe8": 8}  # each setup's GPUs (tp_ceiling.py's SETUPS)


def tp_model_table() -> str:
    """The TP step model (``tp_ceiling.py --model``): ms per decode step at each width beside the one-GPU rows of
    the bundled H200 table it derives from (– where the table has no such row: extrapolated)."""
    doc = json.loads((TP_FOLDER / "tp_model.json").read_text())
    rows = doc["rows"]
    points = list(dict.fromkeys((r["context"], r["batch"]) for r in rows))
    head = " | ".join(f"b{b} @ {c // 1024}k" for c, b in points)
    lines = [f"| model | width | floor ms | KV tokens | {head} |", "| --- " * (4 + len(points)) + "|"]
    for setup in dict.fromkeys(r["setup"] for r in rows):
        mine = [r for r in rows if r["setup"] == setup]
        first = {(r["context"], r["batch"]): r for r in mine if r["width"] == 1}
        table = " | ".join("–" if first[p]["table_ms"] is None else f"{first[p]['table_ms']:.2f}" for p in points)
        lines.append(f"| {mine[0]['model']} | H200 table (measured) | – | – | {table} |")
        for t in dict.fromkeys(r["width"] for r in mine):
            at = {(r["context"], r["batch"]): r for r in mine if r["width"] == t}
            one = at[points[0]]
            lines.append(f"| {mine[0]['model']} | {t} | {one['floor_ms']:.2f} | {one['kv_tokens']:,} | "
                         + " | ".join(f"{at[p]['step_ms']:.2f}" for p in points) + " |")
    return "\n" + "\n".join(lines) + "\n"


def tp_floors() -> str:
    """Each bundled shape's step floor (what no width shortens) beside its measured batch-1 step at 4k context."""
    rows = [r for r in json.loads((TP_FOLDER / "tp_model.json").read_text())["rows"]
            if r["width"] == 2 and r["batch"] == 1 and r["context"] == 4096]
    return " and ".join(f"{r['floor_ms']:.2f} of {r['model']}'s {r['table_ms']:.2f} ms" for r in rows)


def tp_ceiling_cells(files: tuple[Path, ...] = ()) -> dict[tuple[str, str], dict]:
    """Per (shape, cell) of ``tp_ceiling.py``'s runs: each configuration's speedup over the strongest stock
    configuration (per seed the best stock single width, cap included), mean over seeds; per family (stock, splits
    with a width-1 bulk and a wide tail, splits at any widths, PAT-like from any start) its best configuration."""
    rows = [r for path in (files or (TP_FOLDER / "tp_ceiling.jsonl",)) for r in _jsonl(path)]
    cells = {}
    for key in dict.fromkeys((r["shape"], r["cell"]) for r in rows):
        rs = [r for r in rows if (r["shape"], r["cell"]) == key]
        names = list(rs[0]["mean_makespan_s"])
        stock = [n for n in names if n.startswith("verl-")]
        best_stock = [min(r["mean_makespan_s"][n] for n in stock) for r in rs]
        over = {n: float(np.mean([b / r["mean_makespan_s"][n] for b, r in zip(best_stock, rs)])) for n in names}
        free = {n: float(np.mean([b / r["pat_free_switch_s"][n] for b, r in zip(best_stock, rs)]))
                for n in rs[0]["pat_free_switch_s"]}

        def best(prefix: str, keep=lambda n: True):
            return max((n for n in names if n.startswith(prefix) and keep(n)), key=over.get, default=None)

        cells[key] = {"seeds": len(rs), "steps": rs[0]["steps"], "over": over, "free": free,
                      "stock": best("verl-"), "wide_tail": best("split-b1t", lambda n: n != "split-b1t1"),
                      "split": best("split-"), "pat": best("pat-")}
    return cells


def _tp_reach(c: dict) -> float:
    """The most a cell's ceilings reach over the strongest stock configuration: its best split or PAT-like."""
    return max(c["over"][n] for n in (c["split"], c["pat"]) if n)


def tp_goal_reach() -> str:
    """The span, over the issue's goal cells (real tails, DAPO shapes), of the most any ceiling reaches."""
    return _span([_tp_reach(c) for (shape, cell), c in tp_ceiling_cells().items()
                  if cell.endswith("-real") and not cell.startswith("dense-") and shape in DAPO_SHAPES])


def tp_uniform_gain(setups: tuple[str, ...]) -> str:
    """The span, over the cells of ``setups``, of the strongest single width's speedup over stock verl at width 1."""
    return _span([1 / c["over"]["verl-tp1"] for (_, cell), c in tp_ceiling_cells().items()
                  if cell.split("-")[0] in setups], digits=2)


def tp_reach_cells() -> str:
    """Which cells' ceilings reach 1.10x the strongest stock configuration, of how many."""
    cells = tp_ceiling_cells()
    hits = [f"{cell} {shape.split('@')[0].replace('x', ' × ')}" for (shape, cell), c in cells.items()
            if _tp_reach(c) >= 1.10]
    return f"{len(hits)} of {len(cells)} cells ({', '.join(hits)})"


def tp_ceiling_table(files: tuple[Path, ...] = ()) -> str:
    """docs/results.md's ceiling of width (and ``tp_ceiling.py --report``'s, of its files): speedups over the
    strongest stock configuration, the winning configuration in brackets."""
    lines = ["| cell | shape | seeds × steps | stock TP1 / TP2 / TP4 / TP8 (max_num_seqs 256·t) | strongest stock | "
             "clairvoyant split, TP1 bulk and tail | "
             "clairvoyant split, TP1 bulk, wide tail | clairvoyant split, any widths | PAT-like [switch free] | "
             "≥ 1.10× the strongest stock within reach |",
             "| --- " * 10 + "|"]
    for (shape, cell), c in tp_ceiling_cells(files).items():
        o = c["over"]

        def cite(name):
            return "–" if name is None else f"{o[name]:.3f} ({name.split('-', 1)[1]})"

        reach = _tp_reach(c)
        widths = " / ".join(f"{o[n]:.3f}" if n in o else "–" for n in
                            ["verl-tp1", *(f"verl-tp{t}-seqs{256 * t}" for t in (2, 4, 8))])
        lines.append(f"| {cell} | {shape} | {c['seeds']} × {c['steps']} | {widths} | "
                     f"{o[c['stock']]:.3f} ({c['stock'][5:]}) | {o['split-b1t1']:.3f} | {cite(c['wide_tail'])} | "
                     f"{cite(c['split'])} | {cite(c['pat'])} [{c['free'][c['pat']]:.3f}] | "
                     f"{'yes' if reach >= 1.10 else 'no'} ({reach:.3f}) |")
    return "\n" + "\n".join(lines) + "\n"


def tp_tailsieve_cells(files: tuple[Path, ...] = ()) -> dict[tuple[str, str], dict]:
    """Per (shape, cell) of ``tp_ceiling.py --tailsieve``'s runs: TailSieve's default controller over stock verl at
    each single width (mean over seeds), and at each seed's strongest stock width (where it leaves two replicas)."""
    rows = [r for path in (files or (TP_FOLDER / "tp_tailsieve.jsonl",)) for r in _jsonl(path)]
    cells = {}
    for key in dict.fromkeys((r["shape"], r["cell"]) for r in rows):
        rs = [r for r in rows if (r["shape"], r["cell"]) == key]
        names = list(rs[0]["mean_makespan_s"])
        stock = {int(n.split("-")[1][2:]): n for n in names if n.startswith("verl-")}
        tailsieve = {int(n.removeprefix("tailsieve-tp")): n for n in names if n.startswith("tailsieve-")}
        at_width = {t: float(np.mean([r["mean_makespan_s"][stock[t]] / r["mean_makespan_s"][n] for r in rs]))
                    for t, n in tailsieve.items()}
        strongest = [min(stock, key=lambda t: r["mean_makespan_s"][stock[t]]) for r in rs]
        on_strongest = [r["mean_makespan_s"][stock[t]] / r["mean_makespan_s"][tailsieve[t]]
                        for r, t in zip(rs, strongest) if t in tailsieve]
        best = [min(r["mean_makespan_s"][stock[t]] for t in stock) / min(r["mean_makespan_s"][n] for n in
                                                                        tailsieve.values()) for r in rs]
        cells[key] = {"seeds": len(rs), "steps": rs[0]["steps"], "gpus": TP_GPUS[key[1].split("-")[0]],
                      "at_width": at_width,
                      "best_over_strongest": float(np.mean(best)),
                      "strongest": max(set(strongest), key=strongest.count),
                      "on_strongest": float(np.mean(on_strongest)) if on_strongest else None,
                      "deferral": max(d for r in rs for d in r["max_deferral_steps"].values())}
    return cells


def tp_tailsieve_table(files: tuple[Path, ...] = ()) -> str:
    """docs/results.md's TailSieve at each single width against stock verl at the same width (and
    ``tp_ceiling.py --tailsieve --report``'s, of its files)."""
    cells = tp_tailsieve_cells(files)
    order = list(tp_ceiling_cells())  # the ceiling table's rows
    cells = dict(sorted(cells.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    widths = sorted({t for c in cells.values() for t in c["at_width"]})
    lines = ["| cell | shape | seeds × steps | strongest stock width (GPUs) | TailSieve at it over stock there | "
             + " | ".join(f"TailSieve TP{t} over stock TP{t}" for t in widths)
             + " | TailSieve at its best width over the strongest stock | max deferral |",
             "| --- " * (7 + len(widths)) + "|"]
    for (shape, cell), c in cells.items():
        on = ("– (one replica)" if c["on_strongest"] is None else f"{c['on_strongest']:.3f}")
        lines.append(f"| {cell} | {shape} | {c['seeds']} × {c['steps']} | TP{c['strongest']} ({c['gpus']}) | {on} | "
                     + " | ".join(f"{c['at_width'][t]:.3f}" if t in c["at_width"] else "–" for t in widths)
                     + f" | {c['best_over_strongest']:.3f} | {c['deferral']} |")
    return "\n" + "\n".join(lines) + "\n"


def tp_tailsieve_lowest() -> str:
    """TailSieve's lowest ratio to stock verl at the same width over every cell and width, where it is below 1, and
    every (cell, width) below 0.99."""
    at = [(x, t, cell, shape) for (shape, cell), c in tp_tailsieve_cells().items() for t, x in c["at_width"].items()]
    x, t, cell, shape = min(at)
    where = f" (TP{t}, {cell} {shape.split('@')[0].replace('x', ' × ')})" if round(x, 3) < 1 else ""
    below = [f"{cell} {shape.split('@')[0].replace('x', ' × ')} at TP{t}, {y:.3f}" for y, t, cell, shape in at
             if y < 0.99]
    return f"{x:.3f}{where}; below 0.99: {'; '.join(below) if below else 'none'}"


def tp_tailsieve_on_strongest() -> str:
    """The span, over the cells where TailSieve runs at the strongest stock width, of its ratio to stock there."""
    return _span([c["on_strongest"] for c in tp_tailsieve_cells().values() if c["on_strongest"] is not None])


def tp_tailsieve_cpu() -> str:
    """What ``tp_ceiling.py --tailsieve``'s recorded jobs cost."""
    rows = _jsonl(TP_FOLDER / "tp_tailsieve.jsonl")
    return f"{sum(r['cpu_s'] for r in rows) / 60:.0f} CPU min for its {len(rows)} jobs"


def tp_tailsieve_one_replica() -> str:
    """How many cells' strongest stock width leaves one replica (no TailSieve split), of how many."""
    cells = tp_tailsieve_cells()
    return f"{sum(c['on_strongest'] is None for c in cells.values())} of {len(cells)}"


RENDERERS = {
    "current-table": current_table,
    "current-seeds": current_seeds,
    "current-detail": current_detail,
    "weak-dense-dapo": weak_dense_dapo,
    "weak-dense-dapo-later": lambda: weak_dense_dapo(2),
    "weak-dense-64x8": weak_dense_64x8,
    "weak-dense-64x8-later": lambda: weak_dense_64x8(2),
    "weak-dense-share": weak_dense_share,
    "elsewhere-span": elsewhere_span,
    "elsewhere-span-later": lambda: elsewhere_span(2),
    "elsewhere-count": elsewhere_count,
    "elsewhere-oracle-gain": elsewhere_oracle_gain,
    "lowest-run": lowest_run,
    "runs-below-noise": runs_below_noise,
    "noise-below": noise_below,
    "plan-skill-64x8": plan_skill,
    "lowest-mean": lowest_mean,
    "judge-table": judge_table,
    "judge-worst-old": judge_worst_old,
    "cli-recurring": cli_recurring,
    "real-tails-dapo": real_tails_dapo,
    "mtp-stock-gain": mtp_stock_gain,
    "mtp-tailsieve-vs-best-stock": mtp_tailsieve_vs_best_stock,
    "spec-breakeven-acceptance": spec_breakeven_acceptance,
    "spec-breakeven-overhead": spec_breakeven_overhead,
    "presets": presets_table,
    "preset-weak": lambda: preset_ratio("weak"),
    "preset-real": lambda: preset_ratio("real"),
    "preset-strong": lambda: preset_ratio("strong"),
    "history-2026-12-03": history_table_2026_12_03,
    "later-epochs": later_epochs_table,
    "later-epochs-share": later_epochs_share,
    "later-epochs-lowest": later_epochs_lowest,
    "later-epochs-rho": later_epochs_rho,
    "later-epochs-ceiling": later_epochs_ceiling_table,
    "later-epochs-ceiling-share": later_epochs_ceiling_share,
    "later-epochs-one-visit-rho": lambda: later_epochs_ladder_rho("one_visit"),
    "later-epochs-history-rho": lambda: later_epochs_ladder_rho("history"),
    "later-epochs-truth-rho": lambda: later_epochs_ladder_rho("truth"),
    "later-epochs-routing-ceiling": later_epochs_routing_ceiling,
    "later-epochs-lowest-now": later_epochs_lowest_now,
    "later-epochs-fed-share": later_epochs_fed_share,
    "later-epochs-fed-short": later_epochs_fed_short,
    "later-epochs-fed-planned-2": lambda: later_epochs_fed_reached(2, "planned"),
    "later-epochs-fed-planned-3": lambda: later_epochs_fed_reached(3, "planned"),
    "later-epochs-fed-now-2": lambda: later_epochs_fed_reached(2, "now"),
    "later-epochs-fed-now-3": lambda: later_epochs_fed_reached(3, "now"),
    "yardstick-check": yardstick_table,
    "yardstick-worst": yardstick_worst,
    "planner-cost": planner_cost,
    "speed-bench": speed_bench,
    "tp-model": tp_model_table,
    "tp-floors": tp_floors,
    "tp-goal-reach": tp_goal_reach,
    "tp-uniform-gain-dense": lambda: tp_uniform_gain(("dense", "dense8b")),
    "tp-uniform-gain-moe": lambda: tp_uniform_gain(("moe", "moe8")),
    "tp-reach-cells": tp_reach_cells,
    "tp-ceiling": tp_ceiling_table,
    "tp-tailsieve": tp_tailsieve_table,
    "tp-tailsieve-lowest": tp_tailsieve_lowest,
    "tp-tailsieve-on-strongest": tp_tailsieve_on_strongest,
    "tp-tailsieve-one-replica": tp_tailsieve_one_replica,
    "tp-tailsieve-cpu": tp_tailsieve_cpu,
}


def render(text: str) -> tuple[str, list[str]]:
    """``text`` with every block re-rendered, and the problems found: stale or unknown blocks."""
    problems = []

    def one(match: re.Match) -> str:
        name, body = match["name"], match["body"]
        if name not in RENDERERS:
            problems.append(f"unknown block numbers:{name} (known: {', '.join(RENDERERS)})")
            return match[0]
        fresh = RENDERERS[name]()
        if fresh != body:
            text_line, source_line = next(((a, b) for a, b in zip(body.splitlines() + [""], fresh.splitlines() + [""])
                                           if a != b), (body, fresh))
            problems.append(f"stale block numbers:{name}: the text reads {text_line.strip()!r}, its source "
                            f"gives {source_line.strip()!r}")
        return f"<!-- numbers:{name} -->{fresh}<!-- /numbers -->"

    return BLOCK.sub(one, text), problems


def hand_figures(text: str) -> list[str]:
    """Measured figures (three decimals) outside generated blocks and code fences: typed by hand."""
    bare = CODE_FENCE.sub("", BLOCK.sub("", text))
    return [f"a figure typed by hand: {m[0]!r} in {line.strip()[:70]!r}"
            for line in bare.splitlines() for m in HAND_FIGURE.finditer(line)]


def check_page(path: Path, strict: bool) -> tuple[str, list[str]]:
    """The page re-rendered and its problems; ``strict`` also flags hand-typed figures (the README)."""
    text = path.read_text(encoding="utf-8")
    fresh, problems = render(text)
    if strict:
        problems += hand_figures(text)
    return fresh, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 naming every stale block")
    mode.add_argument("--write", action="store_true", help="rewrite every block from its source")
    ap.add_argument("--pages", nargs="+", type=Path, default=[ROOT / p for p in PAGES],
                    help="pages to render (default: the README and docs/)")
    args = ap.parse_args(argv)
    failed = False
    for page in args.pages:
        if not page.exists():
            print(f"{page}: no such page", file=sys.stderr)
            return 2
        fresh, problems = check_page(page, strict=page.name in STRICT_PAGES)
        if args.write and fresh != page.read_text(encoding="utf-8"):
            page.write_text(fresh, encoding="utf-8")
            problems = [p for p in problems if not p.startswith("stale")]
        for problem in problems:
            print(f"{page.name}: {problem}")
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
