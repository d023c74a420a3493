"""The figure `prefixstore simulate --out` writes beside its JSON: one panel per metric.

One capacity: a bar per policy (a line through one x would be a stack of dots).
Several: a line per policy over capacity on a log axis (budgets compared are
usually spaced by factors, 2 GiB to 32 GiB), with a tick at each one simulated.
matplotlib is imported here only, so the simulator runs without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .engine import SimResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# (SimResult property, panel title, y axis label with its unit)
PANELS: tuple[tuple[str, str, str], ...] = (
    ("token_hit_rate", "token hit rate (exact reuse)", "share of input tokens reused"),
    ("state_hit_rate", "state hit rate", "share of requests that found a snapshot"),
    ("flops_saved_fraction", "FLOPs saved", "share of prefill FLOPs not recomputed"),
)


def _capacity_label(num_bytes: int) -> str:
    gib = num_bytes / 2**30
    return f"{gib:g}GiB" if gib >= 1 else f"{num_bytes / 2**20:g}MiB"


def figure(results: Sequence[SimResult], title: str) -> Figure:
    """The figure of ``results`` (one per policy and capacity), titled ``title``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, PercentFormatter

    policies = list(dict.fromkeys(r.policy for r in results))
    capacities = sorted({r.capacity_bytes for r in results})
    by_key = {(r.policy, r.capacity_bytes): r for r in results}
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.8), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (attr, panel_title, ylabel) in zip(axes[0], PANELS):
        if len(capacities) == 1:
            values = [getattr(by_key[(p, capacities[0])], attr) for p in policies]
            bars = ax.bar(policies, values, color=[colors[i % len(colors)] for i in range(len(policies))])
            ax.bar_label(bars, labels=[f"{v:.0%}" for v in values], fontsize=8)
            ax.set_xlabel(f"policy, capacity {_capacity_label(capacities[0])}")
            ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        else:
            for i, p in enumerate(policies):
                pts = [(c / 2**30, getattr(by_key[(p, c)], attr)) for c in capacities if (p, c) in by_key]
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p, color=colors[i % len(colors)])
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(FixedLocator([c / 2**30 for c in capacities]))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticklabels([_capacity_label(c) for c in capacities], fontsize=8)
            ax.set_xlabel("capacity (log scale)")
        ax.set_title(panel_title, fontsize=10)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.grid(alpha=0.3, axis="y" if len(capacities) == 1 else "both")
    if len(capacities) > 1:
        axes[0][-1].legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def save(results: Sequence[SimResult], title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(results, title)
    fig.savefig(path, dpi=100, metadata={"Title": title})  # the PNG's own tEXt Title, readable without pixels
    plt.close(fig)
