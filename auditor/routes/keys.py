"""Key management for admins, within their own tenant: ``/v1/admin/keys``."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, delete, get, post
from litestar.di import Provide
from sqlalchemy.ext.asyncio import AsyncSession

from auditor import auth, repository
from auditor.auth import Principal, require_role
from auditor.db.models import ApiKey, Role
from auditor.errors import bad_request, not_found
from auditor.repository import utc
from auditor.routes.deps import provide_db_session, provide_principal


class NewKey(msgspec.Struct, forbid_unknown_fields=True):
    role: Role
    name: str | None = None


def key_json(row: ApiKey) -> dict[str, Any]:
    return {"id": row.id, "tenant": row.tenant, "role": row.role, "name": row.name,
            "created_at": utc(row.created_at).isoformat(),
            "revoked_at": utc(row.revoked_at).isoformat() if row.revoked_at else None}


class KeysController(Controller):
    path = "/v1/admin/keys"
    dependencies = {"principal": Provide(provide_principal), "db_session": Provide(provide_db_session)}

    @get("/")
    async def list_keys(self, db_session: AsyncSession, principal: Principal) -> dict[str, Any]:
        require_role(principal, (Role.ADMIN,))
        rows = await repository.list_api_keys(db_session, principal.tenant)
        return {"object": "list", "data": [key_json(r) for r in rows]}

    @post("/", status_code=201)
    async def create_key(self, request: Request[Any, Any, Any], db_session: AsyncSession,
                         principal: Principal) -> dict[str, Any]:
        require_role(principal, (Role.ADMIN,))
        try:
            body = msgspec.json.decode(await request.body(), type=NewKey)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise bad_request(f"invalid request: {exc}", param="role") from None
        row, secret = await auth.create_key(db_session, principal.tenant, body.role, body.name)
        return {**key_json(row), "key": secret}

    @delete("/{key_id:str}", status_code=200)
    async def revoke_key(self, key_id: str, db_session: AsyncSession, principal: Principal) -> dict[str, Any]:
        require_role(principal, (Role.ADMIN,))
        row = await auth.revoke_key(db_session, key_id, principal.tenant)
        if row is None:
            raise not_found(f"key {key_id!r} not found")
        return key_json(row)
