"""Draws the simulator's slot-occupancy timelines: one panel per policy, slots x steps.

Each request has its own colour; a faded, hatched bar is a slot held by a finished request that
waits for the rest of its static batch; white is an idle slot. Head-of-line blocking shows at a
glance. matplotlib is imported lazily so the scheduler core never needs it.
"""

from __future__ import annotations

from pathlib import Path

from scheduler.simulator import SLOT_HELD, SLOT_IDLE, SimResult


def _runs(row_states: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """Collapse one slot's per-step (request, state) into (start, length, request, state) runs."""
    runs: list[tuple[int, int, int, int]] = []
    for step, (req, state) in enumerate(row_states):
        if (
            runs
            and runs[-1][2] == req
            and runs[-1][3] == state
            and runs[-1][0] + runs[-1][1] == step
        ):
            start, length, _, _ = runs[-1]
            runs[-1] = (start, length + 1, req, state)
        else:
            runs.append((step, 1, req, state))
    return [r for r in runs if r[3] != SLOT_IDLE]


def plot_occupancy(results: list[SimResult], path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    num_steps = max(r.num_steps for r in results)
    fig, axes = plt.subplots(
        len(results),
        1,
        figsize=(12, 1.2 + 0.45 * sum(r.num_slots for r in results)),
        sharex=True,
        squeeze=False,
    )
    cmap = plt.get_cmap("tab20")
    for ax, result in zip(axes[:, 0], results, strict=True):
        for slot in range(result.num_slots):
            cells = [row[slot] for row in result.occupancy]
            for start, length, req, state in _runs(cells):
                held = state == SLOT_HELD
                ax.broken_barh(
                    [(start, length)],
                    (slot + 0.1, 0.8),
                    facecolors=cmap(req % 20),
                    alpha=0.3 if held else 1.0,
                    hatch="///" if held else None,
                    edgecolor="white",
                    linewidth=0.5,
                )
                if not held and length >= num_steps / 40:
                    ax.text(
                        start + length / 2,
                        slot + 0.5,
                        f"R{req}",
                        ha="center",
                        va="center",
                        fontsize=7,
                    )
        ax.set_ylim(0, result.num_slots)
        ax.set_yticks([s + 0.5 for s in range(result.num_slots)])
        ax.set_yticklabels([f"slot {s}" for s in range(result.num_slots)], fontsize=8)
        ax.set_xlim(0, num_steps)
        ax.set_title(result.row(), fontsize=9, loc="left", family="monospace")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.legend(
        handles=[
            Patch(facecolor="grey", label="computing"),
            Patch(facecolor="grey", alpha=0.3, hatch="///", label="finished, slot held by batch"),
            Patch(facecolor="white", edgecolor="black", label="idle slot"),
        ],
        loc="upper right",
        fontsize=8,
        ncol=3,
    )
    fig.suptitle(title or "Slot occupancy per policy", x=0.01, ha="left", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
