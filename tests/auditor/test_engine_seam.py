"""The service's one engine seam (auditor.engine_seam.ServingEngine): the real engines and the tests' fake
all have every member it declares, with the same parameters and the same async-ness; no auditor module
builds an engine but engine_seam, and none probes the engine with getattr / hasattr."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

from auditor import engine_seam
from auditor.engine_seam import ServingEngine
from engine.async_engine import AsyncEngine
from engine.core import EngineStats
from engine.engine_process import EngineProcess
from tests.auditor.fake_engine import FakeAsyncEngine

ROOT = Path(__file__).resolve().parents[2]
METHODS = sorted(name for name, value in vars(ServingEngine).items()
                 if callable(value) and not name.startswith("_"))
ATTRIBUTES = sorted(ServingEngine.__annotations__)


def _kind(fn: Any) -> str:
    if inspect.isasyncgenfunction(fn):
        return "async generator"
    return "coroutine" if inspect.iscoroutinefunction(fn) else "function"


def _params(fn: Any) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()]


def test_the_seam_declares_what_the_service_uses() -> None:
    assert METHODS == ["abort", "generate", "last_output", "replay", "runtime_fingerprint", "shutdown", "start",
                       "stats", "system_fingerprint", "validate"]
    assert ATTRIBUTES == ["config", "model_info", "tokenizer"]


@pytest.mark.parametrize("cls", [AsyncEngine, EngineProcess, FakeAsyncEngine], ids=lambda c: c.__name__)
def test_engine_has_every_method_of_the_seam(cls: type) -> None:
    for name in METHODS:
        declared, implemented = getattr(ServingEngine, name), getattr(cls, name)
        assert _params(implemented) == _params(declared), (cls.__name__, name)
        # generate: an async generator, or a function returning an async iterator (the Protocol's stub)
        if name != "generate":
            assert _kind(implemented) == _kind(declared), (cls.__name__, name)
    assert inspect.isasyncgenfunction(cls.generate), cls.__name__


@pytest.mark.parametrize("cls", [AsyncEngine, EngineProcess], ids=lambda c: c.__name__)
def test_real_engines_set_every_attribute_of_the_seam(cls: type) -> None:
    init = ast.parse(inspect.getsource(cls))
    assigned = {t.attr for node in ast.walk(init) if isinstance(node, ast.Assign | ast.AnnAssign)
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert set(ATTRIBUTES) <= assigned, (cls.__name__, set(ATTRIBUTES) - assigned)


async def test_the_fake_speaks_the_engines_types() -> None:
    from engine import EngineConfig, RequestOutput, SamplingParams
    from engine.loader import ModelInfo

    fake = FakeAsyncEngine()
    assert isinstance(fake.config, EngineConfig) and isinstance(fake.model_info, ModelInfo)
    assert isinstance(fake.stats(), EngineStats) and len(fake.tokenizer) > 0
    outs = [o async for o in fake.generate([1, 2, 3], SamplingParams(max_tokens=3, seed=1, deterministic=True))]
    assert all(isinstance(o, RequestOutput) for o in outs) and outs[-1].finished
    assert (fake.config.group, fake.config.window) == outs[-1].window_shape


def _auditor_modules() -> list[Path]:
    return sorted((ROOT / "auditor").rglob("*.py"))


def test_only_the_seam_builds_an_engine() -> None:
    """AsyncEngine / EngineProcess are named in auditor/engine_seam.py only."""
    named = [p.relative_to(ROOT).as_posix() for p in _auditor_modules()
             if p.name != "engine_seam.py" and any(w in p.read_text() for w in ("AsyncEngine(", "EngineProcess("))]
    assert not named, named
    assert engine_seam.load_engine.__module__ == "auditor.engine_seam"


def test_no_module_probes_the_engine() -> None:
    """No getattr / hasattr on anything named engine or stats (the seam declares what exists)."""
    found = []
    for path in _auditor_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and node.args and any(w in ast.unparse(node.args[0]) for w in ("engine", "stats"))):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
