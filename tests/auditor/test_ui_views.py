"""Console view shaping: tokens grouped by committed window, and what a document without content shows."""

from __future__ import annotations

import base64
import json

from auditor.ui.views import Token, safe_decoder, transcript_view, windows_of


def test_windows_group_prefill_then_each_verify_window() -> None:
    views = windows_of([[1, 4], [4, 6]], [5, 6, 7, 8, 9, 10], lambda t: chr(ord("a") + t))
    assert [(v.label, v.start, v.end) for v in views] == [("prefill", 0, 1), ("window 0", 1, 4), ("window 1", 4, 6)]
    assert views[1].tokens == [Token(6, "g"), Token(7, "h"), Token(8, "i")]


def test_non_deterministic_output_is_one_fast_path_group() -> None:
    views = windows_of([], [1, 2, 3], safe_decoder(None))
    assert [(v.label, v.start, v.end) for v in views] == [("prefill", 0, 1), ("fast path", 1, 3)]
    assert views[1].tokens == [Token(2, ""), Token(3, "")]


def test_document_without_content_has_no_windows_and_reports_checks() -> None:
    statement = {"predicate": {"transcript": {"id": "t1"}, "dvr": {"verify_passes": 4, "rollbacks": 1},
                               "windows": {"shape": {"G": 8, "W": 32}, "spans": [[1, 3]]}}}
    doc = {"envelope": {"payload": base64.b64encode(json.dumps(statement).encode()).decode()},
           "verification": {"checks": [{"name": "signature", "ok": True, "detail": "x"},
                                       {"name": "inclusion", "ok": False, "detail": "bad root"}]}}
    view = transcript_view(doc, safe_decoder(None))
    assert view.id == "t1" and view.windows is None and view.prompt_tokens is None
    assert view.rollback_rate == "25.0 %" and view.shape == "G=8 × W=32"
    assert view.check("inclusion").ok is False and not view.verified
