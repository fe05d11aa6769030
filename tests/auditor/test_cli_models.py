"""The ``verbatim`` command: flags over ``VERBATIM_*`` over defaults; a model served by Hugging Face id from
a hub cache on disk (HF_HUB_OFFLINE=1), under its own or the given name; replay with progress; ``serve``
exiting non-zero, naming the model, when it cannot load; start-up progress on a pipe and on a terminal."""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from auditor.cli import build_parser, settings_from
from auditor.cosignature import Cosigner
from auditor.settings import Settings
from tests.auditor.conftest import free_port
from tests.hub_cache import add_commit, tiny_llama

ROOT = Path(__file__).resolve().parents[2]
REPO = "verbatim-test/tiny-llama"
# the console script's own entry point, as pip writes it into bin/verbatim
VERBATIM = [sys.executable, "-c",
            "import sys; from auditor.cli import main; sys.argv[0] = 'verbatim'; sys.exit(main())"]


# a witness's cosigner vkey (C2SP tlog-cosignature), as `verbatim witness vkey` prints one
VKEY = Cosigner(Ed25519PrivateKey.from_private_bytes(bytes(range(32))), "witness.test/w1").key.vkey()


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


# --- flags, environment, defaults ---------------------------------------------------------------------


def test_flag_over_environment_over_default() -> None:
    env = {"VERBATIM_MODEL": "org/from-env", "VERBATIM_DEVICE": "cpu", "VERBATIM_SERVED_MODEL_NAME": "env-name",
           "VERBATIM_BOOTSTRAP_ADMIN": "true", "VERBATIM_ENGINE_OPTIONS": '{"window": 8}', "VERBATIM_PORT": "9000"}
    flags = settings_from(parse("serve", "--model", "org/from-flag", "--no-bootstrap-admin", "--engine-options",
                                '{"window": 16}', "--served-model-name", "flag-name"), env)
    assert (flags.model, flags.served_model_name, flags.bootstrap_admin) == ("org/from-flag", "flag-name", False)
    assert flags.engine_options == {"window": 16} and (flags.device, flags.port) == ("cpu", 9000)
    from_env = settings_from(parse("serve"), env)
    assert (from_env.model, from_env.served_model_name, from_env.bootstrap_admin) == ("org/from-env", "env-name", True)
    assert from_env.engine_options == {"window": 8}
    assert settings_from(parse("serve"), {}) == Settings()


def test_every_setting_is_a_serve_flag() -> None:
    values = {"host": "0.0.0.0", "port": "8123", "data_dir": "/srv/v", "database_url": "sqlite+aiosqlite:///x.db",
              "database_schema": "s1", "log_origin": "example.org/log", "model": "org/m@v1", "served_model_name": "m",
              "device": "cpu", "max_body_bytes": "2048", "max_prompt_tokens": "7", "max_tokens_limit": "9",
              "max_n": "3",
              "rate_limit_per_second": "1.5", "rate_limit_burst": "3", "replay_max_queued": "2", "log_level": "DEBUG",
              "engine_options": '{"group": 4}', "engine_factory": "tests.auditor.fake_engine:from_settings",
              "redis_url": "redis://127.0.0.1:6379/0", "key_reload_interval": "2.5",
              "witnesses": '[{"url": "http://127.0.0.1:8090", "vkey": "%s"}]' % VKEY, "witness_quorum": "1",
              "witness_interval": "0.5", "witness_timeout": "3", "api_key_cache_seconds": "0.5",
              "log_check_interval_seconds": "60", "tensor_parallel_size": "2", "workers": "3",
              "engine_cpus": "6-7,14"}
    argv = ["serve", "--no-deterministic-default", "--no-bootstrap-admin", "--keep-serving-on-load-error",
            "--no-engine-process"]
    for name, value in values.items():
        argv += ["--" + name.replace("_", "-"), value]
    settings = settings_from(parse(*argv), {})
    expected = Settings(host="0.0.0.0", port=8123, data_dir=Path("/srv/v"), database_url="sqlite+aiosqlite:///x.db",
                        database_schema="s1", log_origin="example.org/log", model="org/m@v1", served_model_name="m",
                        device="cpu", deterministic_default=False, max_body_bytes=2048, max_prompt_tokens=7,
                        max_tokens_limit=9, max_n=3, rate_limit_per_second=1.5, rate_limit_burst=3, replay_max_queued=2,
                        log_level="DEBUG", bootstrap_admin=False, keep_serving_on_load_error=True,
                        engine_process=False, engine_options={"group": 4}, engine_factory="tests.auditor.fake_engine:from_settings",
                        redis_url="redis://127.0.0.1:6379/0", key_reload_interval=2.5,
                        witnesses=(("http://127.0.0.1:8090", VKEY),), witness_quorum=1, witness_interval=0.5,
                        witness_timeout=3.0, api_key_cache_seconds=0.5, log_check_interval_seconds=60.0,
                        tensor_parallel_size=2, workers=3, engine_cpus="6-7,14")
    assert settings == expected
    assert {f.name for f in dataclasses.fields(Settings)} == {*values, "deterministic_default", "bootstrap_admin",
                                                              "keep_serving_on_load_error", "engine_process"}
    with pytest.raises(SystemExit):
        parse("serve", "--witnesses", '[{"url": "ftp://w"}]')


