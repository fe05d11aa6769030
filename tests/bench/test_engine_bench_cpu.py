"""The GPU benchmark's pure-Python parts on the CPU: section presets, budgets, the clock, the mode runner
over a tiny synthetic model, and the summary / chart of a result (no CUDA needed)."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.engine_bench import cli, common, mixes, report, smollm2
from bench.engine_bench import modes as mode_runs


def test_presets_expand_in_order_without_duplicates() -> None:
    assert cli.expand_sections("core") == list(cli.SECTION_PRESETS["core"])
    assert cli.expand_sections("bandwidth,core")[0] == "bandwidth"
    assert cli.expand_sections("bandwidth,core").count("bandwidth") == 1
    assert cli.expand_sections("all") == list(cli.ALL_SECTIONS)
    assert set(cli.ALL_SECTIONS) == set(cli.SECTIONS)
    with pytest.raises(ValueError, match="unknown sections"):
        cli.expand_sections("core,nope")


def test_compare_modes_is_the_whole_comparison() -> None:
    """`python -m bench engine --compare-modes` (issue 6's command): every mode-comparison section and the
    W/G sweep, whatever --sections says."""
    args = cli.parse_args(["--compare-modes", "--sections", "core"])
    assert args.section_names == ["smollm2_rollback", "compare_modes", "compare_modes_synthetic",
                                  "compare_modes_synthetic_long", "wg_sweep"]
    assert cli.parse_args([]).section_names == list(cli.SECTION_PRESETS["core"])


def test_budgets_parse() -> None:
    assert cli.parse_budgets("") == {}
    assert cli.parse_budgets("90")["wg_sweep"] == 90.0
    assert cli.parse_budgets("wg_sweep=200,hf_generate=60") == {"wg_sweep": 200.0, "hf_generate": 60.0}
    with pytest.raises(ValueError, match="unknown section"):
        cli.parse_budgets("nope=3")


def test_parse_args_defaults() -> None:
    args = cli.parse_args(["--sections", "modes,long", "--budget-s", "wg_sweep=5"])
    assert args.section_names == ["smollm2_rollback", "compare_modes", "compare_modes_synthetic",
                                  "compare_modes_synthetic_long"]
    # the default injected rate is the committed SmolLM2 measurement the constant cites
    rollback = Path(__file__).resolve().parents[2] / "bench/results/2026-11-29-h200/gpu-bench-rollback.json"
    w32 = json.loads(rollback.read_text())["smollm2_rollback"]["runs"]["W32-canonical"]
    assert args.fault_rate == smollm2.COMMITTED_SMOLLM2_FAULT_RATE == w32["rollbacks_per_committed_token"]
    assert args.long_sets == ["16x4096x1024"] and args.synthetic_sets == ["sharegpt", "16x1024x256", "sharegpt-896x640"]
    assert args.rollback_decode_attention == ["canonical", "split"]
    # --decode-cublaslt-min-rows: unset = the engine's default; 0 and other values kept
    assert args.decode_cublaslt_min_rows is None and common.cublaslt_min_rows(args) == 32
    assert common.cublaslt_min_rows(cli.parse_args(["--decode-cublaslt-min-rows", "0"])) == 0
    assert cli.parse_args(["--fault-rate", "0.02"]).fault_rate == 0.02
    # --fuse-rope-canonical: unset keeps the module's value; on / off only
    assert args.fuse_rope_canonical is None and cli.parse_args(["--fuse-rope-canonical", "on"]).fuse_rope_canonical == "on"
    with pytest.raises(SystemExit):
        cli.parse_args(["--fuse-rope-canonical", "yes"])
    # --query-tile: unset keeps the module's DEFAULT_QUERY_TILE (16); 16 / 32 / 64 only
    assert args.query_tile is None and cli.parse_args(["--query-tile", "64"]).query_tile == 64
    with pytest.raises(SystemExit):
        cli.parse_args(["--query-tile", "48"])
    # --prefill-pass-tile (plain prefill passes) and --verify-decode-rows (D): unset = the engine's
    assert args.prefill_pass_tile is None and cli.parse_args(["--prefill-pass-tile", "64"]).prefill_pass_tile == 64
    with pytest.raises(SystemExit):
        cli.parse_args(["--prefill-pass-tile", "8"])
    assert args.verify_decode_rows is None and cli.parse_args(["--verify-decode-rows", "0"]).verify_decode_rows == 0
    assert args.concurrent_carried is None and cli.parse_args(["--concurrent-carried", "on"]).concurrent_carried == "on"
    # the A/B flags: unset = the engine's defaults, W = 32, every mode
    ab_flags = (args.canonical_prefill_min_tokens, args.verify_early_decode, args.window, args.modes)
    assert ab_flags == (None, None, 32, [])
    ab = cli.parse_args(["--canonical-prefill-min-tokens", "2048", "--verify-early-decode", "on", "--window", "16",
                        "--modes", "nondeterministic,dvr_100pct"])
    assert (ab.canonical_prefill_min_tokens, ab.verify_early_decode, ab.window) == (2048, "on", 16)
    assert ab.modes == ["nondeterministic", "dvr_100pct"]
    # --canonical-prefill-chunk-tokens: unset = the engine's; a value reaches every engine's DvrTuning
    assert args.canonical_prefill_chunk_tokens is None
    chunked = cli.parse_args(["--canonical-prefill-chunk-tokens", "256"])
    assert chunked.canonical_prefill_chunk_tokens == 256
    ctx = common.Ctx(args=chunked, device=torch.device("cpu"), result={}, out_dir=Path("."), name="r")
    assert common.engine_config(ctx, device="cuda").tuning.canonical_prefill_chunk_tokens == 256
    assert args.chained_verify is None and cli.parse_args(["--chained-verify", "on"]).chained_verify == "on"
    with pytest.raises(SystemExit):
        cli.parse_args(["--sections", "nope"])


def _ctx(tmp_path: Path, left_s: float = 600.0, modes: list[str] | None = None) -> common.Ctx:
    args = argparse.Namespace(mode_repeats=2, profile_modes=["dvr_100pct"], modes=modes or [], sampling="greedy")
    ctx = common.Ctx(args=args, device=torch.device("cpu"), result={}, out_dir=tmp_path, name="r")
    ctx.deadline = time.perf_counter() + left_s
    return ctx


def test_clock_budget_and_checkpoint(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    ctx.begin("wg_sweep", budget_s=100.0)
    assert 90 < ctx.left() <= 100 and ctx.cap(30) == 30 and ctx.cap(1000) <= 100
    assert ctx.has_time(50, "x") and not ctx.truncated
    assert not ctx.has_time(500, "y") and ctx.truncated
    out = ctx.open({"runs": {}})
    out["runs"]["a"] = 1
    ctx.checkpoint("a done")
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["wg_sweep"] == {"runs": {"a": 1}, "in_progress": True}
    ctx.begin("hf_generate", budget_s=None)
    assert not ctx.truncated and ctx.live is None and ctx.left() > 500


@pytest.fixture(scope="module")
def tiny_make() -> Any:
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.model_runner import ModelShape
    from engine.models.synthetic import build_synthetic_model

    model = build_synthetic_model("tiny", torch.float32, "cpu", seed=0, peaked=True)
    shape = ModelShape(model.arch.num_layers, model.arch.num_kv_heads, model.arch.head_dim, model.arch.vocab_size, 512)

    def make(mode: str, share: float) -> Any:
        config = EngineConfig(model="synthetic", device="cpu", dtype="float32", mode=mode, window=4, group=2,
                              num_kv_blocks=64, max_num_seqs=8, fault_rate=0.1, fault_seed=5)
        llm = LLM.from_parts(config, model, shape, eos_ids=set())
        llm.bench_graphs = llm.core.runner.graphs_status
        return llm

    return make


def test_run_modes_fills_every_mode_and_the_summary_and_chart(tmp_path: Path, tiny_make: Any) -> None:
    ctx = _ctx(tmp_path)
    ctx.begin("compare_modes_synthetic", None)
    res = ctx.open({"fault_rate": 0.1, "fault_rate_source": "test", "modes": {}})
    prompts = [[3 + i, 5, 7, 9 + i] for i in range(6)]
    mode_runs._run_modes(ctx, tiny_make, prompts, [6, 3, 8, 5, 4, 7], 60.0, "t", res["modes"])
    modes = res["modes"]
    assert list(modes) == [name for name, _, _ in mixes.MODES]
    for name, entry in modes.items():
        if "error" in entry:  # a mode this CPU build refuses is recorded, not raised
            continue
        assert entry["finished"] == 6 and not entry["capped"], name
        assert entry["committed_tokens"] == 33 and "ratio_to_nondeterministic" in entry
        # two timed runs on the warm engine; the stats are the reported run's own (not the warm-up's)
        assert entry["repeats"] == 2 and len(entry["runs_seconds"]) == 2, name
        assert entry["stats"]["generated_tokens"] == 33 and entry["stats"]["running"] == 0, name
        assert entry["p50_latency_s"] <= entry["p99_latency_s"]
        walls = entry["step_wall_s"]  # every step of the reported run, by kind
        assert sum(k["steps"] for k in walls.values()) == entry["stats"]["steps"], name
        assert walls["prefill"]["steps"] == entry["stats"]["prefill_passes"], name
        assert walls.get("verify", {"steps": 0})["steps"] == entry["stats"]["verify_passes"], name
        assert sum(walls[k]["steps"] for k in ("decode", "decode_after_other") if k in walls) == \
            entry["stats"]["decode_passes"], name
    assert modes["dvr_100pct"]["deterministic_requests"] == 6 and modes["dvr_50pct"]["deterministic_requests"] == 3
    assert modes["dvr_100pct"]["stats"]["verify_passes"] > 0
    # --profile-modes: the named mode alone gets a profiled run (no kernels on the CPU)
    assert modes["dvr_100pct"]["profiled_run"]["gpu_busy_s"] == 0.0
    assert all("profiled_run" not in e for n, e in modes.items() if n != "dvr_100pct")
    assert json.loads((tmp_path / "r.json").read_text())["compare_modes_synthetic"]["in_progress"]
    ctx.result["compare_modes_synthetic"] = res
    ctx.result["environment"] = {"device": "cpu", "date_utc": "now", "command": "test"}
    text = report.summary(ctx.result)
    assert "compare_modes_synthetic dvr_100pct" in text and "summary failed" not in text
    report.chart(ctx.result, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_run_modes_runs_only_the_modes_asked_for(tmp_path: Path, tiny_make: Any) -> None:
    """--modes: the other modes are neither run nor recorded; the ratio still has its baseline."""
    ctx = _ctx(tmp_path, modes=["nondeterministic", "dvr_100pct"])
    ctx.begin("compare_modes_synthetic", None)
    res = ctx.open({"modes": {}})
    mode_runs._run_modes(ctx, tiny_make, [[3, 5, 7, 9], [4, 5, 7, 10]], [5, 3], 60.0, "t", res["modes"])
    assert list(res["modes"]) == ["nondeterministic", "dvr_100pct"]
    assert res["modes"]["dvr_100pct"]["stats"]["verify_passes"] > 0
    assert "ratio_to_nondeterministic" in res["modes"]["dvr_100pct"]


def test_step_kind_reads_the_pass_counters() -> None:
    assert mode_runs.step_kind((0, 0, 0), (1, 0, 0), "decode") == "prefill"
    assert mode_runs.step_kind((1, 2, 3), (1, 3, 3), "decode") == "verify"
    assert mode_runs.step_kind((1, 2, 3), (1, 2, 4), "decode") == "decode"
    assert mode_runs.step_kind((1, 2, 3), (1, 2, 4), "decode_after_other") == "decode"
    assert mode_runs.step_kind((1, 2, 3), (1, 2, 4), "verify") == "decode_after_other"
    assert mode_runs.step_kind((1, 2, 3), (1, 2, 3), "decode") == "idle"


def test_profiled_mode_run_reports_its_run(tmp_path: Path, tiny_make: Any) -> None:
    """--profile-modes: one more run under torch.profiler, reported with the GPU's busy time and gaps (on
    the CPU no kernel is recorded: zero busy time, the run itself complete)."""
    ctx = _ctx(tmp_path)
    ctx.begin("compare_modes_synthetic", None)
    llm = tiny_make("dvr", 1.0)
    res = mode_runs._profiled_mode_run(ctx, llm, [[3, 5, 7, 9], [4, 6]], [5, 3], {0, 1}, 60.0, "p")
    assert res["wall_s"] > 0 and res["gpu_busy_s"] == 0.0 and res["gaps_s"] == 0.0
    assert res["step_wall_s"]["verify"]["steps"] >= 1


def test_out_of_budget_modes_are_skipped_and_marked(tmp_path: Path, tiny_make: Any) -> None:
    ctx = _ctx(tmp_path, left_s=5.0)
    ctx.begin("compare_modes", None)
    modes: dict[str, Any] = {}
    mode_runs._run_modes(ctx, tiny_make, [[1, 2, 3]], [4], 60.0, "t", modes)
    assert ctx.truncated and all(v == {"skipped": "time budget"} for v in modes.values())


def test_summary_reads_committed_results() -> None:
    """Every committed GPU bench result (bench/results/<date>-<machine>/) gives a summary."""
    results = Path(__file__).resolve().parents[2] / "bench" / "results"
    paths = sorted(results.rglob("gpu-bench-*.json"))
    assert len(paths) >= 4, paths
    for path in paths:
        assert "summary failed" not in report.summary(json.loads(path.read_text())), path


@pytest.mark.parametrize("name", ["canonical_step_probe.py", "step_probe.py", "verify_probe.py"])
def test_probe_scripts_import_and_parse_their_arguments(name: str) -> None:
    """The H200 diagnostics `bench/canonical_step_probe.py`, `bench/step_probe.py` and `bench/verify_probe.py`
    load on a CPU checkout: their imports from bench.engine_bench resolve and --help lists
    their options (the timing itself needs CUDA)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / name
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300,
                         check=True).stdout
    assert "--context" in out and "--reps" in out
    if name == "verify_probe.py":
        assert "--programs" in out
    if name == "step_probe.py":
        assert "--split-sweep" in out and "--only-split-sweep" in out


