"""Settings: environment once, flags over environment, bad values refused with the variable named."""

from pathlib import Path

import pytest

from auditor.ratelimit import RateLimiter
from auditor.settings import Settings


def test_environment_then_flags() -> None:
    env = {"VERBATIM_PORT": "9000", "VERBATIM_DETERMINISTIC_DEFAULT": "false", "VERBATIM_DATA_DIR": "/srv/v",
           "VERBATIM_ENGINE_OPTIONS": '{"window": 16}'}
    settings = Settings.from_env(env, port=9100, host=None)
    assert (settings.port, settings.deterministic_default, settings.host) == (9100, False, "127.0.0.1")
    assert settings.data_dir == Path("/srv/v") and settings.engine_options == {"window": 16}
    assert settings.resolved_database_url == "sqlite+aiosqlite:////srv/v/verbatim.db"
    assert Settings().deterministic_default is True


@pytest.mark.parametrize(("env", "message"), [
    ({"VERBATIM_PORT": "x"}, "VERBATIM_PORT"), ({"VERBATIM_PORT": "70000"}, "port"),
    ({"VERBATIM_DETERMINISTIC_DEFAULT": "maybe"}, "VERBATIM_DETERMINISTIC_DEFAULT"),
    ({"VERBATIM_ENGINE_OPTIONS": "[1]"}, "ENGINE_OPTIONS"),
    ({"VERBATIM_REPLAY_MAX_QUEUED": "0"}, "replay_max_queued"),
])
def test_bad_values_name_the_setting(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings.from_env(env)


def test_unknown_override_raises() -> None:
    with pytest.raises(ValueError, match="unknown settings"):
        Settings.from_env({}, colour="blue")


def test_token_bucket() -> None:
    now = [0.0]
    limiter = RateLimiter(rate=2.0, burst=2, clock=lambda: now[0])
    assert [limiter.acquire("k") for _ in range(2)] == [None, None]
    assert limiter.acquire("k") == pytest.approx(0.5)
    assert limiter.acquire("other") is None
    now[0] = 0.5
    assert limiter.acquire("k") is None and limiter.acquire("k") is not None


def test_replay_queue_limit_reaches_the_replay_service(tmp_path: Path) -> None:
    from auditor.app import create_app
    from auditor.replay import ReplayService

    settings = Settings.from_env({"VERBATIM_REPLAY_MAX_QUEUED": "3"}, data_dir=tmp_path, bootstrap_admin=False)
    app = create_app(settings, engine_loader=lambda _s: None)
    assert ReplayService.for_app(app).max_queued == 3
