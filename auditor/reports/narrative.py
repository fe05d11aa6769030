"""The readable report: one context object rendered to HTML (jinja2) and to PDF (reportlab)."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape

from auditor.checkpoint import Checkpoint
from auditor.reports.stats import ReportStats

MAX_TABLE_ROWS = 500
MAX_CONTENT_CHARS = 4000


@dataclass(frozen=True)
class ContentItem:
    transcript_id: str
    prompt_text: str
    output_text: str


@dataclass(frozen=True)
class Narrative:
    report_id: str
    generated_at: str
    generator_version: str
    filters: Mapping[str, Any]
    stats: ReportStats
    start: Checkpoint
    end: Checkpoint
    consistency_hashes: int
    rows: Sequence[Mapping[str, str]]
    """summary.csv rows (the table shows at most ``MAX_TABLE_ROWS``)."""
    charts: Mapping[str, bytes]
    content: Sequence[ContentItem] | None
    """``None`` unless the report was asked to include content."""

    @property
    def period(self) -> str:
        since, until = self.filters.get("since"), self.filters.get("until")
        return f"{since or 'beginning of the log'} → {until or self.generated_at}"

    @property
    def scope_lines(self) -> list[tuple[str, str]]:
        f = self.filters
        return [
            ("Tenant", str(f.get("tenant"))),
            ("Period", self.period),
            ("Model", str(f.get("model") or "all models")),
            ("Requests", "deterministic only" if f.get("deterministic_only") else "deterministic and not"),
            ("Content", "included (prompts and outputs)" if f.get("include_content")
             else "excluded: digests and signed commitments only"),
        ]

    @property
    def report_rows(self) -> list[Mapping[str, str]]:
        """The rows of the report's own transcripts (scope ``report``)."""
        return [r for r in self.rows if r.get("scope", "report") == "report"]

    @property
    def context_count(self) -> int:
        """Transcripts carried only to check the chain or a replay (scopes ``chain`` / ``replayed``)."""
        return len(self.rows) - len(self.report_rows)

    @property
    def problems(self) -> list[Mapping[str, str]]:
        """Rows of damaged transcripts: the signature does not verify, or the chain is broken there."""
        return [r for r in self.rows if r["signature_status"] != "valid" or r.get("chain_status") == "broken"]

    def table_rows(self) -> Sequence[Mapping[str, str]]:
        return self.report_rows[:MAX_TABLE_ROWS]


def clip(text: str, limit: int = MAX_CONTENT_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"… [{len(text) - limit} more characters]"


def root_hex(cp: Checkpoint) -> str:
    return cp.root_hash.hex()


def _env() -> Environment:
    env = Environment(loader=PackageLoader("auditor.reports", "templates"),
                      autoescape=select_autoescape(["html", "j2"]))
    env.filters["pct"] = lambda x: f"{100 * x:.1f} %"
    env.filters["b64"] = lambda b: base64.b64encode(b).decode("ascii")
    env.filters["clip"] = clip
    env.filters["roothex"] = root_hex
    return env


def render_html(n: Narrative) -> bytes:
    """Self-contained HTML (charts embedded as data: URIs, no external resources)."""
    return _env().get_template("report.html.j2").render(n=n, s=n.stats).encode("utf-8")
