"""Pure shaping of API documents into what the console templates show (no I/O)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from auditor.transcript import Check

Decode = Callable[[int], str]


@dataclass(frozen=True)
class Token:
    id: int
    text: str


@dataclass(frozen=True)
class WindowView:
    label: str
    start: int
    end: int
    tokens: list[Token]


@dataclass(frozen=True)
class TranscriptView:
    id: str
    summary: Mapping[str, Any]
    predicate: Mapping[str, Any]
    checks: list[Check]
    windows: list[WindowView] | None
    """``None`` when the content is not available (purged, or not disclosed)."""
    prompt_text: str | None
    output_text: str | None
    prompt_tokens: list[Token] | None

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    @property
    def verified(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def dvr(self) -> Mapping[str, Any]:
        return self.predicate.get("dvr", {})

    @property
    def rollback_rate(self) -> str:
        passes = self.dvr.get("verify_passes") or 0
        return f"{100 * (self.dvr.get('rollbacks') or 0) / passes:.1f} %" if passes else "—"

    @property
    def shape(self) -> str:
        shape = self.predicate.get("windows", {}).get("shape", {})
        return f"G={shape.get('G')} × W={shape.get('W')}" if shape else "—"

    @property
    def spans(self) -> list[list[int]]:
        return list(self.predicate.get("windows", {}).get("spans", []))


def statement_of(envelope: Mapping[str, Any]) -> dict[str, Any]:
    """The envelope's payload, decoded for display (the signature is checked by the API's verify)."""
    try:
        obj = json.loads(base64.b64decode(envelope["payload"]))
        return obj if isinstance(obj, dict) else {}
    except (KeyError, TypeError, ValueError):
        return {}


def safe_decoder(tokenizer: Any | None) -> Decode:
    def decode(token_id: int) -> str:
        if tokenizer is None:
            return ""
        try:
            return str(tokenizer.decode([token_id]))
        except Exception:  # noqa: BLE001 - a display nicety; the id is always shown
            return ""

    return decode


def windows_of(spans: Sequence[Sequence[int]], output_ids: Sequence[int], decode: Decode) -> list[WindowView]:
    """Output token 0 (canonical prefill) then one group per committed verify window."""
    views = []
    if output_ids:
        views.append(WindowView("prefill", 0, 1, [Token(output_ids[0], decode(output_ids[0]))]))
    for k, (start, end) in enumerate(spans):
        views.append(WindowView(f"window {k}", start, end, [Token(t, decode(t)) for t in output_ids[start:end]]))
    covered = max([1, *(end for _, end in spans)]) if output_ids else 0
    if covered < len(output_ids):  # non-deterministic requests have no windows
        views.append(WindowView("fast path", covered, len(output_ids),
                                [Token(t, decode(t)) for t in output_ids[covered:]]))
    return views


def transcript_view(doc: Mapping[str, Any], decode: Decode) -> TranscriptView:
    statement = statement_of(doc.get("envelope", {}))
    predicate = statement.get("predicate", {})
    checks = [Check(c["name"], bool(c["ok"]), str(c["detail"])) for c in doc.get("verification", {}).get("checks", [])]
    output = doc.get("token_ids")
    prompt = doc.get("prompt_token_ids")
    spans = predicate.get("windows", {}).get("spans", [])
    return TranscriptView(
        id=str(doc.get("transcript", {}).get("id") or predicate.get("transcript", {}).get("id")),
        summary=doc.get("transcript", {}), predicate=predicate, checks=checks,
        windows=windows_of(spans, output, decode) if output is not None else None,
        prompt_text=doc.get("prompt_text"), output_text=doc.get("output_text"),
        prompt_tokens=[Token(t, decode(t)) for t in prompt] if prompt is not None else None)