def test_drive_reports_the_decode_phase(tmp_path: Path, tiny_make: Any) -> None:
    """engine_generate's decode-phase rate counts the tokens after every request holds its first one,
    over the time after that step: fewer tokens than the whole run, in less time."""
    from engine.sampling import SamplingParams

    ctx = _ctx(tmp_path)
    ctx.begin("engine_generate", None)
    llm = tiny_make("nondeterministic", 0.0)
    prompts = [[3 + i, 5, 7, 9 + i] for i in range(6)]
    res = common.drive(ctx, llm.core, prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                    60.0, "dp")
    assert res["committed_tokens"] == 72 and res["finished"] == 6
    assert 0 < res["decode_phase_s"] < res["seconds"] and res["decode_phase_tok_per_s"] > 0
    # at most 11 tokens per request are left once each holds one
    assert res["decode_phase_tok_per_s"] * res["decode_phase_s"] <= 66 + 1e-6


def test_set_specs_and_the_sharegpt_matched_mix() -> None:
    assert mixes.parse_set_spec("sharegpt", 128) == ("mix", "modes", (512, 128))
    assert mixes.parse_set_spec("sharegpt-896x640", 128) == ("mix", "mix_896x640", (896, 640))
    assert mixes.parse_set_spec("16x1024x256", 128) == ("fixed", "fixed_16x1024x256", (16, 1024, 256))
    for bad in ("sharegpt-896", "sharegpt-16x640", "16x1024", "4x0x3", "sharegpt-ax3"):
        with pytest.raises(ValueError, match="request set"):
            mixes.parse_set_spec(bad, 128)
    # the 96 requests the bench draws (seeds 11 / 13): the matched mix averages ShareGPT's per-request means
    # as SGLang's benchmark samples them (676,842 / 3000 = 226 prompt, 613,123 / 3000 = 204 output tokens)
    # within 2 %; the plain mix's outputs are 3.4x shorter
    prompts, outputs = mixes.sharegpt_like_lengths(96, 11, 16, 896), mixes.sharegpt_like_lengths(96, 13, 16, 640)
    assert min(prompts + outputs) >= 16 and max(prompts) <= 896 and max(outputs) <= 640
    assert abs(sum(prompts) / 96 / (676842 / 3000) - 1) < 0.02
    assert abs(sum(outputs) / 96 / (613123 / 3000) - 1) < 0.02
    short = mixes.sharegpt_like_lengths(96, 13, 16, 128)
    assert 3.3 < (613123 / 3000) / (sum(short) / 96) < 3.5
    # the distribution's mean, which the draws follow
    assert abs(mixes.log_uniform_mean(16, 896) / (sum(prompts) / 96) - 1) < 0.05


