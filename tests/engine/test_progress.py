"""engine/progress.py: stage lines, meters off a terminal, and replay progress from the AsyncEngine."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from engine import progress
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm import LLM
from engine.model_runner import LoadedModel
from tests.engine.dvr_cases import det_workload, replay_requests
from tests.engine.mock_model import MockModel


def test_stage_logs_start_and_end_but_no_end_on_failure(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="engine.load")
    with progress.stage("model 'x': reading"):
        pass
    with pytest.raises(RuntimeError), progress.stage("model 'y': digest"):
        raise RuntimeError("boom")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "model 'x': reading ..." and messages[1].startswith("model 'x': reading: done (")
    assert messages[2:] == ["model 'y': digest ..."]


def test_meter_off_a_terminal_logs_counts_not_bars(caplog: pytest.LogCaptureFixture, capsys) -> None:
    caplog.set_level(logging.INFO, logger="engine.load")
    items = list(progress.track(iter(range(5)), "weights digest", 5, "tensor"))
    assert items == list(range(5)) and caplog.records == []  # under LOG_EVERY_S: nothing to say
    meter = progress.Meter("replay t1", "token", every_s=0.0)
    for done in (2, 4, 6):
        meter.update(done, 6)
    meter.close()
    assert [r.getMessage() for r in caplog.records] == ["replay t1: 2/6 tokens (33 %)", "replay t1: 4/6 tokens (66 %)"]
    assert "%|" not in capsys.readouterr().err  # no bar drawn into a non-terminal


async def test_replay_reports_progress_up_to_every_recorded_token() -> None:
    cfg = dict(window=8, group=4, num_kv_blocks=64)
    prompts, params = det_workload(6, 64, max_tokens=(10, 30), seed=5)
    model = MockModel()
    made = LLM.from_parts(EngineConfig(**cfg), model, model.shape, {1}).generate(prompts, params)
    info = SimpleNamespace(eos_token_ids=(1,))
    engine = AsyncEngine(EngineConfig(**cfg), LoadedModel(model, model.shape, None, info))
    seen: list[tuple[int, int]] = []
    await engine.start()
    try:
        results = await engine.replay(replay_requests(prompts, params, made),
                                      on_progress=lambda done, total: seen.append((done, total)))
    finally:
        await engine.shutdown()
    total = sum(len(o.token_ids) for o in made)
    assert all(r.match for r in results)
    assert len(seen) > 2 and {t for _, t in seen} == {total}
    counts = [d for d, _ in seen]
    assert counts == sorted(set(counts)) and counts[-1] == total  # strictly growing, ending at every token
