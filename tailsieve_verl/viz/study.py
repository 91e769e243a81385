"""CDF of optimality gaps from an offline routing study (the paper's §2.2 figure: best-k vs baselines)."""

from __future__ import annotations

import os

import numpy as np

from ..core.routing.study import STUDY_POLICIES, StudyResult


def plot_gap_cdf(result: StudyResult, path: str | os.PathLike) -> None:
    """Write a PNG with one empirical CDF of gap-to-optimum (%) per study policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = result.config
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for policy in STUDY_POLICIES:
        gaps = np.sort(result.gaps(policy)) * 100.0
        share = np.arange(1, len(gaps) + 1) / len(gaps)
        ax.step(np.concatenate([[0.0], gaps]), np.concatenate([[0.0], share]), where="post", label=policy)
    bound_gaps = np.sort(result.gaps("best-k", to_bound=True)) * 100.0
    share = np.arange(1, len(bound_gaps) + 1) / len(bound_gaps)
    ax.step(np.concatenate([[0.0], bound_gaps]), np.concatenate([[0.0], share]), where="post", color="C0",
            linestyle="--", label="best-k vs proven lower bound")
    ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("gap to best-known optimum (%)")
    ax.set_ylabel("share of instances")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0.0)
    summary = result.summary()["oracle"]
    ax.set_title(f"{config.instances} instances × {config.trajectories} trajectories (groups of "
                 f"{config.group_size}), R={config.replicas}, {config.workload}\n{config.perf_model}; "
                 f"optimum proven on {summary['proven_optimal']}/{summary['instances']}", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
