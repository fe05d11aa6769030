"""bench/grammar_bench.py's comparison of engine/grammar.py against another revision."""
from __future__ import annotations

from bench.grammar_bench import steps_against
from engine.loader import load_model_source


def test_steps_against_a_revision_times_both_and_compares_their_masks() -> None:
    source = load_model_source("default")
    eos = sorted(source.info.eos_token_ids)
    out = steps_against(source, int(source.hf_config.vocab_size), eos, "HEAD", rows=3, steps=40, walks=2)
    for mode in ("nondeterministic", "dvr"):
        entry = out[mode]
        assert entry["same_masks_and_states"] is True
        for side in ("this", "against"):
            assert len(entry[side]["walks_us"]) == 2 and entry[side]["fastest_us"] == min(entry[side]["walks_us"]) > 0
