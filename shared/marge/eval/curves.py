"""Training curves as pictures: a moving average and a row of line plots (matplotlib, imported when one is drawn):
what `marge report` and the learning experiments' reports draw."""

from __future__ import annotations

from pathlib import Path


def ema(values: list[float], alpha: float = 0.1) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else (1 - alpha) * acc + alpha * v
        out.append(acc)
    return out


def plot_curves(panels: list[dict], out_path: Path, title: str) -> Path:
    """panels: [{"title", "ylabel", "series": [{"label", "x", "y", "style"?}]}] in one row of plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for series in panel["series"]:
            if series.get("hline") is not None:
                ax.axhline(series["hline"], linestyle="--", linewidth=1, label=series["label"],
                           color=series.get("color"))
            else:
                ax.plot(series["x"], series["y"], series.get("style", "-"), label=series["label"],
                        color=series.get("color"), markersize=3)
        ax.set_title(panel["title"], fontsize=9)
        ax.set_xlabel(panel.get("xlabel", "step"))
        ax.set_ylabel(panel["ylabel"])
        ax.grid(alpha=0.3)
        if any(s.get("label") for s in panel["series"]):
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
