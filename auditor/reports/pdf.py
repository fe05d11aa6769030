"""``report.pdf``: the same narrative as the HTML, laid out with reportlab platypus."""

from __future__ import annotations

import io
from collections.abc import Sequence

from reportlab.lib import colors
from reportlab.lib.pagesizes import A4
from reportlab.lib.styles import ParagraphStyle, getSampleStyleSheet
from reportlab.lib.units import cm
from reportlab.platypus import Image, Paragraph, Preformatted, SimpleDocTemplate, Spacer, Table, TableStyle
from reportlab.platypus.flowables import Flowable
from xml.sax.saxutils import escape

from auditor.reports.narrative import Narrative, clip, root_hex

PAGE_WIDTH = A4[0] - 3 * cm
_STYLES = getSampleStyleSheet()
_MONO = ParagraphStyle("mono", parent=_STYLES["BodyText"], fontName="Courier", fontSize=7, leading=8.5)
_SMALL = ParagraphStyle("small", parent=_STYLES["BodyText"], fontSize=8, leading=10)


def _p(text: str, style: ParagraphStyle = _STYLES["BodyText"]) -> Paragraph:
    return Paragraph(escape(text), style)


def _table(rows: Sequence[Sequence[str]], widths: Sequence[float] | None = None, mono_cols: Sequence[int] = ()) -> Table:
    cells = [[_p(str(c), _MONO if j in mono_cols and i > 0 else _SMALL) for j, c in enumerate(r)]
             for i, r in enumerate(rows)]
    t = Table(cells, colWidths=widths, repeatRows=1)
    t.setStyle(TableStyle([
        ("GRID", (0, 0), (-1, -1), 0.4, colors.HexColor("#cccccc")),
        ("BACKGROUND", (0, 0), (-1, 0), colors.HexColor("#f3f5f7")),
        ("VALIGN", (0, 0), (-1, -1), "TOP"),
    ]))
    return t


def _chart(png: bytes) -> Image:
    img = Image(io.BytesIO(png))
    scale = PAGE_WIDTH / img.imageWidth
    img.drawWidth, img.drawHeight = PAGE_WIDTH, img.imageHeight * scale
    return img


def _h(text: str) -> Paragraph:
    return _p(text, _STYLES["Heading2"])


def _counts(n: Narrative) -> list[Flowable]:
    s = n.stats
    rows = [["Measure", "Value"], ["Transcripts", str(s.transcripts)],
            ["Deterministic", f"{s.deterministic} ({100 * s.deterministic_share:.1f} %)"],
            ["Prompt tokens", str(s.prompt_tokens)], ["Completion tokens", str(s.completion_tokens)]]
    rows += [[f"Status {k}", str(v)] for k, v in s.by_status.items()]
    rows += [[f"Model {k}", str(v)] for k, v in s.by_model.items()]
    return [_h("Counts"), _table(rows), Spacer(1, 6), _chart(n.charts["volume"])]


def _dvr(n: Narrative) -> list[Flowable]:
    rows = [["Model", "Transcripts", "Output tokens", "Verify passes", "Rollbacks", "Rollbacks / pass",
             "Recomputed / token"]]
    rows += [[m.model, str(m.transcripts), str(m.output_tokens), str(m.verify_passes), str(m.rollbacks),
              f"{100 * m.rollback_rate:.1f} %", f"{100 * m.recompute_rate:.1f} %"] for m in n.stats.dvr]
    body: list[Flowable] = [_h("Decode–verify–rollback")]
    body.append(_table(rows) if n.stats.dvr else _p("No deterministic transcripts."))
    return [*body, Spacer(1, 6), _chart(n.charts["rollbacks"])]


def _replays(n: Narrative) -> list[Flowable]:
    rows = [["Outcome", "Replays"]] + [[k, str(v)] for k, v in n.stats.replay_outcomes.items()]
    body = _table(rows) if n.stats.replay_outcomes else _p("No replays of these transcripts.")
    return [_h("Replay outcomes"), body, Spacer(1, 6), _chart(n.charts["replays"])]


