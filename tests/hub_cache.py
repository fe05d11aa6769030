"""A Hugging Face hub cache on disk, laid out as huggingface_hub writes it, holding real models made here.

    <cache>/models--<org>--<name>/
        blobs/<sha256>                       file contents, stored once
        refs/<branch or tag>                 the commit hash it points at
        snapshots/<commit>/<file>            relative symlinks into blobs/

No network: tests point HF_HOME / HF_HUB_CACHE (or `hub_cache=`) here and set HF_HUB_OFFLINE=1.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any


def tiny_llama(folder: Path, tokenizer: Any, seed: int) -> Path:
    """A small random Llama (2 layers, hidden 64) with `tokenizer`'s vocabulary, saved as an HF folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def add_commit(cache: Path, repo_id: str, commit: str, source: Path, refs: tuple[str, ...] = ()) -> Path:
    """Store every top-level file of `source` as commit `commit` (40 hex) of `repo_id`; point `refs` at it.
    Returns the snapshot folder."""
    repo = repo_folder(cache, repo_id)
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in source.iterdir() if p.is_file()):
        data = file.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
