"""The identity members both serving engines share (AsyncEngine in this process, EngineProcess in its own):
the runtime fingerprint taken when the engine started, and the system fingerprint derived from it."""
from __future__ import annotations

from engine.fingerprint import system_fingerprint


class Fingerprinted:
    """`runtime_fingerprint()` / `system_fingerprint()` of an engine whose runtime fingerprint (DESIGN §4,
    engine.fingerprint.runtime_fingerprint) was taken once at start-up and set as `_fingerprint`."""

    _fingerprint: dict[str, str | int]
    _system: tuple[dict[str, str | int], str] | None = None  # (the fingerprint it was derived from, the value)

    def runtime_fingerprint(self) -> dict[str, str | int]:
        return dict(self._fingerprint)

    def system_fingerprint(self) -> str:
        """Derived once per fingerprint (every completion asks for it twice; the fingerprint is replaced, never
        changed in place)."""
        if self._system is None or self._system[0] is not self._fingerprint:
            self._system = (self._fingerprint, system_fingerprint(self._fingerprint))
        return self._system[1]
