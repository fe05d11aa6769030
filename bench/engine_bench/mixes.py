"""The request sets of the mode comparison: ShareGPT-like length mixes, fixed sets, sampling presets, and the
modes compared."""
from __future__ import annotations

import math
from typing import Any

import torch

MODES: list[tuple[str, str, float]] = [("nondeterministic", "nondeterministic", 0.0)] + [
    (f"dvr_{p}pct", "dvr", p / 100) for p in (2, 10, 50, 100)] + [("batch_invariant", "batch_invariant", 1.0)]


def sharegpt_like_lengths(n: int, seed: int, lo: int, hi: int) -> list[int]:
    """Log-uniform lengths in [lo, hi]: many short, a long tail (the shape of ShareGPT's outputs)."""
    rng = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=rng, dtype=torch.float64)
    return [int(round(math.exp(math.log(lo) + x * (math.log(hi) - math.log(lo))))) for x in u.tolist()]


def log_uniform_mean(lo: int, hi: int) -> float:
    """The mean of the log-uniform distribution on [lo, hi] (what `sharegpt_like_lengths` draws from)."""
    return (hi - lo) / math.log(hi / lo)


# Synthetic request-set specs of compare_modes_synthetic(_long):
#   "sharegpt"            the mix: prompts log-uniform in [16, 512], outputs in [16, --compare-tokens]
#   "sharegpt-PxO"        the mix with prompts in [16, P] and outputs in [16, O]. "sharegpt-896x640": its 96
#                         requests average 226 prompt and 201 output tokens, the per-request means of ShareGPT
#                         (ShareGPT_V3_unfiltered_cleaned_split) as SGLang's serving benchmark samples it: 3000
#                         prompts, 676,842 input and 613,123 generated tokens = 226 / 204 (the SGLang author's
#                         published run, gist.github.com/merrymercy/e3041f0029db232adbe845cf995b3290). The plain
#                         "sharegpt" mix (outputs <= 128: mean 59) is ShareGPT's shape with outputs 3.4x shorter.
#   "NxPxO"               N requests of exactly P prompt and O output tokens
MIX_LO = 16


def parse_set_spec(spec: str, compare_tokens: int) -> tuple[str, str, tuple[int, ...]]:
    """A set spec -> (kind "mix" | "fixed", result key, numbers): ("mix", "modes", (512, compare_tokens)) for
    "sharegpt", ("mix", "mix_PxO", (P, O)) for "sharegpt-PxO", ("fixed", "fixed_NxPxO", (N, P, O))."""
    def ints(text: str, count: int) -> tuple[int, ...]:
        parts = text.split("x")
        if len(parts) != count or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise ValueError(f"request set {spec!r}: expected {count} positive integers joined by 'x'")
        return tuple(int(x) for x in parts)

    if spec == "sharegpt":
        return "mix", "modes", (512, compare_tokens)
    if spec.startswith("sharegpt-"):
        p_max, o_max = ints(spec[len("sharegpt-"):], 2)
        if min(p_max, o_max) <= MIX_LO:
            raise ValueError(f"request set {spec!r}: the maxima must exceed the minimum length {MIX_LO}")
        return "mix", f"mix_{p_max}x{o_max}", (p_max, o_max)
    return "fixed", f"fixed_{spec}", ints(spec, 3)


def request_sets(sec_res: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(result key, modes) of a mode-comparison section's request sets below its top level (the top level
    holds the "sharegpt" mix's modes): "mix_PxO" and "fixed_NxPxO" entries, in result order."""
    return [(k, v.get("modes", {})) for k, v in sec_res.items()
            if k.startswith(("fixed_", "mix_")) and isinstance(v, dict)]


# --sampling presets of the compare_modes sections: what each request asks of the sampler
SAMPLING_PRESETS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0}, "temperature": {"temperature": 0.8},
    "top_p": {"temperature": 0.8, "top_p": 0.95}, "top_k": {"temperature": 0.8, "top_k": 50},
    "min_p": {"temperature": 0.8, "min_p": 0.05},
}


def mix_params(preset: str, max_tokens: int, deterministic: bool, seed: int) -> Any:
    """A mix request's SamplingParams under the --sampling preset."""
    from engine.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, deterministic=deterministic, seed=seed,
                          **SAMPLING_PRESETS[preset])
