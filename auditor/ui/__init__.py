"""Auditor web console (placeholder)."""

UI_ROUTES: list = []