def test_sampling_presets_set_the_mix_requests_parameters() -> None:
    from bench.engine_bench.cli import parse_args
    from bench.engine_bench.mixes import SAMPLING_PRESETS, mix_params

    assert parse_args(["--sampling", "top_p"]).sampling == "top_p"
    p = mix_params("top_p", 12, True, 3)
    assert (p.temperature, p.top_p, p.max_tokens, p.deterministic, p.seed, p.ignore_eos) == (0.8, 0.95, 12, True, 3, True)
    assert mix_params("greedy", 5, False, 1).temperature == 0.0
    assert set(SAMPLING_PRESETS) == {"greedy", "temperature", "top_p", "top_k", "min_p"}


@pytest.mark.parametrize(("command", "flag"), [("engine", "--sections"), ("replay", "--transcripts"),
                                              ("cpu", "--det-shares"), ("bi-matmul", "--shapes")])
def test_python_m_bench_reaches_each_command(command: str, flag: str) -> None:
    """`python -m bench COMMAND --help` (the commands bench/h200.sh runs) reaches that command's parser."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "bench", command, "--help"], capture_output=True, text=True,
                          timeout=300, cwd=root)
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: python -m bench {command}"), proc.stderr
    assert flag in proc.stdout


def test_python_m_bench_names_its_commands() -> None:
    from bench.__main__ import COMMANDS, main

    assert main(["nope"]) == 2 and main([]) == 2
    assert set(COMMANDS) == {"engine", "replay", "cpu", "bi-matmul"}


def test_replay_bench_smoke_on_the_cpu(tmp_path: Path) -> None:
    """`python -m bench replay --device cpu` on the tiny synthetic preset: every replay reproduces its
    transcript, and the result lands at <out>/<name>.json through the one results writer."""
    from bench.engine_bench import replay

    code = replay.main(["--device", "cpu", "--preset", "tiny", "--transcripts", "3", "--tokens", "10",
                        "--prompt-len", "6", "--window", "4", "--group", "2", "--out", str(tmp_path), "--name", "r"])
    result = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and result["all_match"] and result["matches"] == 3
    assert result["command"].startswith("python -m bench replay")
