"""EngineConfig's GPU fields on CUDA: graph-captured decode/verify and the KV budget from free memory.

CUDA graphs change how a step is launched, never what it computes: deterministic outputs with
`cuda_graphs=True` must equal the eager engine's bit for bit (DVR commits only verifier tokens, and the
verify graph is used only when it matched eager bit for bit at capture).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.engine.dvr_cases import assert_same

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three prime numbers:", "Roses are red,",
           "Explain photosynthesis in one sentence.", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def smol(gpu_smollm2_source: Any) -> Any:
    from engine.model_runner import ModelShape
    from engine.models import arch_from_hf, build_model

    source = gpu_smollm2_source
    model = build_model(source.hf_config, torch.bfloat16, "cuda", "triton")
    model.load_weights(source.weights())
    arch = arch_from_hf(source.hf_config)
    shape = ModelShape(arch.num_layers, arch.num_kv_heads, arch.head_dim, arch.vocab_size, source.info.max_model_len)
    return source, model, shape


def make(smol: Any, **cfg: Any) -> LLM:
    source, model, shape = smol
    config = EngineConfig.from_options({"device": "cuda", "dtype": "bfloat16", "attention_backend": "triton",
                                        "window": 16, "group": 4, "max_num_seqs": 16, "cuda_graphs": False, **cfg})
    return LLM.from_parts(config, model, shape, set(source.info.eos_token_ids), source.tokenizer)


def run(llm: LLM) -> list[Any]:
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    det = [SamplingParams(max_tokens=48, temperature=t, seed=7 + i, deterministic=True)
           for i, t in enumerate([0.0, 0.8] * 3)]
    fast = [SamplingParams(max_tokens=40, temperature=0.7, seed=100 + i) for i in range(len(ids))]
    outs = llm.generate(ids + ids, det + fast)
    return outs[: len(ids)]


def test_graphs_do_not_change_committed_bits(smol: Any) -> None:
    eager = make(smol, num_kv_blocks=400)
    want = run(eager)
    graphed = make(smol, num_kv_blocks=400, cuda_graphs=True)
    status = graphed.core.runner.graphs_status
    print(f"[graphs] {status}")
    assert status.startswith("decode"), status
    got = run(graphed)
    assert_same(want, got)
    assert all(o.verify_passes >= 1 for o in got)
    # canonical_step (a step holding a DVR row runs every row canonical): another fast path, the same bits
    stepped = make(smol, num_kv_blocks=400, cuda_graphs=True, dvr_decode_attention="canonical_step")
    assert stepped.core.runner.decode_graphs.canonical_step
    assert_same(want, run(stepped))


def test_kv_budget_follows_free_memory(smol: Any) -> None:
    from engine.gpu_memory import kv_bytes_per_block

    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    llm = make(smol, kv_memory_share=0.05)
    runner = llm.core.runner
    per_block = kv_bytes_per_block(smol[2].num_layers, smol[2].num_kv_heads, smol[2].head_dim, 16, torch.bfloat16)
    kv_bytes = runner.num_kv_blocks * per_block
    print(f"[kv] blocks={runner.num_kv_blocks} bytes={kv_bytes} free_before={free_before}")
    assert llm.config.num_kv_blocks == runner.num_kv_blocks
    assert 0.04 * free_before <= kv_bytes <= 0.05 * free_before + per_block


@pytest.mark.parametrize("attention", ["canonical", "canonical_step", "canonical_step_short", "split"])
def test_graph_decode_step_allocates_nothing(smol: Any, attention: str) -> None:
    """A steady-state graph decode step stages into static buffers and returns a view of the static
    float32 logits: no device allocation. DVR with canonical decode passes the static canonical_rows."""
    from engine.model_runner import Row

    llm = make(smol, num_kv_blocks=400, cuda_graphs=True, dvr_decode_attention=attention)
    runner = llm.core.runner
    assert runner.decode_graphs is not None, runner.graphs_status
    assert runner.decode_graphs.canonical == (attention != "split")
    assert runner.decode_graphs.canonical_step == (attention in ("canonical_step", "canonical_step_short"))
    if runner.long_decode_graphs is not None:  # canonical_step_short: the long family keeps the side stream
        assert runner.long_decode_graphs.canonical_step == (attention == "canonical_step")
    rows = [Row([5 + i], 20 + i, [2 + 2 * i, 3 + 2 * i], i % 2 == 0) for i in range(5)]  # blocks of no sequence
    first = runner.decode(rows).clone()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(3):
        logits = runner.decode(rows)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    assert logits.dtype == torch.float32 and tuple(logits.shape) == (5, smol[2].vocab_size)
    assert torch.equal(logits, first)  # same inputs, same KV writes: the replay is deterministic
    flags = runner.decode_graphs.static.canonical_rows(runner.decode_graphs.padded_size(5)).tolist()
    assert flags == ([1, 0, 1, 0, 1] if attention != "split" else [0] * 5) + [0] * (len(flags) - 5)


def test_a_canonical_family_replays_its_plain_graph_when_no_row_is_canonical(smol: Any) -> None:
    """DVR with canonical decode rows captures each size twice: a step with no canonical row replays the
    graph without the canonical branch, and its logits are the split engine's bit for bit; a step with
    one replays the canonical graph (the flagged row's logits differ from the split kernel's)."""
    from engine.model_runner import Row

    canon = make(smol, num_kv_blocks=400, cuda_graphs=True, dvr_decode_attention="canonical").core.runner
    split = make(smol, num_kv_blocks=400, cuda_graphs=True, dvr_decode_attention="split").core.runner
    graphs = canon.decode_graphs
    assert graphs is not None and graphs.canonical and set(graphs.plain_graphs) == set(graphs.graphs)
    for runner in (canon, split):  # the same (arbitrary, disjoint) KV content in both caches
        for layer in range(len(runner.kv.k)):
            g = torch.Generator(device="cuda").manual_seed(layer)
            live = runner.kv.k[layer][2:]  # blocks 0 and 1 are the zero and scratch blocks
            live.copy_(torch.randn(live.shape, generator=g, device="cuda"))
            runner.kv.v[layer][2:].copy_(torch.randn(live.shape, generator=g, device="cuda"))
    # 4 blocks of 16 slots per row: positions 30 .. 58, inside each row's table
    plain_rows = [Row([5 + i], 30 + 7 * i, [2 + 4 * i, 3 + 4 * i, 4 + 4 * i, 5 + 4 * i], False) for i in range(5)]
    calls = {"plain": 0, "canonical": 0}
    for name, table in (("plain", graphs.plain_graphs), ("canonical", graphs.graphs)):
        for size, graph in list(table.items()):
            def counted(graph: Any = graph, name: str = name) -> None:
                calls[name] += 1
                torch.cuda.CUDAGraph.replay(graph)
            graph.replay = counted  # type: ignore[method-assign]
    # both engines write the same K/V for these rows: compare right after the same writes
    a, b = canon.decode(plain_rows).clone(), split.decode(plain_rows).clone()
    assert calls == {"plain": 1, "canonical": 0}, calls
    assert torch.equal(a, b)
    flagged = [Row(r.tokens, r.start_pos, r.block_table, i == 0) for i, r in enumerate(plain_rows)]
    canon.decode(flagged)
    assert calls == {"plain": 1, "canonical": 1}, calls


def test_rows_past_the_first_graph_family_use_the_long_family(smol: Any, monkeypatch: Any) -> None:
    """With the first family capped at 32 tokens, rows past it replay the second family (captured up to
    max_model_len) instead of running eagerly: the same committed bits, and the long graphs really ran.
    Fast rows of one fixed batch give the eager bits too (same kernels, same shapes)."""
    import engine.cuda_graphs as cg

    monkeypatch.setattr(cg, "GRAPH_MAX_LEN", 32)
    want = run(make(smol, num_kv_blocks=400, max_model_len=256))
    graphed = make(smol, num_kv_blocks=400, max_model_len=256, cuda_graphs=True)
    runner = graphed.core.runner
    assert runner.long_decode_graphs is not None and "+long256" in runner.graphs_status, runner.graphs_status
    assert runner.decode_graphs.max_blocks * 16 == 32 and runner.long_decode_graphs.max_blocks * 16 == 256
    used = {"long": 0}
    long_run = runner.long_decode_graphs.run

    def counting(*a: Any, **kw: Any) -> Any:
        out = long_run(*a, **kw)
        used["long"] += out is not None
        return out

    runner.long_decode_graphs.run = counting
    assert_same(want, run(graphed))
    assert used["long"] > 0, used


def test_the_verify_graph_serves_rows_past_the_first_decode_family(smol: Any, monkeypatch: Any) -> None:
    """The verify graph's block table spans max_model_len (its kernel grid does not depend on the table
    width): with the decode families split at 32 tokens, verify passes over rows longer than that still
    replay the graph, and commit the eager engine's bits."""
    import engine.cuda_graphs as cg

    monkeypatch.setattr(cg, "GRAPH_MAX_LEN", 32)
    want = run(make(smol, num_kv_blocks=400, max_model_len=256))
    graphed = make(smol, num_kv_blocks=400, max_model_len=256, cuda_graphs=True)
    runner = graphed.core.runner
    assert runner.verify_graph is not None and "+verify" in runner.graphs_status, runner.graphs_status
    assert runner.verify_graph.max_blocks * 16 == 256
    widest = {"rows_past_32": 0, "eager": 0}
    stage = runner.verify_graph.stage

    def counting(ids: Any, positions: Any, slots: Any, seq_lens: Any, tables: Any, qsl: Any = None) -> bool:
        ok = stage(ids, positions, slots, seq_lens, tables, qsl)
        widest["rows_past_32"] += ok and max(int(n) for n in seq_lens) > 32
        widest["eager"] += not ok
        return ok

    runner.verify_graph.stage = counting
    assert_same(want, run(graphed))
    assert widest["rows_past_32"] > 0 and widest["eager"] == 0, widest


