"""Content retention: a per-tenant setting and the purge that applies it.

Settings live in ``<data_dir>/retention.json`` (``{"default_days": 183, "tenants": {"acme": 365}}``),
edited with ``python -m auditor retention set``. Purging deletes a transcript's content row (token ids,
salt, text, request) once it is older than the tenant's retention; the signed envelope, the log leaf
and every checkpoint stay, so signatures, hash chain and inclusion proofs still verify — only the
commitments can no longer be opened.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncSession

from auditor.reports import store

DEFAULT_RETENTION_DAYS = 183
"""Six months (and a bit): the default for every tenant without its own setting."""
RETENTION_FILE = "retention.json"


@dataclass(frozen=True)
class RetentionPolicy:
    default_days: int = DEFAULT_RETENTION_DAYS
    tenants: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, days in {"default": self.default_days, **self.tenants}.items():
            if not isinstance(days, int) or isinstance(days, bool) or days < 1:
                raise ValueError(f"retention for {name} must be a whole number of days >= 1, got {days!r}")

    def days(self, tenant: str) -> int:
        return self.tenants.get(tenant, self.default_days)

    def cutoff(self, tenant: str, now: dt.datetime) -> dt.datetime:
        return now - dt.timedelta(days=self.days(tenant))

    def with_tenant(self, tenant: str, days: int) -> RetentionPolicy:
        return RetentionPolicy(self.default_days, {**self.tenants, tenant: days})


def load_policy(data_dir: Path) -> RetentionPolicy:
    path = Path(data_dir) / RETENTION_FILE
    if not path.exists():
        return RetentionPolicy()
    obj = json.loads(path.read_text())
    return RetentionPolicy(int(obj.get("default_days", DEFAULT_RETENTION_DAYS)), dict(obj.get("tenants", {})))


def save_policy(data_dir: Path, policy: RetentionPolicy) -> None:
    path = Path(data_dir) / RETENTION_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"default_days": policy.default_days, "tenants": dict(sorted(policy.tenants.items()))},
                              indent=2) + "\n")
    os.replace(tmp, path)


async def purge(session: AsyncSession, policy: RetentionPolicy, now: dt.datetime,
                tenant: str | None = None) -> dict[str, list[str]]:
    """Purge content past retention for ``tenant`` (all tenants when None); ``{tenant: purged ids}``."""
    names = [tenant] if tenant is not None else await store.tenants(session)
    return {name: await store.purge_contents(session, name, policy.cutoff(name, now)) for name in names}
