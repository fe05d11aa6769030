"""Engine configuration: `EngineConfig` holds what a user sets; `EngineConfig.resolve` decides the rest.

A config is validated when built (a bad value raises ValueError naming the field) and accepts plain strings
for its choices. `resolve(device)` returns a new frozen config for one device type in which no field is None:
the engine (EngineCore, ModelRunner, Scheduler, the tensor-parallel workers) only runs on resolved configs.

KV budget: `num_kv_blocks` blocks of `block_size` token slots, shared by all sequences; the first two blocks are
reserved (block 0 = zero block for block-table padding, block 1 = scratch for dummy tokens of verify passes),
so usable slots = (num_kv_blocks - 2) * block_size.
"""
from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

# the reserved blocks are the block manager's; re-exported for the attention backends and the model runner
from engine.block_manager import RESERVED_BLOCKS as RESERVED_BLOCKS
from engine.block_manager import SCRATCH_BLOCK as SCRATCH_BLOCK
from engine.block_manager import ZERO_BLOCK as ZERO_BLOCK

DEFAULT_MODEL = "default"

# the defaults `resolve` decides per device type
CPU_KV_BLOCKS = 514
CPU_MAX_NUM_SEQS = 32
CPU_MAX_NUM_BATCHED_TOKENS = 4096
DEFAULT_CUDA_MAX_NUM_BATCHED_TOKENS = 8192
# running sequences on CUDA when the KV budget allows it (the decode graphs' largest batch size), and the token
# slots per sequence the budget must hold for that many; a smaller budget gets proportionally fewer sequences
DEFAULT_CUDA_MAX_NUM_SEQS = 256
CUDA_SEQ_SIZING_TOKENS = 1024
# the smallest canonical prefill pass where canonical_prefill_chunk_tokens is 0: short deterministic prompts pack
# into passes of this many tokens. A lone short prompt pays for the whole pass (on the 8B its first token comes
# about 30 ms later than a plain prefill's); 256 removes that, but a burst of deterministic prompts then takes many
# small passes: on the 8B's short mix at dvr 100 % that is 0.72x of non-deterministic against 0.88x with 2048
# (docs/performance.md, H100). Chunked passes (below) remove it without the small passes.
DEFAULT_CUDA_CANONICAL_PREFILL_MIN_TOKENS = 2048
CPU_CANONICAL_PREFILL_MIN_TOKENS = 64
# rows of every GEMM of a chunked canonical prefill pass (DvrTuning.canonical_prefill_chunk_tokens; 0: off). On the
# 8B (H100, bench/results/2026-12-07-h100, `bash bench/h200.sh chunks`) 512 brings a lone deterministic prompt's first
# token from 3.05x to 1.12x of a plain one's and costs the ShareGPT-like mixes under 0.01 at dvr 10 % and 100 %; 256
# costs them 0.01-0.05
DEFAULT_CUDA_CANONICAL_PREFILL_CHUNK_TOKENS = 512
CPU_CANONICAL_PREFILL_CHUNK_TOKENS = 0
# decode graphs of at least this many padded rows capture their GEMMs with cuBLASLt (CUDA graphs on): it is
# faster at batch 64 and slower at batch 1 (bench/step_probe.py measures the cut)
DEFAULT_DECODE_CUBLASLT_MIN_ROWS = 32
# decode rows a dvr verify pass carries on the triton backend: a batch-64 decode step beside the G x W tokens
DEFAULT_VERIFY_DECODE_ROWS = 64
# decode steps a deterministic row waits at most for its verify pass while the running batch is small. CPU: the
# largest k that streams 64 tokens in 4 chunks (bench/results/2026-12-05-cpu); CUDA: of k = 8 / 12 / 16, the
# shortest gaps and the lowest end-to-end time of 8 streams on the 8B (bench/results/2026-12-06-h100)
DEFAULT_CUDA_VERIFY_CADENCE_STEPS = 8
DEFAULT_CPU_VERIFY_CADENCE_STEPS = 20


def default_cache_dir() -> Path:
    """${VERBATIM_CACHE_DIR:-~/.cache/verbatim}, read when called."""
    return Path(os.environ.get("VERBATIM_CACHE_DIR") or Path.home() / ".cache" / "verbatim")