def test_cublaslt_decode_graphs_keep_committed_bits_and_restore_the_preference(smol: Any) -> None:
    """decode_cublaslt_min_rows: decode graphs of >= N padded rows capture their GEMMs with cuBLASLt. The fast
    path only: committed deterministic bits equal the eager engine's, and torch's BLAS preference is
    restored after capture (prefill and verify keep cuBLAS)."""
    before = torch.backends.cuda.preferred_blas_library()
    want = run(make(smol, num_kv_blocks=400))
    llm = make(smol, num_kv_blocks=400, cuda_graphs=True, decode_cublaslt_min_rows=4)
    graphs = llm.core.runner.decode_graphs
    assert graphs is not None and graphs.cublaslt_min_rows == 4
    assert [graphs.blas_for(b) for b in (1, 2, 4, 16)] == [None, None, "cublaslt", "cublaslt"]
    assert torch.backends.cuda.preferred_blas_library() == before
    assert_same(run(llm), want)


def test_the_defaults_capture_graphs_and_size_the_sequence_limit(smol: Any) -> None:
    """EngineConfig() on CUDA, as `serve` builds it with no options: decode and verify graphs captured (the verify
    graph bit-exact with eager), the running-sequence limit sized from the KV budget."""
    source, model, shape = smol
    llm = LLM.from_parts(EngineConfig(device="cuda"), model, shape, set(source.info.eos_token_ids), source.tokenizer)
    config = llm.core.config
    assert config.cuda_graphs and config.tuning.overlap and config.max_num_batched_tokens == 8192
    assert llm.core.runner.graphs_status.startswith("decode") and "+verify" in llm.core.runner.graphs_status
    slots = (config.num_kv_blocks - 2) * config.block_size
    assert config.max_num_seqs == min(256, slots // 1024) == 256, (config.max_num_seqs, slots)


FILTERED = [SamplingParams(max_tokens=48, temperature=0.9, top_p=0.95, seed=5, deterministic=True, logprobs=3),
            SamplingParams(max_tokens=48, temperature=0.8, top_k=50, min_p=0.05, seed=6, deterministic=True),
            SamplingParams(max_tokens=48, temperature=1.0, top_p=0.9, top_k=40, seed=7, deterministic=True)]
OTHERS = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=0.8, top_p=0.95),
          dict(temperature=1.0, top_k=50), dict(temperature=0.7, min_p=0.05), dict(temperature=0.8, logprobs=2)]


