"""The completion service: prepare (tokenize, validate) → generate on the engine → record the signed
transcript in the ledger. HTTP-free: the routes turn its results into OpenAI responses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import logging
import re
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.sampling import SamplingParams

from auditor.canonical import timestamp
from auditor.engine_seam import ServingEngine
from auditor.errors import ApiError, bad_request
from auditor.ledger import Appended, Ledger, TranscriptDraft
from auditor.logs import log_failure
from auditor.logcheck import LogFault, LogIntegrityError
from auditor.metrics import Metrics
from auditor.structured import Structured, parameters_grammar
from auditor.transcript import Api, Choice, DvrStats, ModelInfo, Status, new_salt, uuid7

log = logging.getLogger("auditor.service")

_FIELD = re.compile(r"^(?:SamplingParams\.)?([A-Za-z_][A-Za-z0-9_]*)\s*:")
_PARAM_NAMES = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "logprobs", "prompt",
                "messages", "stop_token_ids", "logit_bias", "presence_penalty", "frequency_penalty",
                "repetition_penalty")


_ENGINE_TO_API = {"prompt_token_ids": "prompt", "request_id": None, "prompt_logprobs": "logprobs"}
CHOICE_SEED_DOMAIN = b"verbatim-choice-seed-v1"


@dataclass(frozen=True)
class GenerationRequest:
    """A validated OpenAI request, API-independent."""

    api: Api
    model: str
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: list[str] | None
    ignore_eos: bool
    logprobs: int | None
    deterministic: bool
    stream: bool
    include_usage: bool
    request_json: dict[str, Any]
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None
    echo: bool = False
    structured: Structured | None = None
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Accepted request fields without effect on generation, signed as ``request.extras``."""


INLINE_TOKENIZE_CHARS = 4096
"""Prompts up to this many characters (or token ids) are tokenized in the event loop: the tokenizer takes well
under a millisecond for them, less than a thread's hand-off, and a burst of requests then reaches the engine one
by one as each is parsed, not after the whole burst has been. Longer ones are tokenized in a thread."""


def _short(request: GenerationRequest) -> bool:
    if request.messages is not None:
        return sum(len(str(v)) for m in request.messages for v in m.values()) <= INLINE_TOKENIZE_CHARS
    return request.prompt is not None and len(request.prompt) <= INLINE_TOKENIZE_CHARS


def choice_seed(request_seed: int, index: int) -> int:
    """The seed of choice ``index``: the request seed for choice 0, else the first 8 bytes (little-endian)
    of ``SHA-256("verbatim-choice-seed-v1" || u64le(request_seed) || u32le(index))``."""
    if index == 0:
        return request_seed
    material = CHOICE_SEED_DOMAIN + request_seed.to_bytes(8, "little") + index.to_bytes(4, "little")
    return int.from_bytes(hashlib.sha256(material).digest()[:8], "little")


@dataclass(frozen=True)
class Prepared:
    """A request ready for the engine; ``transcript_id`` is fixed before generation starts."""

    request: GenerationRequest
    transcript_id: str
    received_at: dt.datetime
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams
    tenant: str
    api_key_id: str
    choice: Choice = Choice(0, 1, None)

    @property
    def seed(self) -> int | None:
        return self.params.seed


@dataclass(frozen=True)
class Recorded:
    transcript_id: str
    log_index: int
    tree_size: int
    """Size of the signed checkpoint committed with the transcript: it covers ``log_index`` and is
    served (``GET /v1/log/checkpoint``) before the response leaves."""
    replayable: bool
    status: Status

    def to_json(self) -> dict[str, Any]:
        return {"id": self.transcript_id, "log_index": self.log_index, "tree_size": self.tree_size,
                "replayable": self.replayable}


def log_refused(fault: LogFault) -> ApiError:
    """The 503 every append gets after the log failed its self-check (``auditor.logcheck``)."""
    return ApiError(503, f"the transparency log failed its integrity check ({fault.check} at log index "
                    f"{fault.first_bad_index}); no transcript is recorded and no checkpoint signed until an operator "
                    "repairs it (GET /readyz says why)", code="log_integrity_failure")


def engine_error(exc: ValueError) -> ApiError:
    """Map an engine ``ValueError`` (which names the field) to a 400 with ``param`` set."""
    message = str(exc)
    match = _FIELD.match(message)
    param = match.group(1) if match else next((p for p in _PARAM_NAMES if p in message), None)
    return bad_request(message, param=_ENGINE_TO_API.get(param or "", param))


