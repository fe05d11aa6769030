"""The role of an API key (``api_keys.role``): what its holder may do (docs/api.md)."""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    CLIENT = "client"
    AUDITOR = "auditor"
    ADMIN = "admin"