def resolve_decode_cublaslt_min_rows(value: int | None, cuda_graphs_on_cuda: bool) -> int:
    """DvrTuning.decode_cublaslt_min_rows as the engine uses it: None is DEFAULT_DECODE_CUBLASLT_MIN_ROWS
    where CUDA decode graphs are captured and 0 elsewhere; any other value is kept."""
    if value is not None:
        return value
    return DEFAULT_DECODE_CUBLASLT_MIN_ROWS if cuda_graphs_on_cuda else 0


def resolve_max_num_seqs(value: int | None, usable_kv_slots: int) -> int:
    """EngineConfig.max_num_seqs on CUDA: an explicit value is kept; None is DEFAULT_CUDA_MAX_NUM_SEQS, fewer
    when the budget holds less than CUDA_SEQ_SIZING_TOKENS slots per sequence (at least 1)."""
    if value is not None:
        return value
    return max(1, min(DEFAULT_CUDA_MAX_NUM_SEQS, usable_kv_slots // CUDA_SEQ_SIZING_TOKENS))


def _check(ok: bool, field: str, limit: str) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{field}: {limit}")


E = TypeVar("E", bound=enum.Enum)


def _choice(kind: type[E], value: Any, field: str, listing: str | None = None) -> E:
    """`value` (a member or its string) as a member of `kind`; ValueError naming `field` otherwise."""
    try:
        return kind(value)
    except ValueError:
        listing = listing or "/".join(m.value for m in kind)
        raise ValueError(f"EngineConfig.{field}: one of {listing}, got {value!r}") from None


def _option(default: Any, help: str) -> Any:
    """A config field with its help text (docs/engine.md lists them)."""
    return field(default=default, metadata={"help": help})


class Mode(str, enum.Enum):
    """How the engine makes deterministic requests reproducible."""

    DVR = "dvr"                            # decode-verify-rollback for requests that ask for it
    NONDETERMINISTIC = "nondeterministic"  # every request on the fast path, never verified
    BATCH_INVARIANT = "batch_invariant"    # batch-invariant kernels everywhere: every request
    #                                        deterministic without verification (no verify passes)


class Device(enum.StrEnum):
    AUTO = "auto"  # cuda where torch sees a GPU, else cpu
    CPU = "cpu"
    CUDA = "cuda"

    @classmethod
    def of(cls, device: Device | str | torch.device) -> Device:
        """The member for a device name or a torch.device (its type)."""
        return cls(device.type if isinstance(device, torch.device) else device)


class DType(enum.StrEnum):
    AUTO = "auto"  # float32 on the CPU, bfloat16 on CUDA
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class AttentionBackend(enum.StrEnum):
    AUTO = "auto"                        # triton on CUDA, torch on the CPU
    TORCH = "torch"
    TRITON = "triton"                    # CUDA only
    FLASH = "flash"                      # CUDA only
    BATCH_INVARIANT = "batch_invariant"  # mode batch_invariant's own attention (set by the mode)


class DvrDecodeAttention(enum.StrEnum):
    """The attention of DVR rows in a decode step. Never changes committed bits."""

    AUTO = "auto"                                  # canonical_step_short on CUDA, split on the CPU
    CANONICAL = "canonical"                        # the verifier's numerics: fewer rollbacks
    CANONICAL_STEP = "canonical_step"              # canonical; a step holding a DVR row runs every row
    #                                                canonical (one kernel; triton only, else as canonical)
    CANONICAL_STEP_SHORT = "canonical_step_short"  # canonical_step in the decode graphs of rows up to
    #                                                GRAPH_MAX_LEN tokens, canonical past them and in eager steps
    SPLIT = "split"                                # the fast split-KV kernel, like every other row


class VerifyPacking(enum.StrEnum):
    PADDED = "padded"  # every window takes W token slots (dummies after a window that ends early)
    PACKED = "packed"  # windows sit back to back; dummy rows fill the rest of the G*W tokens


class VerifyTrigger(enum.StrEnum):
    TOKENS = "tokens"    # a pass is due at G*W tokens of ready windows or verify_max_windows windows
    WINDOWS = "windows"  # a pass is due at G ready windows


class TpReduction(enum.StrEnum):
    GATHER_SUM = "gather_sum"  # all-gather, then a float32 sum in rank order (batch invariant everywhere)
    NCCL = "nccl"              # NCCL all_reduce, NCCL_ALGO / NCCL_PROTO pinned (CUDA; batch invariant at 2 ranks)


_TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16}


QUERY_TILES = (16, 32, 64)  # the query-tile heights of the canonical kernels (rows of one MMA tile)
# The canonical (no-split) kernels' fixed tile: changing any of these is a new kernel, with a new id.
PAGED_KERNEL_VERSION = "triton-paged-v2"
PREFILL_BLOCK_N = 64
PREFILL_NUM_WARPS = 4
PREFILL_NUM_STAGES = 2


@dataclass(frozen=True)
class KernelSettings:
    """Launch settings of the Triton paged-attention kernels (CUDA), fixed for an engine's lifetime and passed
    to its attention backend. `kernel_id()` names the ones that change committed bits (the runtime
    fingerprint carries it); the others change speed only."""

    query_tile: int = 16
    """Rows of the canonical kernels' query tile (prefill, verify, canonical decode). Changes committed bits.
    16: a canonical decode row packs its GQA group into one tile, so 16 rows leave 12 dead MMA rows where 64
    would leave 60 (Llama-3.1-8B)."""
    chunk: int = 256
    """Keys per absolute chunk of the canonical kernels, each reduced alone then merged in increasing order (a
    multiple of 64). Changes committed bits."""
    prefill_pass_tile: int | None = None
    """Query tile of plain prefill passes of the split-decode backend (modes dvr and nondeterministic); None:
    `query_tile` (set when built). A DVR prompt's first token comes from a prefill pass, so it changes committed
    bits."""
    fuse_rope_canonical: bool = True
    """RoPE and the K/V store inside the canonical decode kernel (decode steps with canonical rows and every
    decode step of mode batch_invariant): one launch fewer, the same bits."""
    concurrent_carried: bool = False
    """A verify pass's carried decode rows on a second stream beside its verify rows: the same bits."""
    decode_num_warps: int = 4
    """Warps of the split-KV decode kernel (fast path only)."""
    decode_num_stages: int = 2
    """Pipeline stages of the split-KV decode kernel (fast path only)."""
    chunk_programs: int = 2048
    """Programs per launch the canonical decode kernel aims at, sharing each row's key chunks (0: one program
    per chunk of the block table). The bits do not depend on it."""

    def __post_init__(self) -> None:
        if self.prefill_pass_tile is None:
            object.__setattr__(self, "prefill_pass_tile", self.query_tile)
        _check(self.query_tile in QUERY_TILES, "kernels.query_tile", f"one of {QUERY_TILES}, got {self.query_tile}")
        _check(self.chunk >= PREFILL_BLOCK_N and self.chunk % PREFILL_BLOCK_N == 0, "kernels.chunk",
               f"a positive multiple of {PREFILL_BLOCK_N}, got {self.chunk}")
        _check(self.prefill_pass_tile is None or self.prefill_pass_tile in QUERY_TILES, "kernels.prefill_pass_tile",
               f"None or one of {QUERY_TILES}, got {self.prefill_pass_tile}")
        _check(self.decode_num_warps in (1, 2, 4, 8, 16), "kernels.decode_num_warps",
               f"a power of two in [1, 16], got {self.decode_num_warps}")
        _check(self.decode_num_stages >= 1, "kernels.decode_num_stages", f"must be >= 1, got {self.decode_num_stages}")
        _check(self.chunk_programs >= 0, "kernels.chunk_programs", f"must be >= 0, got {self.chunk_programs}")

    @property
    def prefill_tile(self) -> int:
        """The query tile of plain prefill passes."""
        return self.prefill_pass_tile

    def canonical_kernel_id(self) -> str:
        """The verifier's kernels (and every kernel of mode batch_invariant): tile shapes and chunk."""
        return (f"{PAGED_KERNEL_VERSION}-m{self.query_tile}n{PREFILL_BLOCK_N}w{PREFILL_NUM_WARPS}"
                f"c{self.chunk}")

    def kernel_id(self) -> str:
        """canonical_kernel_id, and the plain prefill passes' tile where it differs (`-p<rows>`)."""
        p = self.prefill_tile
        return self.canonical_kernel_id() + ("" if p == self.query_tile else f"-p{p}")


DEFAULT_KERNEL_SETTINGS = KernelSettings()


@dataclass(frozen=True)
class DvrTuning:
    """How DVR rows decode and how verify passes are formed and overlapped. None (or auto): the device's
    default, decided by `EngineConfig.resolve`. Only the fields marked so change the runtime fingerprint; none
    changes a committed bit for a given fingerprint."""

    canonical_prefill_min_tokens: int | None = _option(
        None, "DVR and replay prompts are prefilled in passes of exactly max(this, the next power of two >= the "
        "prompt) tokens (packed, dummy-padded), at most max_num_batched_tokens. None: 2048 (at most the budget) "
        "on CUDA, 64 on the CPU. Part of the runtime fingerprint (unless canonical_prefill_chunk_tokens > 0)")
    canonical_prefill_chunk_tokens: int | None = _option(
        None, "C > 0: every GEMM of a canonical prefill pass runs on exactly C rows (the pass split into C-row "
        "slices), so a DVR / replay prompt's bits depend on its tokens and C only; its pass then holds any "
        "deterministic prompts that fit, dummy-padded to the next multiple of C (a lone short prompt: C tokens), "
        "instead of max(canonical_prefill_min_tokens, ...). max_num_batched_tokens must be a multiple of C. "
        "0: off. None: 512 on CUDA (0 where max_num_batched_tokens is not a multiple of 512), 0 on the CPU. Part "
        "of the runtime fingerprint when > 0")
    dvr_decode_attention: DvrDecodeAttention = _option(
        DvrDecodeAttention.AUTO, "attention of DVR rows in a decode step: canonical / canonical_step / "
        "canonical_step_short / split (DvrDecodeAttention); auto: canonical_step_short on CUDA, split on the CPU")
    dvr_lookahead: int | None = _option(
        None, "candidates a DVR row waiting for its verify pass may decode past its window; a pass verifies up "
        "to G windows, several of one row. None: (G-1)*W with canonical DVR decode rows, W-1 with split; "
        "0: wait idle")
    overlap: bool | None = _option(
        None, "decode steps run one step ahead of the host: the next step is planned and launched (its input ids "
        "taken from the device) before this one's tokens are read. None: on for CUDA, off on the CPU")
    verify_early_decode: bool | None = _option(
        None, "with overlap: a verify pass launches its samples and the next decode step before reading them; "
        "its rows with run-ahead candidates past their windows decode on speculatively. None: on for CUDA, off "
        "on the CPU")
    chained_verify: bool | None = _option(
        None, "with overlap: a verify pass due while a decode step is in flight is planned before that step is "
        "read and launched behind it, taking that step's tokens on the device. None: on for CUDA, off on the CPU")
    decode_cublaslt_min_rows: int | None = _option(
        None, "CUDA decode graphs of at least this many padded rows capture their GEMMs with cuBLASLt, not cuBLAS "
        "(0: never; fast path only). None: 32 with CUDA graphs, else 0")
    verify_decode_rows: int | None = _option(
        None, "D: every verify pass also carries one decode step of up to D running rows not in it; the pass is "
        "always G*W + D tokens. None: 64 in mode dvr on the triton backend, else 0; always 0 outside mode dvr. "
        "Part of the runtime fingerprint when > 0")
    verify_packing: VerifyPacking | None = _option(
        None, "padded: every window of a verify pass takes W token slots; packed: windows sit back to back, as "
        "many as fit in G*W tokens (at most verify_max_windows). None: packed on CUDA, padded on the CPU")
    verify_max_windows: int | None = _option(None, "packed: windows per verify pass (None: 2G); padded: always G")
    verify_trigger: VerifyTrigger | None = _option(
        None, "when ready windows make a verify pass due: tokens (G*W tokens of windows, or verify_max_windows "
        "windows) / windows (G windows). None: tokens when packed, windows when padded")
    verify_cadence_steps: int | None = _option(
        None, "k: while at most verify_cadence_max_rows sequences run, a verify pass is also due once a "
        "deterministic row took k candidates since its last commit (or can take no more), and each pass takes "
        "every deterministic row's unfinished window too. 0: off. None: 8 on CUDA, 20 on the CPU")
    verify_cadence_max_rows: int | None = _option(
        None, "the largest running batch (sequences of any kind) at which verify_cadence_steps applies. None: G")

    def __post_init__(self) -> None:
        object.__setattr__(self, "dvr_decode_attention",
                           _choice(DvrDecodeAttention, self.dvr_decode_attention, "tuning.dvr_decode_attention"))
        for name, kind in (("verify_packing", VerifyPacking), ("verify_trigger", VerifyTrigger)):
            value = getattr(self, name)
            object.__setattr__(self, name, None if value is None else _choice(kind, value, f"tuning.{name}"))
        _check(_int_at_least(self.canonical_prefill_min_tokens, 1), "tuning.canonical_prefill_min_tokens",
               f"must be >= 1, got {self.canonical_prefill_min_tokens}")
        _check(_int_at_least(self.canonical_prefill_chunk_tokens, 0), "tuning.canonical_prefill_chunk_tokens",
               f"must be an int >= 0 (0: off) or None, got {self.canonical_prefill_chunk_tokens!r}")
        _check(_int_at_least(self.dvr_lookahead, 0), "tuning.dvr_lookahead", f"must be >= 0, got {self.dvr_lookahead}")
        for name in ("overlap", "verify_early_decode", "chained_verify"):
            _check(getattr(self, name) in (None, True, False), f"tuning.{name}",
                   f"must be a bool or None, got {getattr(self, name)!r}")
        _check(_int_at_least(self.decode_cublaslt_min_rows, 0), "tuning.decode_cublaslt_min_rows",
               f"must be an int >= 0, got {self.decode_cublaslt_min_rows!r}")
        _check(_int_at_least(self.verify_decode_rows, 0), "tuning.verify_decode_rows",
               f"must be an int >= 0 or None, got {self.verify_decode_rows!r}")
        _check(_int_at_least(self.verify_cadence_steps, 0), "tuning.verify_cadence_steps",
               f"must be an int >= 0 (0: off) or None, got {self.verify_cadence_steps!r}")
        _check(_int_at_least(self.verify_cadence_max_rows, 1), "tuning.verify_cadence_max_rows",
               f"must be an int >= 1 or None, got {self.verify_cadence_max_rows!r}")


def _int_at_least(value: Any, low: int) -> bool:
    """None, or an int (not a bool) >= low."""
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= low)


