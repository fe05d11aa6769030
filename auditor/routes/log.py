"""The public log: ``GET /v1/log/checkpoint``, ``/v1/log/proofs/inclusion``, ``/v1/log/proofs/consistency``.

No key needed: checkpoints and proofs disclose only hashes. Proofs default to the latest checkpoint's
tree size, so a client can check them against the checkpoint it just fetched.

No waiting for a checkpoint: a leaf is committed in the same transaction as the signed checkpoint that
first covers it (appends are grouped, one checkpoint per group: docs/ledger.md), and a completion's
response — its ``transcript`` object with ``log_index`` and ``tree_size`` — leaves only after that
commit. Whoever holds a log index can fetch its proof at once.
"""

from __future__ import annotations

import base64
import re
from typing import Any, Literal

from litestar import Controller, Response, get
from litestar.di import Provide
from litestar.params import Parameter
from sqlalchemy.ext.asyncio import AsyncSession

from auditor import repository
from auditor.errors import bad_request, not_found
from auditor.merkle import ProofError
from auditor.routes.deps import Services, provide_db_session, witnessed_size

_DIGEST = re.compile(r"^[0-9a-fA-F]{64}$")


class LogController(Controller):
    path = "/v1/log"
    dependencies = {"db_session": Provide(provide_db_session)}

    @get("/checkpoint")
    async def checkpoint(self, services: Services, db_session: AsyncSession,
                         format: Literal["json", "note"] = "json", witnessed: bool = False) -> Response[Any]:
        """JSON ``{origin, tree_size, root_hash, note}``; ``?format=note``: the signed note as text/plain.
        The note carries the witnesses' cosignatures stored for it; ``?witnessed=true``: the latest
        checkpoint a quorum of witnesses cosigned (asking them now if the latest is not)."""
        if witnessed:
            size = await witnessed_size(services)
            checkpoint = await services.ledger.checkpoint_at(db_session, size)
            assert checkpoint is not None, size
        else:
            checkpoint = await services.ledger.checkpoint(db_session)
        if format == "note":
            return Response(checkpoint.note, media_type="text/plain; charset=utf-8")
        return Response({"origin": services.ledger.origin, **checkpoint.to_json()})

    @get("/proofs/inclusion")
    async def inclusion(
        self,
        services: Services,
        db_session: AsyncSession,
        index: int | None = Parameter(default=None, ge=0),
        tree_size: int | None = Parameter(default=None, ge=1),
        envelope_digest: str | None = None,
    ) -> dict[str, Any]:
        """Inclusion proof of leaf ``index`` (or of the leaf whose entry is ``envelope_digest``) in the
        tree of ``tree_size`` leaves (default: the latest checkpoint's), with the leaf hash.

        A completion response's ``transcript.tree_size`` is the size of the signed checkpoint committed
        with it: ``?index=<log_index>&tree_size=<tree_size>`` answers as soon as the response has
        arrived, and so does the default size (the latest checkpoint covers every committed leaf).
        An index at or past that size is not in the log: 400."""
        if (index is None) == (envelope_digest is None):
            raise bad_request("give exactly one of index or envelope_digest", param="index")
        if index is None:
            index = await _index_of(db_session, envelope_digest or "")
        size = tree_size or (await services.ledger.checkpoint(db_session)).tree_size
        if index >= size:
            raise bad_request(f"index {index} is not below tree_size {size}: no signed checkpoint of that size "
                              "covers it", param="index")
        try:
            proof = await services.ledger.inclusion_proof(db_session, index, size)
            leaf = await services.ledger.leaf_hash(db_session, index, size)
        except (ProofError, ValueError) as exc:
            raise bad_request(str(exc), param="tree_size") from None
        return {**proof.to_json(), "leaf_hash": base64.b64encode(leaf).decode("ascii")}

    @get("/proofs/consistency")
    async def consistency(
        self,
        services: Services,
        db_session: AsyncSession,
        first: int = Parameter(ge=1),
        second: int | None = Parameter(default=None, ge=1),
    ) -> dict[str, Any]:
        size = second or (await services.ledger.checkpoint(db_session)).tree_size
        if first > size:
            raise bad_request(f"first ({first}) must not exceed second ({size})", param="first")
        try:
            proof = await services.ledger.consistency_proof(db_session, first, size)
        except (ProofError, ValueError) as exc:
            raise bad_request(str(exc), param="second") from None
        return proof.to_json()


async def _index_of(session: AsyncSession, envelope_digest: str) -> int:
    if not _DIGEST.match(envelope_digest):
        raise bad_request("envelope_digest must be 64 hex characters (a SHA-256)", param="envelope_digest")
    entry = bytes.fromhex(envelope_digest)
    leaf = await repository.leaf_for_entry(session, entry)
    if leaf is None:
        raise not_found(f"no log entry with envelope digest {envelope_digest}")
    return leaf.index
