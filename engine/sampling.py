"""Sampling parameters and the counter-based sampler (DESIGN §2).

Specification (sampler SAMPLER_ID; both implementations, numpy on the host and Triton on CUDA, follow it):

- Logits are float32; x = float64(logit). Temperature 0: the token is argmax x, first id on ties; top-k,
  top-p and min-p do not apply. The logprob of any token is float32(x - lse), lse = log(sum exp(x)) (float64).
- Temperature T > 0: s = x / T (float64). The order of the vocab is s descending, lower id first on ties.
- top-k (k > 0; k >= vocab is off): keep the first k ids of the order.
- top-p (p < 1): over the top-k set (the whole vocab without top-k), w_i = exp(s_i - max s) and
  total = sum of w over that set; keep an id when the mass of the ids strictly before it in the order is
  < p * total. The first id is always kept; every id tied with a kept id and before it is kept too.
- min-p (m > 0): keep an id when s_i - max s >= log(m), log(m) taken once in float64 (math.log), so both
  implementations compare the same numbers; m = 1 keeps the ids tied with the maximum.
- The kept set is the intersection: a prefix of the order, never empty (its first id passes every rule).
- Noise: for (seed, absolute position, vocab id) a splitmix64-style hash gives 64 bits, the top 53 become a
  uniform u in the open interval (0, 1), g = -log(-log(u)) in float64. The token is the argmax of s + g over
  the kept ids, lower id first on ties.
- Top logprobs (n > 0): the first n ids in the order x descending, lower id first on ties, each with its
  logprob as above; ids whose logprob is -inf (masked by a grammar, engine.processors) are left out.
- The logits are those the processors (engine.processors: penalties, logit bias, grammar mask) leave, so
  logprobs are those of the processed distribution.

There is no generator state, so a rollback needs no rewind and the fast path and the verifier draw the same
noise for the same slot. Where the implementations can differ is in the last bits of exp / log (libdevice vs
libm) and the summation order of the log-sum-exp and of the top-p masses; so each engine names its
implementation in the runtime fingerprint (`sampler_impl`), and a token at a top-p boundary within those last
bits may differ between a CPU and a CUDA engine, never between two runs of one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from engine.grammar import GrammarSpec
from engine.kernels.triton_sampler import SAMPLER_IMPL as DEVICE_SAMPLER_IMPL
from engine.kernels.triton_sampler import pack_params, sample_packed
from engine.noise import gumbel, noise_keys

SAMPLER_ID = "verbatim-gumbel-splitmix64-v1"
U64_MAX = (1 << 64) - 1



@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                          # 0 = off
    min_p: float = 0.0                      # 0 = off; keep ids with p >= min_p * max p
    seed: int | None = None                 # unsigned 64-bit; drawn by the engine when None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None             # number of top logprobs per token, when set
    deterministic: bool = False
    # logits processors (engine.processors): functions of the row's prompt and output prefix only
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), sorted by id, ids unique
    presence_penalty: float = 0.0           # [-2, 2], OpenAI: over the generated tokens
    frequency_penalty: float = 0.0          # [-2, 2], OpenAI: over the generated tokens
    repetition_penalty: float = 1.0         # (0, 2], vLLM / HF: over the prompt and the generated tokens; 1 = off
    grammar: GrammarSpec | None = None      # constrained decoding (engine.grammar)
    prompt_logprobs: int | None = None      # logprob of every prompt token after the first, with that many top ones

    def __post_init__(self) -> None:
        # JSON round trips (a signed transcript's params) give lists and dicts: back to the immutable forms
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)))
        if isinstance(self.grammar, dict):
            object.__setattr__(self, "grammar", GrammarSpec(**self.grammar))

    @property
    def processed(self) -> bool:
        """Some logits processor applies (engine.processors): penalties, biases or a grammar."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.grammar is not None)

    def is_stop_token(self, token: int, eos_ids: set[int]) -> bool:
        """The token ends the request: one of stop_token_ids, or an EOS id unless ignore_eos."""
        return token in (self.stop_token_ids or ()) or (not self.ignore_eos and token in eos_ids)

    def validate(self) -> None:
        """Raise ValueError naming the field and its limit (context limits are checked by the engine)."""
        _need(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _need(self.temperature >= 0 and math.isfinite(self.temperature), "temperature",
              f"must be a finite number >= 0, got {self.temperature}")
        _need(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _need(self.top_k >= 0, "top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        _need(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1] (0 = off), got {self.min_p}")
        _need(self.seed is None or 0 <= self.seed <= U64_MAX, "seed",
              f"must be an unsigned 64-bit integer, got {self.seed}")
        _need(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
              f"must be in [0, 20], got {self.logprobs}")
        _need(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
              f"must be in [0, 20], got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _need(math.isfinite(value) and -2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _need(math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
              f"must be in (0, 2] (1 = off), got {self.repetition_penalty}")
        ids = [t for t, _ in self.logit_bias]
        _need(len(ids) == len(set(ids)), "logit_bias", "token ids must be unique")
        _need(all(t >= 0 for t in ids), "logit_bias", f"token ids must be >= 0, got {[t for t in ids if t < 0][:5]}")
        bad = [b for _, b in self.logit_bias if not (math.isfinite(b) and -100.0 <= b <= 100.0)]
        _need(not bad, "logit_bias", f"biases must be in [-100, 100], got {bad[:5]}")
        _need(self.grammar is None or isinstance(self.grammar, GrammarSpec), "grammar",
              f"must be a GrammarSpec, got {type(self.grammar).__name__}")


@dataclass(frozen=True)
class SampleResult:
    token: int
    logprob: float                          # log-softmax of the float32 logits at `token`
    top_logprobs: dict[int, float] | None


def sorted_prefix(scaled: np.ndarray, m: int) -> np.ndarray:
    """At least the first m ids of the stable descending order of `scaled` (ties: lower id first); every id
    tied with the m-th value is included, so the result is exactly a prefix of the full stable sort."""
    v = scaled.shape[0]
    if m >= v:
        return np.argsort(-scaled, kind="stable")
    threshold = np.partition(scaled, v - m)[v - m]
    ids = np.flatnonzero(scaled >= threshold)
    return ids[np.argsort(-scaled[ids], kind="stable")]


def keep_mask(scaled: np.ndarray, top_k: int, top_p: float, min_p: float = 0.0) -> np.ndarray:
    """Boolean mask [vocab] of ids that survive top-k, then top-p over the top-k set, and min-p.

    top-p keeps the shortest prefix of the descending order whose preceding mass is < top_p, with
    p_i = exp(x_i - max) / sum (sum over the top-k set in id order, float64; cumulative sums are
    sequential, so looking at a longer prefix never changes the answer).
    """
    keep = _keep_top_k_p(scaled, top_k, top_p)
    if min_p > 0:
        keep &= scaled - scaled.max() >= math.log(min_p)
    return keep


def _keep_top_k_p(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    v = scaled.shape[0]
    n = v if top_k == 0 else min(top_k, v)
    keep = np.zeros(v, dtype=bool)
    if top_p >= 1.0:
        keep[sorted_prefix(scaled, n)[:n]] = True
        return keep
    weights = np.exp(scaled - scaled.max())
    if top_k:
        in_k = np.zeros(v, dtype=bool)
        in_k[sorted_prefix(scaled, n)[:n]] = True
        total = weights[in_k].sum()
    else:
        total = weights.sum()
    m = min(n, 64)
    while True:
        order = sorted_prefix(scaled, m)[:n]
        probs = weights[order] / total
        count = int(np.count_nonzero(np.cumsum(probs) - probs < top_p))
        if count < len(order) or len(order) == n:
            keep[order[: max(count, 1)]] = True
            return keep
        m = min(n, m * 8)


def log_softmax64(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64, copy=False)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def sample_row(logits: np.ndarray, params: SamplingParams, seed: int, position: int) -> SampleResult:
    """Sample the token at absolute `position` from one float32 logits row [vocab]."""
    assert logits.dtype == np.float32 and logits.ndim == 1, (logits.dtype, logits.shape)
    x64 = logits.astype(np.float64)  # widened once: shared by the Gumbel draw and the log-softmax
    if params.temperature == 0:
        token = int(np.argmax(logits))
    else:
        scaled = x64 / params.temperature
        if _filtered(params):  # the masks sort the vocab: only pay when asked
            scaled = np.where(keep_mask(scaled, params.top_k, params.top_p, params.min_p), scaled, -np.inf)
        token = int(np.argmax(scaled + gumbel(seed, position, logits.shape[0])))
    lp = log_softmax64(x64)
    top = None
    if params.logprobs:
        ids = sorted_prefix(lp, params.logprobs)[: params.logprobs]  # == stable argsort prefix, no full sort
        top = {int(i): float(np.float32(lp[i])) for i in ids if lp[i] != -np.inf}  # masked ids are never listed
    return SampleResult(token, float(np.float32(lp[token])), top)


HOST_SAMPLER_IMPL = "numpy-fp64"


def sampler_impl(device: torch.device) -> str:
    """Which implementation of SAMPLER_ID runs for logits on `device` (named in the runtime fingerprint):
    the same algorithm, but libm vs libdevice and the log-sum-exp order differ in the last bits."""
    return DEVICE_SAMPLER_IMPL if device.type == "cuda" else HOST_SAMPLER_IMPL


def sample_rows(logits: torch.Tensor, specs: list[tuple[SamplingParams, int, int]],
                rows: list[int] | None = None) -> list[SampleResult]:
    """Sample rows `rows` (default: all, in order) of logits [N, vocab]; specs[i] = (params, seed, position).

    CUDA logits are sampled on the device (engine.kernels.triton_sampler), every parameter included; CPU logits
    take the host path (numpy, float64).
    """
    rows = list(range(logits.shape[0])) if rows is None else rows
    assert len(rows) == len(specs), (len(rows), len(specs))
    if logits.is_cuda:
        return _launch_device(logits, specs, rows).results()
    host = logits.float().numpy()
    return [sample_row(host[r], p, s, pos) for r, (p, s, pos) in zip(rows, specs)]


class PendingSamples:
    """Samples of a launched pass whose values have not been read on the host yet (engine overlap).

    `tokens` (Int64[R], on the logits' device; None when already read) can feed the next pass's input ids at
    once, device to device; `results()` waits for the copies to the host and gives the same SampleResults
    `sample_rows` would. On the CPU everything is computed at construction and `results()` returns it."""

    def __init__(self, tokens: torch.Tensor | None, logprobs: torch.Tensor | None = None,
                 ready: list[SampleResult] | None = None, top: tuple[torch.Tensor, torch.Tensor] | None = None,
                 top_n: list[int] | None = None) -> None:
        self.tokens = tokens
        self._ready = ready
        self._host: list[torch.Tensor] = []
        self._event: torch.cuda.Event | None = None
        self._top_n = top_n
        if ready is None:
            assert tokens is not None and logprobs is not None
            if not tokens.is_cuda:  # the kernels under the Triton interpreter (tests)
                self._host = [t.clone() for t in (tokens, logprobs, *(top or ()))]
                return
            for t in (tokens, logprobs, *(top or ())):
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                self._host.append(h)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tokens.device))

    def results(self) -> list[SampleResult]:
        if self._ready is None:
            if self._event is not None:
                self._event.synchronize()
            tok, lp = self._host[0].tolist(), self._host[1].tolist()
            tops: list[dict[int, float] | None] = [None] * len(tok)
            if len(self._host) == 4 and self._top_n is not None:
                ids, lps = self._host[2].tolist(), self._host[3].tolist()
                tops = [{i: v for i, v in zip(ids[j][:n], lps[j][:n]) if v != -math.inf} if n else None
                        for j, n in enumerate(self._top_n)]
            self._ready = [SampleResult(t, p, top) for t, p, top in zip(tok, lp, tops)]
        return self._ready


def sample_rows_deferred(logits: torch.Tensor, specs: list[tuple[SamplingParams, int, int]],
                         rows: list[int] | None = None) -> PendingSamples:
    """`sample_rows(logits, specs, rows)` without waiting for the values on the host: on CUDA the tokens stay
    on the device until `results()`; on the CPU they are computed now. Same algorithm and implementation as
    `sample_rows`, so the same tokens and logprobs."""
    rows = list(range(logits.shape[0])) if rows is None else rows
    if not logits.is_cuda:
        ready = sample_rows(logits, specs, rows)
        return PendingSamples(torch.tensor([r.token for r in ready], dtype=torch.int64), ready=ready)
    return _launch_device(logits, specs, rows)


def pack_specs(specs: list[tuple[SamplingParams, int, int]], rows: list[int]
               ) -> tuple[np.ndarray, list[int], bool]:
    """The device sampler's inputs for `rows`: every parameter of every row in one int64 array
    (`pack_params`), each row's number of top logprobs, and whether any row asks for top-k / top-p / min-p."""
    top_n = [p.logprobs or 0 for p, _, _ in specs]
    params = pack_params(rows, noise_keys([s for _, s, _ in specs], [pos for _, _, pos in specs]),
                         [float(p.temperature) for p, _, _ in specs], [p.top_k for p, _, _ in specs],
                         [float(p.top_p) for p, _, _ in specs], [float(p.min_p) for p, _, _ in specs], top_n)
    return params, top_n, any(_filtered(p) for p, _, _ in specs)


def _launch_device(logits: torch.Tensor, specs: list[tuple[SamplingParams, int, int]], rows: list[int]
                   ) -> PendingSamples:
    """Launch the device sampler on `rows` (no host sync): every parameter of every row in one int64 tensor."""
    params, top_n, filtered = pack_specs(specs, rows)
    staged = torch.from_numpy(params)
    if logits.is_cuda:
        staged = staged.pin_memory().to(logits.device, non_blocking=True)
    nmax = max(top_n, default=0)
    token, logprob, _, top_ids, top_lps = sample_packed(logits, staged, nmax, filtered)
    top = (top_ids, top_lps) if nmax else None
    return PendingSamples(token, logprob, top=top, top_n=top_n if nmax else None)


def _filtered(params: SamplingParams) -> bool:
    return params.temperature != 0 and (params.top_k != 0 or params.top_p < 1.0 or params.min_p > 0)


def _need(ok: bool, field: str, limit: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field}: {limit}")
