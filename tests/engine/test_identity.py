"""engine.identity.Fingerprinted: the system fingerprint follows the runtime fingerprint it is derived from."""
from __future__ import annotations

from engine.fingerprint import system_fingerprint
from engine.identity import Fingerprinted


class Engine(Fingerprinted):
    def __init__(self, fingerprint: dict[str, str | int]) -> None:
        self._fingerprint = fingerprint


def test_the_system_fingerprint_is_derived_from_the_current_runtime_fingerprint() -> None:
    one, two = {"model": "a", "window": 16}, {"model": "a", "window": 32}
    engine = Engine(one)
    assert engine.system_fingerprint() == system_fingerprint(one)
    assert engine.system_fingerprint() == system_fingerprint(one)  # asked again: the same value
    engine._fingerprint = two  # a replaced fingerprint gives its own value
    assert engine.system_fingerprint() == system_fingerprint(two) != system_fingerprint(one)
    assert engine.runtime_fingerprint() == two and engine.runtime_fingerprint() is not two
    assert Engine(one).system_fingerprint() == system_fingerprint(one)  # each engine its own