def test_replay_takes_the_engine_settings_and_export_model_stays_a_filter() -> None:
    replay = settings_from(parse("replay", "t1", "--model", "org/m", "--device", "cpu"), {"VERBATIM_MODEL": "x/y"})
    assert (replay.model, replay.device) == ("org/m", "cpu")
    export = parse("export", "--tenant", "acme", "--model", "org/m")
    assert export.model == "org/m" and settings_from(export, {}).model == "default"


def test_generate_engine_options_flag_over_environment() -> None:
    from engine.cli import engine_config_options

    env = {"VERBATIM_MODEL": "org/env", "VERBATIM_DEVICE": "cpu",
           "VERBATIM_ENGINE_OPTIONS": '{"window": 8, "group": 2}'}
    assert engine_config_options(parse("generate", "hi", "--window", "4"), env) == {
        "model": "org/env", "device": "cpu", "window": 4, "group": 2}
    assert engine_config_options(parse("generate", "hi", "--model", "org/flag", "--engine-options", '{"group": 3}'),
                                 env) == {"model": "org/flag", "device": "cpu", "group": 3}
    assert engine_config_options(parse("generate", "hi"), {}) == {}
    assert engine_config_options(parse("generate", "hi", "--tensor-parallel-size", "2", "--tp-reduction", "nccl"),
                                 {}) == {"tensor_parallel_size": 2, "tp_reduction": "nccl"}


def test_serve_tensor_parallel_size_reaches_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from auditor import engine_seam
    from auditor.engine_seam import load_engine

    built: list[Any] = []
    monkeypatch.setattr(engine_seam, "AsyncEngine", built.append)
    monkeypatch.setattr(engine_seam, "EngineProcess", built.append)
    for extra in ((), ("--no-engine-process",)):  # the engine process (default) and the engine thread
        settings = settings_from(parse("serve", "--tensor-parallel-size", "2", "--device", "cpu",
                                       "--engine-options", '{"window": 8}', *extra), {})
        load_engine(settings)
    assert len(built) == 2
    for config in built:
        assert (config.tensor_parallel_size, config.window, config.tp_reduction) == (2, 8, "gather_sum")
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        settings_from(parse("serve", "--tensor-parallel-size", "0"), {})


def test_bad_flag_values_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("serve", "--engine-options", "[1]")
    assert "--engine-options: must be a JSON object, got list" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("serve", "--port", "eighty")
    assert "--port" in capsys.readouterr().err
    from auditor.cli import main

    assert main(["serve", "--port", "70000", "--data-dir", "/nonexistent/verbatim"]) == 2
    assert "port must be in 1..65535, got 70000" in capsys.readouterr().err