def _keys_and_log(n: Narrative) -> list[Flowable]:
    s = n.stats
    keys = [["Key id (RFC 7638)", "Role", "Status", "Signatures here"]]
    keys += [[k.kid, k.role, k.status, str(k.signed_in_report)] for k in s.keys]
    log = [["", "Origin", "Tree size", "Root hash"],
           ["Period start", n.start.origin, str(n.start.tree_size), root_hex(n.start)],
           ["Report end", n.end.origin, str(n.end.tree_size), root_hex(n.end)]]
    facts = [
        f"Consistency proof start → end: {n.consistency_hashes} hashes.",
        f"{s.signatures_valid} of {s.transcripts} transcript signatures verify against jwks.json.",
        f"{s.inclusion_valid} of {s.transcripts} inclusion proofs verify against the end checkpoint.",
        f"{n.context_count} further transcripts carried without content for the chain and replays.",
        f"{len(n.problems)} transcripts damaged (signature does not verify, or the chain is broken there)"
        + (": " + ", ".join(f"{r['transcript_id']} ({r['signature_status']}, chain {r['chain_status']})"
                            for r in n.problems[:50]) if n.problems else "."),
        "Check offline: python -m auditor verify-bundle report.zip",
    ]
    w = PAGE_WIDTH
    return [_h("Key inventory"), _table(keys, [0.5 * w, 0.15 * w, 0.15 * w, 0.2 * w], mono_cols=(0,)),
            _h("Log integrity evidence"), _table(log, [0.15 * w, 0.2 * w, 0.12 * w, 0.53 * w], mono_cols=(3,)),
            *[_p(f) for f in facts]]


def _transcripts(n: Narrative) -> list[Flowable]:
    rows = [["Transcript", "Received", "Model", "Det.", "In/out", "Rollb.", "Sig.", "Replay", "Log"]]
    rows += [[r["transcript_id"], r["received_at"], r["model"], r["deterministic"],
              f"{r['prompt_tokens']}/{r['completion_tokens']}", r["rollbacks"], r["signature_status"],
              r["replay_status"], r["log_index"]] for r in n.table_rows()]
    w = PAGE_WIDTH
    widths = [0.22 * w, 0.16 * w, 0.14 * w, 0.06 * w, 0.09 * w, 0.06 * w, 0.07 * w, 0.12 * w, 0.08 * w]
    shown = len(n.table_rows())
    total = len(n.report_rows)
    note = [] if total == shown else [_p(f"First {shown} of {total} (all in summary.csv).")]
    return [_h("Transcripts"), *note, _table(rows, widths, mono_cols=(0,))]


def _content(n: Narrative) -> list[Flowable]:
    if n.content is None:
        return []
    body: list[Flowable] = [_h("Content"), _p("Included on request.")]
    for c in n.content:
        body += [_p(c.transcript_id, _STYLES["Heading4"]),
                 _p("Prompt", _SMALL), Preformatted(clip(c.prompt_text), _MONO, maxLineLength=110),
                 _p("Output", _SMALL), Preformatted(clip(c.output_text), _MONO, maxLineLength=110)]
    return body


def render_pdf(n: Narrative) -> bytes:
    """PDF bytes; ``invariant`` mode keeps them free of the wall-clock time."""
    buf = io.BytesIO()
    doc = SimpleDocTemplate(buf, pagesize=A4, leftMargin=1.5 * cm, rightMargin=1.5 * cm,
                            title=f"Verbatim compliance report {n.report_id}", author=n.generator_version,
                            invariant=1)
    story: list[Flowable] = [
        _p("Verbatim compliance report", _STYLES["Title"]),
        _p(f"Report {n.report_id} · generated {n.generated_at} by {n.generator_version}", _SMALL),
        _h("Scope"), _table([["Field", "Value"], *[[k, v] for k, v in n.scope_lines]], [0.2 * PAGE_WIDTH, 0.8 * PAGE_WIDTH]),
        *_counts(n), *_dvr(n), *_replays(n), *_keys_and_log(n), *_transcripts(n), *_content(n),
    ]
    doc.build(story)
    return buf.getvalue()
