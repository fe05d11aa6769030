"""The serving benchmark (bench/serve_bench.py) end to end on the CPU: the tiny synthetic model served by
`python -m auditor serve`, two modes, one rate, a few requests per point. Checks the JSON's fields, that the
service and the engine alone produced the same tokens, and the verification checks (every transcript
verifies, the checkpoint's tree size equals the number of transcripts, a tampered transcript is caught)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import serve_bench as sb

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STREAM_TOKENS = 16
# warm-up 3 x 2 modes; streams: 2 alone x 2 modes + 2 at once x 2 modes; ramp: (2 at 2 req/s + 3 at once in
# each of 2 runs, --service-repeats following --core-repeats) x 2 modes
EXPECTED_TRANSCRIPTS = 6 + 8 + 16


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("serve-bench")
    cmd = [sys.executable, "bench/serve_bench.py", "--model", "synthetic:tiny:peaked", "--device", "cpu", "--quick",
           "--out", str(out), "--name", "smoke", "--engine-option", "num_threads=1", "--det-shares", "0,1",
           "--saturation-requests", "3", "--saturation-s", "0", "--rates", "2", "--point-s", "1",
           "--min-point-requests", "2",
           "--max-point-requests", "2", "--stream-tokens", str(STREAM_TOKENS), "--stream-prompt-tokens", "16",
           "--stream-concurrency", "2", "--stream-repeats", "2", "--core-repeats", "2", "--clients", "1",
           "--deadline-s", "240"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "VERBATIM_WORKERS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return {"out": out, "doc": json.loads((out / "smoke.json").read_text())}


def test_run_records_its_command_commit_device_and_plots(smoke: dict) -> None:
    doc = smoke["doc"]
    env = doc["environment"]
    assert "bench/serve_bench.py" in env["command"] and "--quick" in env["command"]
    assert len(env["git_commit"]) == 40 and env["date_utc"].startswith("20") and env["device"]["type"] == "cpu"
    assert env["device"]["name"] and doc["model"] == "synthetic:tiny:peaked"
    assert doc["service"]["served_model"] == "synthetic:tiny:peaked" and doc["service"]["exit_code"] == 0
    # the service's settings as it got them, inherited ones included, and the worker processes it started
    assert doc["service"]["environment"]["VERBATIM_WORKERS"] == "1" and doc["service"]["workers"] == 1
    assert doc["service"]["environment"]["VERBATIM_MODEL"] == "synthetic:tiny:peaked"
    # on the CPU nothing is placed: no engine CPUs, every service process on every allowed CPU
    allowed = sorted(os.sched_getaffinity(0))
    assert env["engine_cpus"] is None and env["client_cpus"] is None
    assert doc["service"]["process_cpus"] and all(cpus == allowed for cpus in doc["service"]["process_cpus"])
    for png in ("smoke.png", "smoke-streams.png"):
        assert (smoke["out"] / png).read_bytes()[:4] == b"\x89PNG"


def test_every_point_has_the_figures_and_the_service_matches_the_engine(smoke: dict) -> None:
    doc = smoke["doc"]
    assert doc["ramp"]["rates_req_per_s"] == [2.0]
    for name in ("dvr_0pct", "dvr_100pct"):
        engine = doc["engine_alone"]["modes"][name]
        assert engine["core"]["finished"] == engine["core"]["requests"] == 3 and engine["core"]["output_tok_per_s"] > 0
        assert engine["async"]["completed"] == 3 and engine["async"]["output_tokens"] == engine["core"]["output_tokens"]
        mode = doc["ramp"]["modes"][name]
        for key, count in (("2", 2), ("inf", 3)):
            point = mode["points"][key]
            assert point["requests"] == point["completed"] == count and point["errors"] == 0
            assert point["output_tok_per_s"] > 0 and point["req_per_s"] > 0 and point["service_cores"] > 0
            for metric in ("ttft_s", "headers_s", "e2e_s", "itl_s", "tpot_s", "chunk_gap_s"):
                assert 0 <= point[metric]["p50"] <= point[metric]["p99"] <= point[metric]["max"], (name, key, metric)
            # the headers go out before the first token, which comes before the end
            assert point["headers_s"]["n"] == count and point["headers_s"]["max"] <= point["ttft_s"]["max"]
            assert len(point["samples"]["ttft_s"]) == count
        # ignore_eos: the same requests give the same number of tokens through the API and the engine alone
        assert mode["points"]["inf"]["output_tokens"] == engine["core"]["output_tokens"]
        # the engine core's figure is the median of --core-repeats runs, each recorded, and so is the service's
        # saturation figure (--service-repeats, by default as many); a rate point is one run
        runs = engine["core"]["runs_tok_per_s"]
        assert len(runs) == 2 and round(engine["core"]["output_tok_per_s"], 1) in runs
        runs = mode["points"]["inf"]["runs_tok_per_s"]
        assert len(runs) == 2 and round(mode["points"]["inf"]["output_tok_per_s"], 1) in runs
        assert "repeats_skipped" not in mode["points"]["inf"] and "runs_tok_per_s" not in mode["points"]["2"]
        assert mode["saturation"]["ratio_to_engine_core"] > 0 and mode["saturation"]["ratio_to_engine_async"] > 0
        # the engine's counters over each point (the service's /metrics) and each core run (EngineStats)
        for counters in (mode["points"]["inf"]["engine"], mode["points"]["2"]["engine"], engine["core"]["engine"]):
            assert counters["steps"] > 0 and counters["prefill_passes"] > 0 and 0 < counters["busy"] <= 1.0
        sat_engine = mode["points"]["inf"]["engine"]
        core_engine = engine["core"]["engine"]
        assert sat_engine["generated_tokens"] == core_engine["generated_tokens"] == engine["core"]["output_tokens"]
        assert (sat_engine["verify_passes"] > 0) == (name == "dvr_100pct")
        assert mode["saturation"]["service_engine_busy"] == sat_engine["busy"]
        # the service's engine loop: its idle and publishing shares beside the steps' (the core's loop has neither)
        assert mode["saturation"]["service_engine_publish"] == sat_engine["publish"] > 0
        assert mode["saturation"]["service_engine_commands"] == sat_engine["commands"] > 0
        # the loop's counted time fits in the point's span (waits for commands are not counted)
        assert sat_engine["busy"] + sat_engine["commands"] + sat_engine["publish"] <= 1.01
        assert core_engine["command_seconds"] == core_engine["publish_seconds"] == 0
        assert mode["saturation"]["core_steps_per_100_tokens"] > 0
        assert mode["saturation"]["service_steps_per_100_tokens"] > 0


def test_streams_give_every_tokens_arrival_in_both_modes(smoke: dict) -> None:
    for streams in (smoke["doc"]["streams"], smoke["doc"]["engine_alone"]["streams"]):
        for kind, count in (("single", 2), ("concurrent", 2)):
            for det in ("nondeterministic", "deterministic"):
                runs = streams[kind][det]
                assert len(runs) == count
                for run in runs:
                    arrivals = run["token_arrival_s"]
                    assert run["tokens"] == len(arrivals) == STREAM_TOKENS
                    assert arrivals == sorted(arrivals) and arrivals[0] == pytest.approx(run["ttft_s"], abs=1e-4)
                    assert run["e2e_s"] >= run["last_token_s"] >= run["ttft_s"] > 0
        summary = streams["summary"]
        assert summary["single"]["decode_step_s"] > 0 and summary["single"]["e2e_ratio"] > 0
        assert summary["single"]["max_gap_steps"]["deterministic"] > 0
        assert summary["concurrent"]["p99_gap_steps"]["deterministic"] > 0


def test_every_transcript_verifies_and_the_tree_holds_them_all(smoke: dict) -> None:
    checks = smoke["doc"]["checks"]
    assert checks["all_ok"] is True, checks
    assert checks["transcripts_sent"] == checks["transcripts_verified"] == EXPECTED_TRANSCRIPTS
    assert checks["checkpoint"]["tree_size"] == EXPECTED_TRANSCRIPTS and checks["checkpoint"]["signature_ok"]
    assert checks["log_indices_are_0_to_size"] and checks["transcripts_failed"] == checks["requests_failed"] == 0
    tamper = checks["tamper_control"]
    assert tamper["detected"] and any(p.startswith("output_commitment") for p in tamper["problems"])
    assert smoke["doc"]["targets"]["checks_all_ok"] is True


def test_deterministic_flags_hold_the_share_in_every_prefix() -> None:
    for share in (0.0, 0.1, 0.5, 1.0):
        flags = sb.deterministic_flags(200, share)
        for n in (1, 10, 37, 200):
            assert abs(sum(flags[:n]) - share * n) < 1
    assert sb.deterministic_flags(20, 0.1) == [i % 10 == 9 for i in range(20)]


def test_a_chunks_gap_is_spread_over_its_tokens() -> None:
    record = {"t_send": 10.0, "t_end": 11.5, "completion_tokens": 4, "chunks": [[10.5, 1], [11.1, 3]]}
    failed = {"t_send": 10.2, "t_end": 10.3, "completion_tokens": 0, "chunks": [], "error": "boom"}
    m = sb.point_metrics([record, failed])
    assert (m["completed"], m["errors"], m["output_tokens"]) == (1, 1, 4)
    assert m["seconds"] == pytest.approx(1.5) and m["output_tok_per_s"] == pytest.approx(4 / 1.5)
    assert m["ttft_s"]["p50"] == pytest.approx(0.5) and m["e2e_s"]["max"] == pytest.approx(1.5)
    assert m["itl_s"]["n"] == 3 and m["itl_s"]["p50"] == pytest.approx(0.2) and m["itl_s"]["max"] == pytest.approx(0.2)
    assert m["chunk_gap_s"]["n"] == 1 and m["chunk_gap_s"]["max"] == pytest.approx(0.6)
    assert m["tpot_s"]["p50"] == pytest.approx(0.2)
    stream = sb.stream_stats(record)
    assert stream["token_arrival_s"] == [0.5, 1.1, 1.1, 1.1] and stream["max_chunk_gap_s"] == pytest.approx(0.6)


def _stream(t_send: float, chunks: list[list[float]]) -> dict:
    return sb.stream_stats({"t_send": t_send, "t_end": chunks[-1][0], "chunks": chunks})


def test_the_decode_step_is_the_mean_gap_of_plain_streams_even_when_their_chunks_arrive_bunched() -> None:
    """Eight plain streams of 1 ms steps whose chunks reach the client in bunches (most gaps ~0, every fourth
    ~4 ms): the step is 1 ms, not the median gap, and a deterministic stream's 10 ms gaps are 10 steps."""
    bunched = [[0.01 + 0.004 * (i // 4), 1] for i in range(41)]  # 4 tokens a bunch, 4 ms apart: 40 ms, 40 gaps
    plain = [_stream(0.0, bunched)] * 8
    det = [_stream(0.0, [[0.01 + 0.01 * j, 10] for j in range(4)]) for _ in range(8)]
    summary = sb.stream_summary({"single": {"nondeterministic": plain[:1], "deterministic": det[:1]},
                                 "concurrent": {"nondeterministic": plain, "deterministic": det}})
    conc = summary["concurrent"]
    assert conc["decode_step_s"] == pytest.approx(0.001, rel=0.02)
    assert conc["p99_gap_steps"]["deterministic"] == pytest.approx(10, rel=0.02)
    assert summary["single"]["max_gap_steps"]["deterministic"] == pytest.approx(10, rel=0.05)


def test_resummarize_rewrites_the_summaries_and_targets_from_the_recorded_streams(tmp_path: Path) -> None:
    plain = [_stream(0.0, [[0.01 + 0.001 * i, 1] for i in range(40)])]
    det = [_stream(0.0, [[0.012 + 0.01 * j, 10] for j in range(4)])]
    streams = {"single": {"nondeterministic": plain, "deterministic": det}, "concurrent": {}, "summary": {}}
    doc = {"streams": streams, "engine_alone": {"streams": json.loads(json.dumps(streams))},
           "checks": {"all_ok": True}, "ramp": {"modes": {"dvr_0pct": {"saturation": {"ratio_to_engine_core": 0.95}}}}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    assert sb.main(["--resummarize", str(path)]) == 0
    out = json.loads(path.read_text())
    for s in (out["streams"]["summary"], out["engine_alone"]["streams"]["summary"]):
        assert s["single"]["decode_step_s"] == pytest.approx(0.001) and s["single"]["ttft_ratio"] == pytest.approx(1.2)
    assert out["targets"]["single_max_gap_le_16_steps"] is True and out["targets"]["single_ttft_ratio_le_1.10"] is False
    assert out["targets"]["service_over_engine_core_ge_0.90"] == {"dvr_0pct": True}


def test_poisson_arrivals_keep_their_rate() -> None:
    offsets = sb.poisson_offsets(4000, 50.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / 3999 == pytest.approx(1 / 50, rel=0.06)
    assert sb.poisson_offsets(5, float("inf"), seed=1) == [0.0] * 5


def test_the_saturation_set_grows_until_the_engine_core_runs_it_for_the_target_time() -> None:
    """``size_saturation`` on the tiny model's real engine core: a set whose core run is shorter than
    --saturation-s grows to the next multiple of 256 that the probe's rate says lasts that long, the pool
    grows with it (its first requests unchanged), and a target of 0 keeps the set as given."""
    from auditor.app import load_engine
    from auditor.settings import Settings

    engine = load_engine(Settings(model="synthetic:tiny:peaked", device="cpu", engine_process=False,
                                  engine_options={"num_threads": 1}))
    core = engine.core
    vocab = min(core.shape.vocab_size, len(engine.tokenizer))
    plan = {"set": "sharegpt-32x20", "pool_size": 4, "seed": 0, "top_p": 0.95, "top_p_share": 0.5,
            "temperature": 0.8, "det_shares": [0.0, 1.0], "saturation_requests": 4, "engine_cap_s": 60.0}
    pool = sb.request_pool(plan, vocab)
    kept = {"requests": list(pool)}
    steps = core.stats().steps
    assert sb.size_saturation(core, {**plan, "saturation_s": 0.0}, kept, vocab) == 4
    assert kept["saturation"]["requests"] == 4 and kept["requests"] == pool
    assert core.stats().steps == steps  # no target: no probe runs

    grown = {"requests": list(pool)}
    n = sb.size_saturation(core, {**plan, "saturation_s": 30.0}, grown, vocab)
    probe = grown["saturation"]
    assert probe["requests_probed"] == 4 and 0 < probe["probe_seconds"] < 30 and probe["mode"] == "dvr_0pct"
    assert probe["probe_seconds"] == min(probe["probe_runs_s"]) and len(probe["probe_runs_s"]) == 2
    assert n == probe["requests"] == 256 * math.ceil(4 * 30.0 / probe["probe_seconds"] / 256)
    assert len(grown["requests"]) == n and grown["requests"][:4] == pool
    assert not core.has_work()


def test_the_service_record_names_its_worker_processes_from_its_start_up_line(tmp_path: Path) -> None:
    service = sb.Service(tmp_path / "data", tmp_path / "serve.log", "synthetic:tiny", "cpu", {})
    service.log_path.write_text("Verbatim listening on http://127.0.0.1:8000 with 4 worker processes; one engine\n")
    assert service.workers() == 4
    service.log_path.write_text("Verbatim listening on http://127.0.0.1:8000\n")
    assert service.workers() == 1
