"""What a report bundle covers, decided from signed statements so that the exporter and the offline
verifier reach the same answer (docs/reports.md has the prose).

Every ``transcripts.jsonl`` line has a ``scope``:

* ``report``   the tenant's transcripts the filters select (received in ``[since, until)``, model,
               deterministic-only); the report's counts, charts and content are about these only.
* ``chain``    the tenant's other transcripts between the report's first and last sequence number,
               and the one just before the first: carried (never with content) so that every link
               of the per-tenant hash chain over the report's span can be checked.
* ``replayed`` an older transcript of the tenant that a replay attested in the period is about.

Each line's ``chain_status`` (``chain_findings``): ``first`` (sequence 1, no predecessor), ``linked``
(its predecessor is in the bundle and ``previous_digest`` is that predecessor's payload digest),
``unchecked`` (a line whose predecessor the bundle does not need: the head of the chain span, a
``replayed`` line) or ``broken`` (anything else: a missing predecessor, a digest that differs, two
lines with one sequence number, an unreadable payload).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Scope(StrEnum):
    REPORT = "report"
    CHAIN = "chain"
    REPLAYED = "replayed"


class ChainStatus(StrEnum):
    FIRST = "first"
    LINKED = "linked"
    UNCHECKED = "unchecked"
    BROKEN = "broken"


def instant(text: Any) -> dt.datetime | None:
    """An RFC 3339 time (``Z`` or offset) as an aware datetime; None if it is not one."""
    try:
        value = dt.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None
    return value if value.tzinfo is not None else None


def in_period(when: dt.datetime | None, filters: Mapping[str, Any]) -> bool:
    """``when`` falls in the filters' ``[since, until)`` (unbounded ends when absent)."""
    since, until = instant(filters.get("since")), instant(filters.get("until"))
    return when is not None and (since is None or when >= since) and (until is None or when < until)


def tenant_problem(statement: Mapping[str, Any], tenant: str) -> str | None:
    signed = statement.get("predicate", {}).get("transcript", {}).get("tenant")
    return None if signed == tenant else f"tenant {signed!r} is not the report's {tenant!r}"


def outside_filters(statement: Mapping[str, Any], filters: Mapping[str, Any], *, period: bool = True) -> list[str]:
    """Why the report filters do not select a transcript statement of the tenant (empty: they do).
    ``period`` False ignores the time bounds."""
    p = statement.get("predicate", {})
    reasons = []
    received = instant(p.get("request", {}).get("received_at"))
    if received is None:
        reasons.append(f"received_at {p.get('request', {}).get('received_at')!r} is not an RFC 3339 time")
    elif period and not in_period(received, filters):
        reasons.append(f"received {received.isoformat()} outside the period "
                       f"[{filters.get('since') or 'start'}, {filters.get('until') or 'end'})")
    if filters.get("model") and p.get("model", {}).get("name") != filters["model"]:
        reasons.append(f"model {p.get('model', {}).get('name')!r} is not the filter's {filters['model']!r}")
    if filters.get("deterministic_only") and not p.get("sampling", {}).get("deterministic"):
        reasons.append("non-deterministic transcript in a deterministic-only report")
    return reasons


def attested_at(attestation: Mapping[str, Any] | None) -> dt.datetime | None:
    """The signed ``replayed_at`` of a replay attestation (signature checked elsewhere)."""
    if attestation is None:
        return None
    try:
        return instant(json.loads(base64.b64decode(attestation["payload"]))["predicate"]["replayed_at"])
    except (KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class ChainLink:
    """What the chain check needs of one line; ``sequence`` and the digests are None when the
    payload cannot be read."""

    transcript_id: str
    scope: str
    sequence: int | None
    previous_digest: str | None
    payload_digest: str | None


def chain_findings(links: Sequence[ChainLink]) -> dict[str, tuple[ChainStatus, str]]:
    """Per transcript id: its ``ChainStatus`` and why (see the module docstring)."""
    readable = [link for link in links if _is_sequence(link.sequence) and link.payload_digest]
    counts = Counter(link.sequence for link in readable)
    by_sequence = {link.sequence: link for link in readable}
    report = [link.sequence for link in readable if link.scope == Scope.REPORT]
    head = min(report) - 1 if report else None
    out: dict[str, tuple[ChainStatus, str]] = {}
    for link in links:
        out[link.transcript_id] = _finding(link, counts, by_sequence, head)
    return out


def _is_sequence(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _finding(link: ChainLink, counts: Counter[int | None], by_sequence: Mapping[int | None, ChainLink],
             head: int | None) -> tuple[ChainStatus, str]:
    if not _is_sequence(link.sequence) or not link.payload_digest:
        return ChainStatus.BROKEN, "the payload cannot be read, so neither can its chain fields"
    if counts[link.sequence] > 1:
        return ChainStatus.BROKEN, f"{counts[link.sequence]} transcripts carry sequence {link.sequence}"
    if link.sequence == 1:
        if link.previous_digest is None:
            return ChainStatus.FIRST, "sequence 1, no predecessor"
        return ChainStatus.BROKEN, f"sequence 1 names a predecessor {link.previous_digest}"
    if link.previous_digest is None:
        return ChainStatus.BROKEN, f"sequence {link.sequence} names no predecessor"
    previous = by_sequence.get(link.sequence - 1)
    if previous is not None:
        if previous.payload_digest == link.previous_digest:
            return ChainStatus.LINKED, f"previous_digest is the payload digest of sequence {link.sequence - 1}"
        return ChainStatus.BROKEN, (f"previous_digest {link.previous_digest} is not the payload digest "
                                    f"{previous.payload_digest} of sequence {link.sequence - 1} "
                                    f"(transcript {previous.transcript_id})")
    needed = link.scope == Scope.REPORT or (link.scope == Scope.CHAIN and head is not None and link.sequence > head)
    if needed:
        return ChainStatus.BROKEN, (f"sequence {link.sequence - 1} (payload digest {link.previous_digest}) is missing: "
                                    "the report's span needs it")
    return ChainStatus.UNCHECKED, "its predecessor is outside the report's chain span"
