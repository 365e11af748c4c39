"""The routing heat map as a picture (``colibri stats --plot heat.png``).

Needs matplotlib, the ``plot`` extra: ``pip install 'colibri-moe[plot]'``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def plot_heat(routing: Mapping[str, Any], path: str | os.PathLike[str], title: str = "") -> None:
    """Draws layers x experts, each cell the share of the layer's tokens that
    chose the expert, and writes it to ``path`` (the format follows the
    extension: .png, .svg, .pdf, ...). When experts stream under a RAM
    budget, pinned experts get a ring and cached ones a dot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install 'colibri-moe[plot]'") from e
    layers = routing.get("layers", [])
    if not layers:
        raise ValueError("this model has no MoE layers: there is no routing to plot")
    experts = max(len(lay["heat"]) for lay in layers)
    share = [[0.0] * experts for _ in layers]
    for row, lay in zip(share, layers):
        for x, c in enumerate(lay["heat"]):
            row[x] = c / lay["tokens"] if lay["tokens"] else 0.0
    width = min(16.0, max(5.0, experts * 0.12 + 2.5))
    height = min(12.0, max(2.5, len(layers) * 0.25 + 1.5))
    fig, ax = plt.subplots(figsize=(width, height), dpi=120, layout="constrained")
    try:
        im = ax.imshow(share, aspect="auto", cmap="inferno", interpolation="nearest", vmin=0.0)
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_yticks(range(len(layers)), [str(lay["layer"]) for lay in layers])
        fig.colorbar(im, ax=ax, label="share of tokens")
        streaming = any(set(lay.get("residency", "")) - {"R"} for lay in layers)
        if streaming:
            marks: tuple[tuple[str, dict[str, Any]], ...] = (
                ("P", {"marker": "o", "facecolors": "none", "edgecolors": "#4fd1c5"}),
                ("C", {"marker": ".", "color": "#7ee081"}),
            )
            for mark, style in marks:
                pts = [
                    (x, r)
                    for r, lay in enumerate(layers)
                    for x, c in enumerate(lay.get("residency", ""))
                    if c == mark
                ]
                if pts:
                    xs, ys = zip(*pts)
                    ax.scatter(xs, ys, s=14, label={"P": "pinned", "C": "cached"}[mark], **style)
            fig.legend(loc="outside lower center", ncol=2, fontsize="small", frameon=False)
        tokens = layers[0]["tokens"]
        ax.set_title(f"{title or 'routing heat'} ({tokens} tokens)")
        fig.savefig(os.fspath(path))
    finally:
        plt.close(fig)
