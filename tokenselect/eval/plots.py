"""Figures of an eval run (matplotlib, Agg backend, PNG): for each needle task and policy a depth x
length heatmap of the score, like the papers' needle-in-a-haystack figures; for each task the score
against context length, one line per policy."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .tasks import NEEDLE_TASKS  # noqa: E402


def _mean(values: list[float]) -> float:
    """Mean x 100; NaN for no values (a cell not run: matplotlib leaves the point out)."""
    return 100 * sum(values) / len(values) if values else float("nan")


def _lengths(records: list[dict]) -> list[str]:
    """The run's lengths, shortest first."""
    targets = {r["length"]: r["target_tokens"] for r in records}
    return sorted(targets, key=targets.get)


def save_png(fig, path: Path) -> None:
    """Write the figure to ``path`` as a PNG and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def heatmap(records: list[dict], task: str, policy: str, path: Path) -> None:
    """Score by needle depth (rows) and context length (columns), 0 red .. 100 green."""
    lengths = _lengths(records)
    depth_values = sorted({r["depth"] for r in records})
    grid = [[_mean([r["score"] for r in records if r["depth"] == d and r["length"] == n])
             for n in lengths] for d in depth_values]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.45 * len(depth_values)))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(len(lengths)), lengths)
    ax.set_yticks(range(len(depth_values)), [f"{d:.0%}" for d in depth_values])
    ax.set_xlabel("context length")
    ax.set_ylabel("needle depth")
    ax.set_title(f"{task} — {policy}")
    fig.colorbar(image, ax=ax, label="score")
    save_png(fig, path)


def score_vs_length(records: list[dict], task: str, path: Path) -> None:
    """Mean score against context length, one line per policy (a length a policy was not run at is left out;
    with several tasks, each point averages the tasks run at that length)."""
    lengths = _lengths(records)
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(r["policy"] for r in records):
        ys = [_mean([r["score"] for r in records if r["policy"] == policy and r["length"] == n]) for n in lengths]
        ax.plot(lengths, ys, marker="o", label=policy)
    ax.set_ylim(-5, 105)
    ax.set_xlabel("context length")
    ax.set_ylabel("score")
    ax.set_title(task)
    ax.legend()
    save_png(fig, path)


def plot_all(records: list[dict], out: Path) -> list[Path]:
    """Every figure of the run into ``out``: ``heatmap_{task}_{policy}.png`` for needle tasks,
    ``score_vs_length_{task}.png``, and ``score_vs_length.png`` (mean over the tasks). Returns the
    paths written."""
    written = [out / "score_vs_length.png"]
    score_vs_length(records, f"mean over {len({r['task'] for r in records})} task(s)", written[0])
    for task in dict.fromkeys(r["task"] for r in records):
        rows = [r for r in records if r["task"] == task]
        if task in NEEDLE_TASKS:
            for policy in dict.fromkeys(r["policy"] for r in rows):
                path = out / f"heatmap_{task}_{policy.replace(':', '-').replace('@', '+')}.png"
                heatmap([r for r in rows if r["policy"] == policy], task, policy, path)
                written.append(path)
        path = out / f"score_vs_length_{task}.png"
        score_vs_length(rows, task, path)
        written.append(path)
    return written
