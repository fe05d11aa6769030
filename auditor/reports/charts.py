"""Report charts as PNG bytes (matplotlib, Agg backend, no pyplot state shared between calls)."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from auditor.reports.stats import ReportStats

DPI = 110
DET_COLOR, NONDET_COLOR, ACCENT = "#1f6f8b", "#c9d6df", "#e4572e"


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    # No Software/date metadata: the same stats give the same bytes.
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def _empty(ax: object, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666666")  # type: ignore[attr-defined]
    ax.set_xticks([])  # type: ignore[attr-defined]
    ax.set_yticks([])  # type: ignore[attr-defined]


def _chart(height: float, title: str, empty_text: str | None, draw: Callable[[Any], None]) -> bytes:
    """One figure: ``empty_text`` centred when there is no data (not ``None``), else ``draw(ax)``."""
    fig = Figure(figsize=(6.4, height))
    ax = fig.add_subplot()
    if empty_text is not None:
        _empty(ax, empty_text)
    else:
        draw(ax)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return _png(fig)


def volume_chart(stats: ReportStats) -> bytes:
    """Transcripts per day, deterministic stacked under non-deterministic."""
    def draw(ax: Any) -> None:
        days = list(stats.by_day)
        det = [stats.by_day[d][0] for d in days]
        non = [stats.by_day[d][1] for d in days]
        ax.bar(days, det, color=DET_COLOR, label="deterministic")
        ax.bar(days, non, bottom=det, color=NONDET_COLOR, label="non-deterministic")
        ax.set_ylabel("transcripts")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)

    return _chart(2.8, "Completions per day", None if stats.by_day else "no transcripts in the period", draw)


def rollback_chart(stats: ReportStats) -> bytes:
    """Histogram of per-transcript DVR rollback rates (rollbacks per verify pass)."""
    def draw(ax: Any) -> None:
        ax.hist(stats.rollback_rates, bins=[i / 10 for i in range(11)], color=DET_COLOR, edgecolor="white")
        ax.set_xlabel("rollbacks per verify pass")
        ax.set_ylabel("transcripts")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(0, 1)

    return _chart(2.8, "DVR rollback rate per deterministic transcript",
                  None if stats.rollback_rates else "no deterministic transcripts with verify passes", draw)


def replay_chart(stats: ReportStats) -> bytes:
    """Replay outcomes by verdict (or job status while unfinished)."""
    def draw(ax: Any) -> None:
        names = list(stats.replay_outcomes)
        colors = [DET_COLOR if n == "match" else ACCENT for n in names]
        ax.barh(names, [stats.replay_outcomes[n] for n in names], color=colors)
        ax.set_xlabel("replays")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    return _chart(2.4, "Replay outcomes", None if stats.replay_outcomes else "no replays of these transcripts", draw)


def all_charts(stats: ReportStats) -> dict[str, bytes]:
    """``{name: png}`` in the order the narrative shows them."""
    return {"volume": volume_chart(stats), "rollbacks": rollback_chart(stats), "replays": replay_chart(stats)}
