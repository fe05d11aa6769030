"""Key management for admins, within their own tenant: ``/v1/admin/keys``."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, delete, get, post
from litestar.di import Provide
from sqlalchemy.ext.asyncio import AsyncSession

from auditor import auth, repository
from auditor.auth import Principal, require_role
from auditor.db.models import ApiKey, Role
from auditor.errors import not_found
from auditor.repository import utc
from auditor.routes.deps import Services, provide_db_session, provide_principal
from auditor.routes.openapi import SECURITY
from auditor.routes.validation import check_text, json_body


class NewKey(msgspec.Struct, forbid_unknown_fields=True):
    role: Role
    name: Annotated[str, msgspec.Meta(max_length=128)] | None = None
    """A free-form label (at most 128 characters, the column's width)."""


def key_json(row: ApiKey) -> dict[str, Any]:
    return {"id": row.id, "tenant": row.tenant, "role": row.role, "name": row.name,
            "created_at": utc(row.created_at).isoformat(),
            "revoked_at": utc(row.revoked_at).isoformat() if row.revoked_at else None}


class KeysController(Controller):
    path = "/v1/admin/keys"
    security = SECURITY
    dependencies = {"principal": Provide(provide_principal), "db_session": Provide(provide_db_session)}

    @get("/")
    async def list_keys(self, db_session: AsyncSession, principal: Principal) -> dict[str, Any]:
        require_role(principal, (Role.ADMIN,))
        rows = await repository.list_api_keys(db_session, principal.tenant)
        return {"object": "list", "data": [key_json(r) for r in rows]}

    @post("/", status_code=201, opt={"body": NewKey})
    async def create_key(self, request: Request[Any, Any, Any], db_session: AsyncSession,
                         principal: Principal) -> dict[str, Any]:
        require_role(principal, (Role.ADMIN,))
        body = await json_body(request, NewKey)
        check_text(body.name, "name")
        row, secret = await auth.create_key(db_session, principal.tenant, body.role, body.name)
        return {**key_json(row), "key": secret}

    @delete("/{key_id:str}", status_code=200)
    async def revoke_key(self, key_id: str, services: Services, db_session: AsyncSession,
                         principal: Principal) -> dict[str, Any]:
        require_role(principal, (Role.ADMIN,))
        row = await auth.revoke_key(db_session, key_id, principal.tenant)
        if row is None:
            raise not_found(f"key {key_id!r} not found")
        services.authenticator.revoked(row.id)
        return key_json(row)
