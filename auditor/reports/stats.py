"""The numbers the narrative reports: counts, deterministic share, DVR rates, replays, keys, log."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelDvr:
    """DVR totals of one model's deterministic transcripts."""

    model: str
    transcripts: int
    output_tokens: int
    verify_passes: int
    rollbacks: int
    recomputed_tokens: int

    @property
    def rollback_rate(self) -> float:
        """Rollbacks per verify pass."""
        return self.rollbacks / self.verify_passes if self.verify_passes else 0.0

    @property
    def recompute_rate(self) -> float:
        """Recomputed tokens per committed output token."""
        return self.recomputed_tokens / self.output_tokens if self.output_tokens else 0.0


@dataclass(frozen=True)
class KeyUse:
    kid: str
    role: str
    status: str
    signed_in_report: int
    """Transcripts, replay attestations and the manifest this key signed in the bundle."""


@dataclass(frozen=True)
class ReportStats:
    transcripts: int
    deterministic: int
    prompt_tokens: int
    completion_tokens: int
    by_status: dict[str, int]
    by_model: dict[str, int]
    by_day: dict[str, tuple[int, int]]
    """``YYYY-MM-DD`` → (deterministic, non-deterministic) transcripts received that day."""
    dvr: list[ModelDvr]
    rollback_rates: list[float]
    """Per deterministic transcript with at least one verify pass: rollbacks / verify passes."""
    replay_outcomes: dict[str, int]
    replay_jobs: int
    keys: list[KeyUse]
    signatures_valid: int
    inclusion_valid: int

    @property
    def deterministic_share(self) -> float:
        return self.deterministic / self.transcripts if self.transcripts else 0.0


def _pred(statement: Mapping[str, Any], part: str) -> Mapping[str, Any]:
    value = statement.get("predicate", {}).get(part, {})
    return value if isinstance(value, Mapping) else {}


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _dvr_by_model(statements: Sequence[Mapping[str, Any]]) -> list[ModelDvr]:
    totals: dict[str, list[int]] = {}
    for st in statements:
        if not _pred(st, "sampling").get("deterministic"):
            continue
        dvr, tokens = _pred(st, "dvr"), _pred(st, "tokens")
        acc = totals.setdefault(str(_pred(st, "model").get("name")), [0, 0, 0, 0, 0])
        for i, v in enumerate((1, _int(tokens.get("output_count")), _int(dvr.get("verify_passes")),
                               _int(dvr.get("rollbacks")), _int(dvr.get("recomputed_tokens")))):
            acc[i] += v
    return [ModelDvr(m, *acc) for m, acc in sorted(totals.items())]


def _rollback_rates(statements: Sequence[Mapping[str, Any]]) -> list[float]:
    rates = []
    for st in statements:
        dvr = _pred(st, "dvr")
        passes = _int(dvr.get("verify_passes"))
        if _pred(st, "sampling").get("deterministic") and passes:
            rates.append(_int(dvr.get("rollbacks")) / passes)
    return rates


def _by_day(statements: Sequence[Mapping[str, Any]]) -> dict[str, tuple[int, int]]:
    days: dict[str, list[int]] = {}
    for st in statements:
        day = str(_pred(st, "request").get("received_at", ""))[:10] or "unknown"
        slot = days.setdefault(day, [0, 0])
        slot[0 if _pred(st, "sampling").get("deterministic") else 1] += 1
    return {d: (v[0], v[1]) for d, v in sorted(days.items())}


def _keys(jwks: Mapping[str, Any], signer_kids: Sequence[str]) -> list[KeyUse]:
    used = Counter(signer_kids)
    return [KeyUse(str(k.get("kid")), str(k.get("role")), str(k.get("status", "active")), used[k.get("kid")])
            for k in jwks.get("keys", []) if isinstance(k, Mapping)]


def compute_stats(statements: Sequence[Mapping[str, Any]], replays: Sequence[Mapping[str, Any]],
                  jwks: Mapping[str, Any], signer_kids: Sequence[str], signatures_valid: int,
                  inclusion_valid: int, *, transcripts: int | None = None) -> ReportStats:
    """Aggregate the (already decoded) statements and replay job objects of one report; ``transcripts``
    counts the report's transcripts when some payloads could not be decoded (default: the statements)."""
    deterministic = sum(1 for st in statements if _pred(st, "sampling").get("deterministic"))
    return ReportStats(
        transcripts=len(statements) if transcripts is None else transcripts,
        deterministic=deterministic,
        prompt_tokens=sum(_int(_pred(st, "tokens").get("prompt_count")) for st in statements),
        completion_tokens=sum(_int(_pred(st, "tokens").get("output_count")) for st in statements),
        by_status=dict(sorted(Counter(str(_pred(st, "request").get("status")) for st in statements).items())),
        by_model=dict(sorted(Counter(str(_pred(st, "model").get("name")) for st in statements).items())),
        by_day=_by_day(statements),
        dvr=_dvr_by_model(statements),
        rollback_rates=_rollback_rates(statements),
        replay_outcomes=dict(sorted(Counter(str(r.get("verdict") or r.get("status")) for r in replays).items())),
        replay_jobs=len(replays),
        keys=_keys(jwks, signer_kids),
        signatures_valid=signatures_valid,
        inclusion_valid=inclusion_valid,
    )