def _bits(out: Any) -> list[Any]:
    return [out.token_ids, out.token_logprobs, out.top_logprobs]


@pytest.mark.parametrize("graphs", [False, True])
def test_sampling_filters_alone_and_among_255_others_keep_every_bit(smol: Any, graphs: bool) -> None:
    """A deterministic row with top-p / top-k / min-p / top logprobs commits the same token ids and logprobs alone
    and among 255 other requests with other parameters (deterministic and not), eager and under CUDA graphs."""
    source, model, shape = smol
    llm = make(smol, num_kv_blocks=6000, max_num_seqs=256, cuda_graphs=graphs)
    tok = llm.tokenizer
    target = [tok.encode(f"Tell me about the planet number {i}.") for i in range(len(FILTERED))]
    alone = [_bits(o) for o in llm.generate(target, FILTERED)]
    crowd_prompts = [tok.encode(f"Crowd request {i}: describe a {['river', 'bird', 'clock'][i % 3]}.")
                     for i in range(256 - len(FILTERED))]
    crowd_params = [SamplingParams(max_tokens=24 + i % 40, seed=1000 + i, deterministic=i % 3 == 0, **OTHERS[i % 6])
                    for i in range(len(crowd_prompts))]
    at = 100
    prompts = crowd_prompts[:at] + target + crowd_prompts[at:]
    params = crowd_params[:at] + FILTERED + crowd_params[at:]
    outs = llm.generate(prompts, params)
    together = [_bits(o) for o in outs[at:at + len(FILTERED)]]
    assert together == alone
    eager = make(smol, num_kv_blocks=6000, max_num_seqs=256, cuda_graphs=False) if graphs else llm
    assert [_bits(o) for o in eager.generate(target, FILTERED)] == alone
