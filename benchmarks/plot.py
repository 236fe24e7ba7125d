"""One PNG per benchmark: a measure against the shape, one line per provider."""

from __future__ import annotations

import os


def plot_rows(
    rows: list[dict], *, x: str, y: str, name: str, title: str, ceiling: str | None = None
) -> str | None:
    """Plot ``rows[y]`` against ``rows[x]`` per ``rows['provider']`` into $OUT/name.

    The provider named ``ceiling`` (if any) is drawn dashed. Returns the path, or None when
    OUT is unset or matplotlib is missing.
    """
    out_dir = os.environ.get("OUT")
    if not out_dir or not rows:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = list(dict.fromkeys(str(r[x]) for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for provider in dict.fromkeys(r["provider"] for r in rows):
        points = {str(r[x]): r[y] for r in rows if r["provider"] == provider}
        xs = [i for i, label in enumerate(labels) if label in points]
        ys = [float(points[labels[i]]) for i in xs]
        style = "--" if provider == ceiling else "-o"
        ax.plot(xs, ys, style, label=provider)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel(y)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