class CompletionService:
    def __init__(self, engine: ServingEngine, ledger: Ledger, metrics: Metrics, *, model_name: str,
                 max_prompt_tokens: int, max_tokens_limit: int, max_n: int = 1) -> None:
        self.engine = engine
        self.model_name = model_name
        """The served model id: what clients send as ``model`` and what transcripts record as its name."""
        self.ledger = ledger
        self.metrics = metrics
        self.max_prompt_tokens = max_prompt_tokens
        self.max_tokens_limit = max_tokens_limit
        self.max_n = max_n
        self._background: set[asyncio.Task[Any]] = set()

    # --- prepare ---------------------------------------------------------------------------------

    async def prepare(self, request: GenerationRequest, tenant: str, api_key_id: str) -> list[Prepared]:
        """Validate and tokenize; one ``Prepared`` per choice (``n``), each with its own transcript id and
        seed (``choice_seed``). Refused (503) before any generation when the log cannot take it."""
        if self.ledger.fault is not None:
            raise log_refused(self.ledger.fault)
        if request.n > self.max_n:
            raise bad_request(f"n must be <= {self.max_n} (the server's max_n), got {request.n}", param="n")
        received_at = dt.datetime.now(dt.UTC)
        if _short(request):  # the request goes on to the engine without yielding to the requests behind it
            prompt_text, prompt_ids = self._tokenize(request)
        else:
            prompt_text, prompt_ids = await asyncio.to_thread(self._tokenize, request)
        if len(prompt_ids) > self.max_prompt_tokens:
            raise ApiError(413, f"prompt has {len(prompt_ids)} tokens; the limit is {self.max_prompt_tokens}",
                           param="messages" if request.messages is not None else "prompt",
                           code="prompt_too_long")
        if request.max_tokens > self.max_tokens_limit:
            raise bad_request(f"max_tokens must be <= {self.max_tokens_limit}, got {request.max_tokens}",
                              param="max_tokens")
        self._check_logit_bias(request.logit_bias)
        seed = request.seed
        if seed is None and (request.deterministic or request.n > 1):
            seed = secrets.randbits(64)
        try:
            params = SamplingParams(
                max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
                top_k=request.top_k, min_p=request.min_p, seed=seed, stop=request.stop, ignore_eos=request.ignore_eos,
                logprobs=request.logprobs, deterministic=request.deterministic, logit_bias=request.logit_bias,
                presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
                repetition_penalty=request.repetition_penalty, prompt_logprobs=request.prompt_logprobs)
            self.engine.validate(prompt_ids, params)
        except ValueError as exc:
            raise self._request_error(request, exc) from None
        if request.structured is not None:
            params = dataclasses.replace(params, grammar=request.structured.grammar)
            await asyncio.to_thread(self._check_grammar, prompt_ids, params, request.structured)
        choices = []
        for index in range(request.n):
            choice_params = params if index == 0 else dataclasses.replace(params, seed=choice_seed(seed, index))
            choices.append(Prepared(request, str(uuid7()), received_at, prompt_ids, prompt_text, choice_params,
                                    tenant, api_key_id, Choice(index, request.n, seed if request.n > 1 else None)))
        return choices

    @staticmethod
    def _request_error(request: GenerationRequest, exc: ValueError) -> ApiError:
        """The engine's refusal as a 400 naming the request field."""
        error = engine_error(exc)
        if request.messages is not None and error.param == "prompt":
            error.param = "messages"
        return error

    def _check_logit_bias(self, bias: tuple[tuple[int, float], ...]) -> None:
        tokenizer = self.engine.tokenizer
        vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else None
        outside = [t for t, _ in bias if vocab is not None and t >= vocab]
        if outside:
            raise bad_request(f"logit_bias key {outside[0]} is outside the vocabulary (token ids 0..{vocab - 1})",
                              param="logit_bias")

    def _check_grammar(self, prompt_ids: list[int], params: SamplingParams, spec: Structured) -> None:
        """The engine compiles each tool's parameters schema alone (to name the tool), then the whole grammar:
        what the grammar library cannot compile is a 400 naming the request field. Compiled grammars are
        cached by the engine, so generation does not compile them again."""
        for tool in spec.tools:
            try:
                self.engine.validate(prompt_ids, dataclasses.replace(params, grammar=parameters_grammar(tool)))
            except ValueError as exc:
                param = f"tools[{tool.index}].function.parameters"
                raise bad_request(f"{param} is not a usable JSON schema: {exc}", param=param) from None
        try:
            self.engine.validate(prompt_ids, params)
        except ValueError as exc:
            raise bad_request(f"{spec.param} cannot be compiled into a grammar: {exc}", param=spec.param) from None

    def _tokenize(self, request: GenerationRequest) -> tuple[str, list[int]]:
        tokenizer = self.engine.tokenizer
        if request.messages is not None:
            text = tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
            return text, list(tokenizer.encode(text, add_special_tokens=False))
        if isinstance(request.prompt, list):
            vocab = len(tokenizer)
            bad = [t for t in request.prompt if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary (size {vocab})", param="prompt")
            return tokenizer.decode(request.prompt), list(request.prompt)
        assert request.prompt is not None
        return request.prompt, list(tokenizer.encode(request.prompt, add_special_tokens=False))

    # --- generate --------------------------------------------------------------------------------

    async def outputs(self, prepared: Prepared) -> AsyncIterator[Any]:
        """Cumulative committed outputs; raises ``ApiError`` 400 for a late engine ``ValueError``."""
        try:
            async for output in self.engine.generate(prepared.prompt_ids, prepared.params, prepared.transcript_id):
                yield output
        except ValueError as exc:
            raise engine_error(exc) from None

    async def complete(self, prepared: Prepared) -> tuple[Any, Recorded]:
        """Run to the end and record. If the caller is cancelled, the partial output is recorded."""
        last = None
        try:
            async for output in self.outputs(prepared):
                last = output
        except asyncio.CancelledError:
            self.record_disconnect(prepared, last)
            raise
        except Exception:
            if last is not None:  # the engine failed mid-way: keep what was committed, status error
                await self.record_shielded(prepared, last, Status.ERROR)
            raise
        if last is None:
            raise RuntimeError(f"engine produced no output for request {prepared.transcript_id}")
        return last, await self.record_shielded(prepared, last, Status.COMPLETED)

    # --- record ---------------------------------------------------------------------------------

    async def record(self, prepared: Prepared, output: Any, status: Status) -> Recorded:
        try:
            appended: Appended = await self.ledger.append(self._draft(prepared, output, status))
        except LogIntegrityError as exc:
            raise log_refused(exc.fault) from None
        self.metrics.completion(prepared.request.api.value, prepared.params.deterministic, status.value,
                                len(prepared.prompt_ids), len(output.token_ids))
        log.info("transcript recorded", extra={"event": "transcript", "transcript_id": appended.transcript_id,
                                               "tenant": prepared.tenant, "log_index": appended.log_index,
                                               "status": status.value, "completion_tokens": len(output.token_ids)})
        return Recorded(appended.transcript_id, appended.log_index, appended.tree_size, prepared.params.deterministic,
                        status)

    async def record_shielded(self, prepared: Prepared, output: Any, status: Status) -> Recorded:
        """``record`` in its own task: a client leaving while the transaction runs must not cancel
        (and so roll back) the recording of a finished generation."""
        task = self._spawn(self.record(prepared, output, status))
        return await asyncio.shield(task)

    def _spawn(self, coroutine: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def record_finished(self, prepared: Prepared, output: Any) -> None:
        """Record a finished generation in a task of its own (a caller being cancelled cannot await)."""
        self._spawn(self._record_logged(prepared, output, Status.COMPLETED))

    async def _record_logged(self, prepared: Prepared, output: Any, status: Status) -> None:
        try:
            await self.record(prepared, output, status)
        except Exception as exc:  # noqa: BLE001 - a background task: log it, the client is gone
            log_failure(log, "recording a finished choice failed", exc, transcript_id=prepared.transcript_id)

    def record_disconnect(self, prepared: Prepared, last_seen: Any | None) -> None:
        """Client gone: abort the request and record what was committed, in a task of its own
        (the caller is being cancelled or closed and cannot await)."""
        self._spawn(self._record_disconnect(prepared, last_seen))

    async def _record_disconnect(self, prepared: Prepared, last_seen: Any | None) -> None:
        try:
            output = await self.engine.abort(prepared.transcript_id)
            if output is None:
                output = self.engine.last_output(prepared.transcript_id)
            output = output or last_seen
            if output is None:
                log.warning("client disconnected before any output", extra={"transcript_id": prepared.transcript_id})
                return
            await self.record(prepared, output, Status.CLIENT_DISCONNECTED)
        except Exception as exc:  # noqa: BLE001 - a background task: log it, the client is gone
            log_failure(log, "recording a disconnected request failed", exc, transcript_id=prepared.transcript_id)

    async def drain(self) -> None:
        """Wait for background recordings (on shutdown)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def _draft(self, prepared: Prepared, output: Any, status: Status) -> TranscriptDraft:
        info = self.engine.model_info
        params = {k: v for k, v in dataclasses.asdict(prepared.params).items() if k != "seed"}
        choice = prepared.choice
        completed_at = dt.datetime.now(dt.UTC)
        inputs = {
            "transcript_id": prepared.transcript_id, "tenant": prepared.tenant, "api": prepared.request.api,
            "received_at": timestamp(prepared.received_at), "completed_at": timestamp(completed_at),
            "status": status,
            "model": ModelInfo(self.model_name, info.weights_digest, info.tokenizer_digest,
                               info.chat_template_digest, str(info.dtype)),
            "runtime": self.engine.runtime_fingerprint(), "sampling_params": params,
            "seed": int(output.seed), "deterministic": bool(output.deterministic),
            "prompt_ids": list(prepared.prompt_ids), "output_ids": list(output.token_ids), "salt": new_salt(),
            "finish_reason": output.finish_reason, "windows": [tuple(w) for w in output.windows],
            "window_shape": tuple(output.window_shape), "logprobs": list(output.token_logprobs),
            "dvr": DvrStats(output.verify_passes, output.rollbacks, output.recomputed_tokens),
            "choice": choice if choice.count > 1 else None,
            "request_extras": dict(prepared.request.extras) or None,
        }
        return TranscriptDraft(inputs, prepared.api_key_id, self.engine.system_fingerprint(),
                               prepared.request.request_json, prepared.prompt_text, output.text)
