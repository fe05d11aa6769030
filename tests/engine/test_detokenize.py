"""engine.detokenize: the byte table gives exactly what tokenizer.decode gives, and other tokenizers fall back."""
from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch

from engine import detokenize
from engine.detokenize import Detokenizer


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    from engine.loader import load_model_source

    return load_model_source("default", torch.float32, None).tokenizer


def test_byte_table_equals_the_tokenizer_on_random_ids_and_split_characters(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    detok = Detokenizer(tok)
    assert detok.uses_table
    rng = random.Random(7)
    for _ in range(500):  # random ids: invalid UTF-8 fragments, special and added tokens among them
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 200))]
        assert detok(ids) == tok.decode(ids, skip_special_tokens=True), ids
    text = "Grüße, 世界! 🙂🚀 naïve café — ok<|im_end|> end"
    ids = tok.encode(text)
    for n in range(len(ids) + 1):  # every prefix: characters split across tokens decode alike
        assert detok(ids[:n]) == tok.decode(ids[:n], skip_special_tokens=True), n
    assert detok([len(tok) + 5]) == tok.decode([len(tok) + 5], skip_special_tokens=True)  # outside the table


def test_a_cleanup_flag_the_tokenizer_ignores_keeps_the_table_and_one_it_applies_does_not(
        smollm2_tokenizer: Any) -> None:
    """A tokenizer config may set clean_up_tokenization_spaces while transformers ignores it for BPE (the table
    still decodes exactly); where the tokenizer does clean up, the table would keep the spaces it removes."""
    tok = copy.deepcopy(smollm2_tokenizer)
    text = "Yes , it is . Is it ? I 'm sure it 's fine , is n't it ! we 've we 're"
    ids = tok.encode(text, add_special_tokens=False)
    tok.clean_up_tokenization_spaces = True
    detok = Detokenizer(tok)
    assert detok.uses_table
    assert detok(ids) == tok.decode(ids, skip_special_tokens=True) == text
    tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    cleaned = tok.decode(ids, skip_special_tokens=True)
    assert cleaned != text  # this tokenizer does clean up
    detok = Detokenizer(tok)
    assert not detok.uses_table
    assert detok(ids) == cleaned


def test_the_cleanup_probe_alone_refuses_a_table_the_tokenizer_cleans_up(smollm2_tokenizer: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With no random samples, the check's clean-up text still tells the two tokenizers apart."""
    monkeypatch.setattr(detokenize, "CHECK_SINGLE_IDS", 0)
    monkeypatch.setattr(detokenize, "CHECK_SEQUENCES", 0)
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.clean_up_tokenization_spaces = True
    assert Detokenizer(tok).uses_table
    tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert not Detokenizer(tok).uses_table


def test_other_tokenizers_use_their_own_decode() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    detok = Detokenizer(tok)
    assert not detok.uses_table
    assert detok([1, 2, 1]) == tok.decode([1, 2, 1], skip_special_tokens=True)