def test_console_script_is_declared_and_runs() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"verbatim": "auditor.cli:main"}
    result = subprocess.run([*VERBATIM, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("usage: verbatim")
    for command in ("serve", "generate", "keys", "replay", "verify", "export", "verify-bundle", "migrate"):
        assert f"    {command}" in result.stdout, command


def test_make_setup_installs_every_declared_dependency() -> None:
    """`make setup` installs requirements.txt, then the package with --no-deps: every dependency the package
    declares (extras included) must be in requirements.txt, or a fresh machine would lack it."""
    def name(requirement: str) -> str:
        return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {name(r) for r in project["dependencies"]}
    declared |= {name(r) for extra in project["optional-dependencies"].values() for r in extra}
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    pinned = {name(line.split("#")[0]) for line in lines if line.split("#")[0].strip()}
    assert declared - {"verbatim"} <= pinned, sorted(declared - {"verbatim"} - pinned)
    assert "torch==2.13.0" in (ROOT / "Makefile").read_text()


def test_reference_lists_every_setting_and_subcommand() -> None:
    reference = (ROOT / "docs" / "cli.md").read_text()
    for f in dataclasses.fields(Settings):
        flag, variable = "--" + f.name.replace("_", "-"), "VERBATIM_" + f.name.upper()
        assert f"| `{flag}` | `{variable}` |" in reference, f.name
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for command in commands:
        assert f"`verbatim {command}" in reference, command


# --- a model by Hugging Face id, served and replayed ------------------------------------------------


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """$HF_HOME whose hub cache holds REPO (refs/main) as huggingface_hub lays it out."""
    from engine.loader import load_model_source

    root = tmp_path_factory.mktemp("hf")
    tokenizer = load_model_source("default").tokenizer
    add_commit(root / "home" / "hub", REPO, "e" * 40, tiny_llama(root / "model", tokenizer, seed=3), refs=("main",))
    return root / "home"


def offline_env(hf_home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VERBATIM_", "HF_"))}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **extra}


def wait_ready(process: subprocess.Popen[str], base: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited {process.returncode}: {process.communicate()[0]}")
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise AssertionError("server not ready in time")


def stop(process: subprocess.Popen[str]) -> str:
    process.send_signal(signal.SIGINT)
    return process.communicate(timeout=60)[0]


@pytest.mark.slow
def test_hub_id_is_served_under_the_given_name_and_replays_with_progress(hf_home: Path, tmp_path: Path) -> None:
    data, port = tmp_path / "data", free_port()
    env = offline_env(hf_home, VERBATIM_MODEL="/nonexistent/overridden-by-the-flag",
                      VERBATIM_SERVED_MODEL_NAME="house-model", VERBATIM_DEVICE="cpu")
    key = subprocess.run([*VERBATIM, "keys", "create", "--tenant", "acme", "--role", "client", "--data-dir", str(data)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert key.returncode == 0, key.stderr
    secret = key.stdout.strip().splitlines()[-1]
    server = subprocess.Popen([*VERBATIM, "serve", "--model", REPO, "--port", str(port), "--data-dir", str(data),
                               "--no-bootstrap-admin"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(server, base)
        client = openai.OpenAI(base_url=base + "/v1", api_key=secret, max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == ["house-model"]
        completion = client.completions.create(model="house-model", prompt="Hello there", max_tokens=6, seed=11,
                                               extra_body={"deterministic": True, "ignore_eos": True})
        assert completion.model == "house-model"
        transcript_id = (completion.model_extra or {})["transcript"]["id"]
        with pytest.raises(openai.NotFoundError, match="this server serves 'house-model'"):
            client.completions.create(model=REPO, prompt="Hi", max_tokens=2)
        doc = httpx.get(f"{base}/v1/transcripts/{transcript_id}", headers={"Authorization": f"Bearer {secret}"},
                        timeout=30).json()
        assert doc["transcript"]["model"] == "house-model"
    finally:
        log = stop(server)
    assert server.returncode == 0, log  # a graceful stop on SIGINT
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    messages = [line["msg"] for line in lines]
    assert any(m.startswith(f"model {REPO!r}: resolving") for m in messages), messages
    assert any("weights digest over" in m for m in messages) and any(m.startswith("engine: ready") for m in messages)

    replay = subprocess.run([*VERBATIM, "replay", transcript_id, "--model", REPO, "--data-dir", str(data)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=600)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert f"of transcript {transcript_id}: MATCH" in replay.stdout
    for expected in (f"model {REPO!r}: resolving ...", f"model {REPO!r}: weights digest over", "engine: ready",
                     f"replay of transcript {transcript_id} ...", f"replay of transcript {transcript_id}: done"):
        assert expected in replay.stderr, replay.stderr


@pytest.mark.parametrize(("model", "says"), [
    ("/nonexistent/verbatim-model", "model: path '/nonexistent/verbatim-model' does not exist"),
    ("verbatim-test/not-cached", "`hf download verbatim-test/not-cached`"),
])
def test_serve_exits_non_zero_naming_the_model_it_cannot_load(hf_home: Path, tmp_path: Path, model: str,
                                                               says: str) -> None:
    result = subprocess.run([*VERBATIM, "serve", "--model", model, "--port", str(free_port()), "--data-dir",
                             str(tmp_path / "data")], cwd=ROOT, env=offline_env(hf_home), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"error: model {model!r} could not be loaded, so the server stopped" in result.stderr
    assert says in result.stderr


# --- start-up progress: log lines on a pipe, a bar on a terminal ------------------------------------


def generate(hf_home: Path, stderr: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([*VERBATIM, "generate", "Hi", "--model", REPO, "--device", "cpu", "--max-tokens", "2",
                             "--ignore-eos"], cwd=ROOT, env=offline_env(hf_home), stdout=subprocess.PIPE,
                            stderr=stderr, text=True)


def test_generate_logs_each_start_up_stage_on_a_pipe(hf_home: Path) -> None:
    process = generate(hf_home, subprocess.PIPE)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    stages = [f"model {REPO!r}: resolving ...", f"model {REPO!r}: snapshot ", f"model {REPO!r}: reading config",
              f"model {REPO!r}: weights digest over", f"model {REPO!r}: weights digest ", f"model {REPO!r}: loading",
              f"engine: ready, model {REPO!r}"]
    positions = [err.find(s) for s in stages]
    assert -1 not in positions and positions == sorted(positions), err
    assert "%|" not in err  # no progress bar drawn into a pipe
    assert f"model='{REPO}'" in err


def test_generate_draws_progress_bars_on_a_terminal(hf_home: Path) -> None:
    main_fd, terminal_fd = os.openpty()
    # a terminal 100 columns wide (a fresh pseudo-terminal is 0 x 0, where tqdm draws an empty bar)
    fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    process = generate(hf_home, terminal_fd)
    os.close(terminal_fd)
    drawn = b""
    while True:
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:  # the terminal's last writer exited
            break
        if not chunk:
            break
        drawn += chunk
    os.close(main_fd)
    assert process.wait(timeout=300) == 0, drawn.decode(errors="replace")
    assert b"weights digest: " in drawn and b"loading weights: " in drawn and b"%|" in drawn and b" tensor" in drawn
