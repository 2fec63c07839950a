"""The learning curve of a run as a PNG: the training batch's reward and success per step, and the held-out
evaluations (``runtime/evaluation.py``) as points at their policy versions; OPD runs add the reverse KL.

Drawn at the end of a run next to ``history.json`` (``RunContext.save_history``) with matplotlib's Agg backend
(no display). matplotlib is optional (``pip install -e .[plot]``; the quickstart installs it): without it the
curve is not drawn and one line says so — the numbers are in ``history.json`` / ``eval.json`` either way.
"""

from __future__ import annotations

import logging

log = logging.getLogger("megatron_tsync")


def learning_curve(history: list[dict], evals: list[dict], path: str, *, title: str = "") -> str | None:
    """Writes the PNG at ``path``; returns it, or None (nothing to draw, or no matplotlib: one line printed)."""
    if not history:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        print("[tsync] learning curve not drawn: matplotlib is not installed (pip install matplotlib); the numbers "
              "are in history.json", flush=True)
        return None
    steps = [r["step"] for r in history]  # step k's batch was sampled from θ_k: version k
    kl = [r.get("reverse_kl") for r in history]
    fig, axes = plt.subplots(1, 2 if any(v is not None for v in kl) else 1, figsize=(9, 4), squeeze=False)
    ax = axes[0][0]
    reward, success = [r.get("reward") for r in history], [r.get("success_rate") for r in history]
    if reward == success:  # binary rewards: one line
        ax.plot(steps, success, label="train batch success (= reward)", linewidth=1)
    else:
        for ys, label in ((reward, "train batch reward"), (success, "train batch success")):
            if any(y is not None for y in ys):
                ax.plot(steps, ys, label=label, linewidth=1)
    if evals:
        ax.plot([e["version"] for e in evals], [e["success_rate"] for e in evals], "o-", color="black",
                label=f"held-out success ({evals[-1]['prompts']} prompts, "
                      f"{'greedy' if evals[-1].get('greedy', True) else 'sampled'})")
    ax.set_xlabel("policy version (optimizer steps)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    if axes.shape[1] > 1:
        axes[0][1].plot(steps, kl, color="tab:red", linewidth=1)
        axes[0][1].set_xlabel("policy version (optimizer steps)")
        axes[0][1].set_ylabel("reverse KL to the teacher")
        axes[0][1].grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
