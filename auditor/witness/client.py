"""What the log uses to ask a witness for a cosignature (C2SP tlog-witness add-checkpoint)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from auditor.witness.protocol import SIZE_MEDIA_TYPE, ProtocolError, encode_request, parse_size_body


@dataclass(frozen=True)
class Answer:
    status: int
    body: str
    conflict_size: int | None = None
    """On 409 with ``text/x.tlog.size``: the witness's latest cosigned size."""

    @property
    def ok(self) -> bool:
        return self.status == 200


async def add_checkpoint(client: httpx.AsyncClient, prefix: str, old_size: int, proof: Sequence[bytes],
                         note: str) -> Answer:
    """POST one submission; network errors propagate (``httpx.HTTPError``)."""
    response = await client.post(prefix.rstrip("/") + "/add-checkpoint", content=encode_request(old_size, proof, note))
    size = None
    if response.status_code == 409 and response.headers.get("content-type", "").startswith(SIZE_MEDIA_TYPE):
        try:
            size = parse_size_body(response.text)
        except ProtocolError:
            size = None
    return Answer(response.status_code, response.text, size)