DEFAULT_TUNING = DvrTuning()
_TUNING_FIELDS = frozenset(f.name for f in dataclasses.fields(DvrTuning))


@dataclass(frozen=True)
class EngineConfig:
    """All engine options. Unknown options raise (dataclass), bad values raise ValueError naming the field."""

    model: str = _option(
        DEFAULT_MODEL, "'default' (the SmolLM2 GGUF), a Hugging Face model folder, a .gguf file, a Hugging Face "
        "model id ORG/NAME[@REVISION] (engine/hub.py), or synthetic:<preset>[:peaked] (seeded random weights, "
        "engine/models/synthetic.py)")
    device: Device = _option(Device.AUTO, "auto (cuda where torch sees a GPU) / cpu / cuda")
    dtype: DType = _option(DType.AUTO, "auto (float32 on the CPU, bfloat16 on CUDA) / float32 / bfloat16 / float16")
    mode: Mode = _option(Mode.DVR, "dvr / nondeterministic / batch_invariant (Mode)")
    window: int = _option(32, "W: tokens per verify window")
    group: int = _option(8, "G: windows per verify pass")
    block_size: int = _option(16, "token slots per KV block")
    num_kv_blocks: int | None = _option(
        None, "KV budget in blocks, the 2 reserved ones included. None: 514 on the CPU; on CUDA kv_memory_share "
        "of the memory free after the weights")
    kv_memory_share: float = _option(0.9, "CUDA with num_kv_blocks None: the share of the free memory the KV "
                                          "cache takes")
    max_num_seqs: int | None = _option(
        None, "running sequences at most. None: 32 on the CPU; on CUDA 256, fewer where the KV budget holds less "
        "than 1024 token slots per sequence")
    max_num_batched_tokens: int | None = _option(
        None, "prefill tokens per step, and the longest prompt. None: 8192 on CUDA, 4096 on the CPU")
    max_model_len: int | None = _option(
        None, "the longest sequence served (prompt and output), capped at the model's context length. None: the "
        "model's context length")
    attention_backend: AttentionBackend = _option(
        AttentionBackend.AUTO, "auto (triton on CUDA, torch on the CPU) / torch / triton / flash; mode "
        "batch_invariant runs its own")
    cuda_graphs: bool | None = _option(
        None, "capture decode steps per padded batch size, and the verify pass where its graph is bit-exact with "
        "eager (checked at capture). None: on for CUDA, off on the CPU")
    tensor_parallel_size: int = _option(
        1, "ranks the model is sharded over, one process each (engine.parallel): one GPU per rank over NCCL, or "
        "CPU processes over gloo. Part of the runtime fingerprint when > 1")
    tp_reduction: TpReduction = _option(
        TpReduction.GATHER_SUM, "how row-parallel partial sums are added (tensor_parallel_size > 1): gather_sum / "
        "nccl (TpReduction). Part of the runtime fingerprint")
    kernels: KernelSettings = _option(DEFAULT_KERNEL_SETTINGS, "launch settings of the Triton attention kernels")
    tuning: DvrTuning = _option(DEFAULT_TUNING, "DVR decode, verify-pass and overlap tuning (DvrTuning)")
    fault_rate: float = _option(0.0, "probability a fast-path candidate is replaced by a wrong token")
    fault_seed: int = _option(0, "seed of the fault injection")
    num_threads: int | None = _option(None, "torch intra-op threads. None: torch's default")
    cache_dir: str | None = _option(
        None, "where the loader caches dequantized GGUF weights. None: $VERBATIM_CACHE_DIR, else ~/.cache/verbatim")

    def __post_init__(self) -> None:
        if isinstance(self.tuning, Mapping):  # JSON engine options
            object.__setattr__(self, "tuning", _tuning(self.tuning))
        for name, kind, listing in _CHOICES:
            object.__setattr__(self, name, _choice(kind, getattr(self, name), name, listing))
        _check(self.window >= 2, "window", f"W must be >= 2, got {self.window}")
        _check(self.group >= 1, "group", f"G must be >= 1, got {self.group}")
        _check(self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 3, "num_kv_blocks",
               f"must be >= 3 (2 reserved), got {self.num_kv_blocks}")
        _check(0.0 < self.kv_memory_share <= 1.0, "kv_memory_share", f"must be in (0, 1], got {self.kv_memory_share}")
        _check(self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs",
               f"must be >= 1, got {self.max_num_seqs}")
        _check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
               f"must be >= 1, got {self.max_num_batched_tokens}")
        _check(0.0 <= self.fault_rate <= 1.0, "fault_rate", f"must be in [0, 1], got {self.fault_rate}")
        _check(self.cuda_graphs in (None, True, False), "cuda_graphs",
               f"must be a bool or None, got {self.cuda_graphs!r}")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
               f"must be >= 2, got {self.max_model_len}")
        _check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
               "tensor_parallel_size", f"must be an int >= 1, got {self.tensor_parallel_size!r}")
        _check(isinstance(self.tuning, DvrTuning), "tuning", f"must be a DvrTuning, got {self.tuning!r}")
        self._device_defaults(self.device_type)  # raises where a value cannot run on that device

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> EngineConfig:
        """A config from flat options (CLI flags, the service's engine_options JSON, bench command lines):
        EngineConfig fields and DvrTuning fields by name, or DvrTuning fields under "tuning"."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known - _TUNING_FIELDS)
        if unknown:
            raise ValueError(f"engine options: unknown EngineConfig fields {unknown}; "
                             f"known: {sorted(known | _TUNING_FIELDS)}")
        tuning = {k: v for k, v in options.items() if k in _TUNING_FIELDS}
        nested = options.get("tuning", {})
        if isinstance(nested, DvrTuning):
            nested = {f.name: getattr(nested, f.name) for f in dataclasses.fields(DvrTuning)}
        top = {k: v for k, v in options.items() if k in known and k != "tuning"}
        return cls(**top, tuning=_tuning({**nested, **tuning}))

    @property
    def device_type(self) -> Device:
        """cpu or cuda: `device`, with auto decided by whether torch sees a GPU."""
        if self.device == Device.AUTO:
            return Device.CUDA if torch.cuda.is_available() else Device.CPU
        return self.device

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device_type.value)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == DType.AUTO:
            return torch.float32 if self.device_type == Device.CPU else torch.bfloat16
        return _TORCH_DTYPES[self.dtype]

    def attention_backend_on(self, device: Device | str | torch.device) -> AttentionBackend:
        """The attention backend the engine runs on `device`; ValueError where the chosen one cannot."""
        on_cuda = Device.of(device) == Device.CUDA
        backend = self.attention_backend
        if self.mode == Mode.BATCH_INVARIANT:  # the mode fixes the numerics, attention included
            _check(backend in (AttentionBackend.AUTO, AttentionBackend.TORCH, AttentionBackend.BATCH_INVARIANT),
                   "attention_backend",
                   f"mode batch_invariant runs its own attention; leave it unset, got {backend.value!r}")
            return AttentionBackend.BATCH_INVARIANT
        if backend == AttentionBackend.AUTO:
            return AttentionBackend.TRITON if on_cuda else AttentionBackend.TORCH
        _check(on_cuda or backend not in (AttentionBackend.TRITON, AttentionBackend.FLASH), "attention_backend",
               f"{backend.value!r} runs on CUDA only; this config resolves to the CPU")
        return backend

    def resolve(self, device: Device | str | torch.device | None = None, *, model_max_len: int | None = None,
                free_kv_blocks: int | None = None) -> EngineConfig:
        """This config for `device` (a type: cpu / cuda; None: `device_type`) with every default decided: a new
        frozen config in which no field is None, nested ones included. Resolving a resolved config returns an
        equal one.

        `model_max_len`: the model's context length (the default and the cap of max_model_len), needed unless
        max_model_len is set. `free_kv_blocks`: on CUDA with num_kv_blocks None, the blocks kv_memory_share of
        the free memory holds (the model runner measures it after loading the weights)."""
        kind = self.device_type if device is None else Device.of(device)
        _check(kind != Device.AUTO, "device", "resolve needs a device type, cpu or cuda")
        _check(self.device in (Device.AUTO, kind), "device", f"{self.device.value!r}, resolved for {kind.value}")
        decided = self._device_defaults(kind)
        if self.num_kv_blocks is not None:
            blocks = self.num_kv_blocks
        elif kind == Device.CPU:
            blocks = CPU_KV_BLOCKS
        else:
            _check(free_kv_blocks is not None, "num_kv_blocks",
                   "None on CUDA is sized from the free GPU memory: resolve needs free_kv_blocks")
            blocks = free_kv_blocks
        if kind == Device.CPU:
            seqs = CPU_MAX_NUM_SEQS if self.max_num_seqs is None else self.max_num_seqs
        else:
            seqs = resolve_max_num_seqs(self.max_num_seqs, (blocks - RESERVED_BLOCKS) * self.block_size)
        if model_max_len is None:
            _check(self.max_model_len is not None, "max_model_len",
                   "None is the model's context length: resolve needs model_max_len")
            max_len = self.max_model_len
        else:
            max_len = min(self.max_model_len or model_max_len, model_max_len)
        return dataclasses.replace(
            self, **decided, num_kv_blocks=blocks, max_num_seqs=seqs, max_model_len=max_len,
            num_threads=torch.get_num_threads() if self.num_threads is None else self.num_threads,
            cache_dir=self.cache_dir or str(default_cache_dir()))

    def _device_defaults(self, kind: Device) -> dict[str, Any]:
        """The fields whose defaults the device type decides, resolved for `kind`; ValueError where a value
        cannot run there."""
        on_cuda = kind == Device.CUDA
        g, w, t = self.group, self.window, self.tuning
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_CUDA_MAX_NUM_BATCHED_TOKENS if on_cuda else CPU_MAX_NUM_BATCHED_TOKENS
        backend = self.attention_backend_on(kind)
        graphs = on_cuda if self.cuda_graphs is None else self.cuda_graphs
        if self.dtype != DType.AUTO:
            dtype = self.dtype
        else:
            dtype = DType.BFLOAT16 if on_cuda else DType.FLOAT32
        prefill_min = t.canonical_prefill_min_tokens
        if prefill_min is None:
            # CUDA: the passes a plain prefill of fast prompts would fill under load; a lone prompt pays for one
            prefill_min = min(DEFAULT_CUDA_CANONICAL_PREFILL_MIN_TOKENS, budget) if on_cuda \
                else CPU_CANONICAL_PREFILL_MIN_TOKENS
        chunk = t.canonical_prefill_chunk_tokens
        if chunk is None:
            chunk = DEFAULT_CUDA_CANONICAL_PREFILL_CHUNK_TOKENS if on_cuda else CPU_CANONICAL_PREFILL_CHUNK_TOKENS
            if chunk and budget % chunk:  # a budget set by hand that is no whole number of chunks: unchunked passes
                chunk = 0
        _check(chunk == 0 or budget % chunk == 0, "tuning.canonical_prefill_chunk_tokens",
               f"max_num_batched_tokens = {budget} must be a multiple of it (a canonical pass is a whole number of "
               f"{chunk}-token GEMM chunks and at most the budget), got {chunk}")
        decode_attention = t.dvr_decode_attention
        if decode_attention == DvrDecodeAttention.AUTO:
            decode_attention = DvrDecodeAttention.CANONICAL_STEP_SHORT if on_cuda else DvrDecodeAttention.SPLIT
        lookahead = t.dvr_lookahead
        if lookahead is None:
            # canonical DVR rows decode with the verifier's numerics (rollbacks are rare), so a row may run ahead
            # G-1 more windows and have them verified in one pass; split rows roll back often enough that run-ahead
            # past one window mostly feeds rollbacks
            lookahead = (g - 1) * w if decode_attention != DvrDecodeAttention.SPLIT else w - 1
        cublaslt_rows = resolve_decode_cublaslt_min_rows(t.decode_cublaslt_min_rows, on_cuda and graphs)
        _check(cublaslt_rows == 0 or on_cuda, "tuning.decode_cublaslt_min_rows",
               "CUDA only (it picks the BLAS library of CUDA decode graphs; unused without cuda_graphs)")
        if self.mode != Mode.DVR:  # no verify passes: nothing to carry
            carried = 0
        elif t.verify_decode_rows is None:
            carried = DEFAULT_VERIFY_DECODE_ROWS if backend == AttentionBackend.TRITON else 0
        else:
            carried = t.verify_decode_rows
        _check(carried == 0 or backend in (AttentionBackend.TORCH, AttentionBackend.TRITON),
               "tuning.verify_decode_rows", f"the {backend.value!r} attention backend cannot carry decode rows in "
               "a verify pass; use triton or torch, or set it to 0")
        packing = t.verify_packing or (VerifyPacking.PACKED if on_cuda else VerifyPacking.PADDED)
        packed = packing == VerifyPacking.PACKED
        max_windows = t.verify_max_windows
        if max_windows is None:
            max_windows = 2 * g if packed else g
        _check(_int_at_least(max_windows, g), "tuning.verify_max_windows",
               f"must be an int >= G = {g}, got {max_windows!r}")
        _check(packed or max_windows == g, "tuning.verify_max_windows",
               f"a padded verify pass holds exactly G = {g} windows, got {max_windows}")
        trigger = t.verify_trigger or (VerifyTrigger.TOKENS if packed else VerifyTrigger.WINDOWS)
        cadence = t.verify_cadence_steps
        if cadence is None:
            cadence = DEFAULT_CUDA_VERIFY_CADENCE_STEPS if on_cuda else DEFAULT_CPU_VERIFY_CADENCE_STEPS
        _check(self.tp_reduction != TpReduction.NCCL or on_cuda, "tp_reduction",
               "nccl runs on CUDA only; this config resolves to the CPU (use gather_sum)")
        _check(self.tp_reduction != TpReduction.NCCL or self.mode != Mode.BATCH_INVARIANT
               or self.tensor_parallel_size <= 2, "tp_reduction",
               f"nccl past 2 ranks sums in an order that follows the message size, so mode batch_invariant needs "
               f"gather_sum at tensor_parallel_size {self.tensor_parallel_size}")
        tuning = DvrTuning(
            canonical_prefill_min_tokens=prefill_min, canonical_prefill_chunk_tokens=chunk,
            dvr_decode_attention=decode_attention, dvr_lookahead=lookahead,
            overlap=on_cuda if t.overlap is None else t.overlap,
            verify_early_decode=on_cuda if t.verify_early_decode is None else t.verify_early_decode,
            chained_verify=on_cuda if t.chained_verify is None else t.chained_verify,
            decode_cublaslt_min_rows=cublaslt_rows, verify_decode_rows=carried, verify_packing=packing,
            verify_max_windows=max_windows, verify_trigger=trigger, verify_cadence_steps=cadence,
            verify_cadence_max_rows=g if t.verify_cadence_max_rows is None else t.verify_cadence_max_rows)
        return dict(device=kind, dtype=dtype, attention_backend=backend, max_num_batched_tokens=budget,
                    cuda_graphs=graphs, tuning=tuning)


_CHOICES: tuple[tuple[str, type[enum.Enum], str | None], ...] = (
    ("mode", Mode, str([m.value for m in Mode])),
    ("device", Device, None),
    ("dtype", DType, str(sorted(d.value for d in DType))),
    ("attention_backend", AttentionBackend, str([b.value for b in AttentionBackend])),
    ("tp_reduction", TpReduction, None),
)


def _tuning(options: Mapping[str, Any]) -> DvrTuning:
    unknown = sorted(set(options) - _TUNING_FIELDS)
    _check(not unknown, "tuning", f"unknown DvrTuning fields {unknown}; known: {sorted(_TUNING_FIELDS)}")
    return DvrTuning(**options)
