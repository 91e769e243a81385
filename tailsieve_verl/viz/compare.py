"""Per-step curves of compared runs: generation time, step time, reward, mean response length."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..tools.run_logs import COMPARED, GEN_TIME, REWARD, RESPONSE_LENGTH, STEP_TIME, RunLog, RunSummary

TITLES = {
    GEN_TIME: "generation time per step (s)",
    STEP_TIME: "step time (s)",
    REWARD: "reward (critic/score/mean)",
    RESPONSE_LENGTH: "mean response length (tokens)",
}


def plot_compare(runs: Sequence[RunLog], summaries: Sequence[RunSummary], steps: Sequence[int],
                 path: str | Path) -> Path:
    """A 2×2 figure of the compared metrics over the common steps; legends carry the speedups and
    their intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for ax, key in zip(axes.flat, COMPARED):
        for run, summary in zip(runs, summaries):
            label = run.name
            if key in (GEN_TIME, STEP_TIME):
                speedup = summary.gen_speedup if key == GEN_TIME else summary.step_speedup
                interval = summary.gen_interval if key == GEN_TIME else summary.step_interval
                label = f"{run.name} ({speedup:.2f}x"
                if interval is not None and interval.steps >= 2:
                    label += f", {interval.confidence * 100:.4g}% [{interval.low:.2f}, {interval.high:.2f}] {interval.verdict}"
                label += ")"
            ax.plot(list(steps), run.values(key, steps), marker="o", markersize=3, label=label)
        ax.set_title(TITLES[key], fontsize=10)
        ax.grid(alpha=0.3)
        if any(np.isfinite(run.values(key, steps)).any() for run in runs):
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, f"'{key}' not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in axes[1]:
        ax.set_xlabel("training step")
    fig.suptitle(f"{summaries[0].name} (baseline) vs " + ", ".join(s.name for s in summaries[1:]), fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
