"""Plots of a closed-loop simulation: per-step makespan per policy, (q, m) trajectories, and a
per-replica Gantt chart of one step."""

from __future__ import annotations

import os
from pathlib import Path

from ..core.kinds import Pool
from ..core.simulation.sim import SimResult

COLORS = {"verl": "#000000", "uniform": "#7f7f7f", "tailsieve-fixed": "#1f77b4", "tailsieve": "#d62728",
          "clairvoyant-group": "#2ca02c", "clairvoyant-sample": "#98df8a", "best-static": "#9467bd"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _subtitle(result: SimResult) -> str:
    c = result.config
    return f"{result.workload}, R={c.n_replicas}, B={c.batch_size}×{c.n}, {result.perf}"


def plot_makespans(result: SimResult, path: str | os.PathLike) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.0, 4.0), dpi=120)
    for name, r in result.policies.items():
        ax.plot([x.step for x in r.records], r.makespans, label=f"{name} (mean {r.mean_makespan_s:.1f} s)",
                color=COLORS.get(name), linewidth=1.3)
    ax.set_xlabel("training step")
    ax.set_ylabel("rollout makespan (s)")
    ax.set_title(f"Per-step makespan — {_subtitle(result)}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_trajectories(result: SimResult, path: str | os.PathLike) -> None:
    """q (groups isolated) and m (tail replicas) chosen for each step by the TailSieve policies."""
    plt = _plt()
    fig, (ax_q, ax_m) = plt.subplots(2, 1, figsize=(7.0, 4.8), dpi=120, sharex=True)
    for name, r in result.policies.items():
        if not name.startswith("tailsieve"):
            continue
        steps = [x.step for x in r.records]
        ax_q.step(steps, [x.q for x in r.records], where="post", label=name, color=COLORS.get(name))
        ax_m.step(steps, [x.m for x in r.records], where="post", label=name, color=COLORS.get(name))
    ax_q.set_ylabel("q (groups carried)")
    ax_m.set_ylabel("m (tail replicas)")
    ax_m.set_xlabel("training step")
    ax_m.set_ylim(-0.2, result.config.n_replicas - 0.8)
    ax_q.set_title(f"Controller trajectories — {_subtitle(result)}", fontsize=9)
    for ax in (ax_q, ax_m):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_gantt(result: SimResult, path: str | os.PathLike, policies: tuple[str, ...] | None = None) -> None:
    """Per-replica timeline of the kept step: one bar per sample, ending when it finished or was aborted."""
    plt = _plt()
    names = [n for n in (policies or tuple(result.policies)) if n in result.policies]
    R = result.config.n_replicas
    fig, axes = plt.subplots(len(names), 1, figsize=(7.0, 1.0 + 1.3 * len(names)), dpi=120, squeeze=False)
    span_max = max(max((s.finish_s for s in result.policies[n].records[-1].spans), default=1.0) for n in names) \
        if names else 1.0
    for ax, name in zip(axes[:, 0], names):
        record = next((x for x in result.policies[name].records if x.spans), result.policies[name].records[-1])
        by_replica: dict[int, list] = {}
        for span in record.spans:
            by_replica.setdefault(span.replica, []).append(span)
        for r, spans in by_replica.items():
            for j, span in enumerate(sorted(spans, key=lambda s: s.finish_s)):
                color = "#d62728" if span.route == Pool.TAIL else ("#bbbbbb" if span.aborted else "#1f77b4")
                ax.plot([0, span.finish_s], [r + 0.8 * j / max(1, len(spans)) - 0.4] * 2, color=color, linewidth=0.8)
        ax.axvline(record.makespan_s, color="black", linestyle="--", linewidth=0.8)
        ax.set_yticks(range(R))
        ax.set_ylim(-0.6, R - 0.4)
        ax.set_xlim(0, span_max * 1.02)
        ax.set_ylabel("replica", fontsize=8)
        ax.set_title(f"{name}: step {record.step}, makespan {record.makespan_s:.1f} s, q={record.q}, m={record.m} "
                     "(red tail, blue bulk, grey aborted)", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the step started")
    fig.suptitle(f"Per-replica Gantt — {_subtitle(result)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_plots(result: SimResult, out_dir: str | os.PathLike) -> list[Path]:
    """Write the three plots into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "makespan_per_step.png", out / "controller_trajectories.png", out / "gantt_step.png"]
    plot_makespans(result, paths[0])
    plot_trajectories(result, paths[1])
    plot_gantt(result, paths[2])
    return paths
