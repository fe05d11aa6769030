"""Token ids -> text, cheap enough to run for every running request after every step.

The engine turns a request's committed ids into text after each step that commits some (stop strings are
judged on it, and the service streams its growth). Through `tokenizer.decode` that costs tens of
microseconds per request per step in Python, which at a few hundred running requests is more host time
than a decode step on a GPU. For byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM2) decoding is the
concatenation of each id's bytes, read as UTF-8 with invalid sequences replaced; `Detokenizer` keeps those
bytes per id in a table and decodes with one join, after checking at construction that it gives exactly
what `tokenizer.decode(ids, skip_special_tokens=True)` gives on a sample of ids and id sequences, and on a
text where `clean_up_tokenization_spaces` would change the decoded text (a tokenizer config may set the flag
while the installed transformers ignores it for BPE: the check asks the tokenizer what it does). Any other
tokenizer, or one the check does not pass, is decoded by the tokenizer itself.
"""
from __future__ import annotations

import random
from typing import Any

CHECK_SEQUENCES = 300        # random id sequences compared with tokenizer.decode at construction
CHECK_SINGLE_IDS = 2000      # and single ids
# every pattern transformers' clean_up_tokenization removes a space from, each after a word
CLEANUP_PROBE = "a . b , c ? d ! e n't f 'm g 's h 've i 're j"


def byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's reversible map of the 256 byte values to printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class Detokenizer:
    """`detok(ids) -> str`, equal to `tokenizer.decode(ids, skip_special_tokens=True)`."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        table = _byte_table(tokenizer)
        self._table = table if table is not None and _agrees(tokenizer, table) else None

    @property
    def uses_table(self) -> bool:
        return self._table is not None

    def __call__(self, ids: list[int]) -> str:
        table = self._table
        if table is not None:
            try:  # ids are >= 0 (sampled or validated); one past the table is left to the tokenizer
                return b"".join([table[i] for i in ids]).decode("utf-8", "replace")
            except IndexError:
                pass
        return self._tokenizer.decode(ids, skip_special_tokens=True)


def _byte_table(tokenizer: Any) -> list[bytes] | None:
    """Each id's bytes (special ids: none), or None when the tokenizer is not byte-level BPE."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None or type(decoder).__name__ != "ByteLevel":
        return None
    decoders = getattr(tokenizer, "added_tokens_decoder", {})
    special = set(getattr(tokenizer, "all_special_ids", ())) | {i for i, t in decoders.items() if t.special}
    added = {i: t.content for i, t in decoders.items()}
    to_byte = byte_decoder()
    table: list[bytes] = []
    for i in range(len(tokenizer)):
        if i in special:
            table.append(b"")
        elif i in added:
            table.append(added[i].encode("utf-8"))
        else:
            token = tokenizer.convert_ids_to_tokens(i)
            if token is None or any(c not in to_byte for c in token):
                return None
            table.append(bytes(to_byte[c] for c in token))
    return table


def _agrees(tokenizer: Any, table: list[bytes]) -> bool:
    rng = random.Random(0)
    n = len(table)
    samples = [[rng.randrange(n)] for _ in range(min(CHECK_SINGLE_IDS, n))]
    samples += [[rng.randrange(n) for _ in range(rng.randrange(1, 48))] for _ in range(CHECK_SEQUENCES)]
    samples.append(list(tokenizer.encode(CLEANUP_PROBE, add_special_tokens=False)))
    return all(b"".join(table[i] for i in ids).decode("utf-8", "replace")
               == tokenizer.decode(ids, skip_special_tokens=True) for ids in samples)
