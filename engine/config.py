"""Engine configuration: one frozen dataclass, validated once when built."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

DEFAULT_MODEL = "default"
# decode graphs of at least this many padded rows use cuBLASLt by default (CUDA graphs on): on the H200 the 8B
# step at batch 64 replays faster with it and batch 1 slower; batch 16 is not measured apart, so the cut sits
# between 16 and 64
DEFAULT_DECODE_CUBLASLT_MIN_ROWS = 32


def resolve_decode_cublaslt_min_rows(value: int | None, cuda_graphs_on_cuda: bool) -> int:
    """EngineConfig.decode_cublaslt_min_rows as the engine uses it: None is DEFAULT_DECODE_CUBLASLT_MIN_ROWS
    where CUDA decode graphs are captured and 0 elsewhere; any other value is kept (and checked by the config)."""
    if value is not None:
        return value
    return DEFAULT_DECODE_CUBLASLT_MIN_ROWS if cuda_graphs_on_cuda else 0


# decode rows a dvr verify pass carries by default on the triton backend (CUDA): a batch-64 decode step beside
# the G x W verify tokens
DEFAULT_VERIFY_DECODE_ROWS = 64
# the smallest canonical prefill pass on CUDA (at most max_num_batched_tokens): short deterministic prompts pack
# into 2048-token passes instead of padding the last pass of a budget-sized pair
DEFAULT_CUDA_CANONICAL_PREFILL_MIN_TOKENS = 2048


# verify cadence (EngineConfig.verify_cadence_steps): decode steps a deterministic row waits at most for its
# verify pass while the running batch is small. CPU: the largest k that streams 64 tokens in 4 chunks (a pass
# there costs some 35 decode steps: bench/results/2026-12-05-cpu). CUDA: of k = 8 / 12 / 16, the shortest gaps and
# the lowest end-to-end time of 8 streams on the 8B (bench/results/2026-12-06-h100/stream-bench-*.json)
DEFAULT_CUDA_VERIFY_CADENCE_STEPS = 8
DEFAULT_CPU_VERIFY_CADENCE_STEPS = 20


# running sequences on CUDA when the KV budget allows it (the decode graphs' largest batch size), and the token
# slots per sequence the budget must hold for that many; a smaller budget gets proportionally fewer sequences
DEFAULT_CUDA_MAX_NUM_SEQS = 256
CUDA_SEQ_SIZING_TOKENS = 1024
CPU_MAX_NUM_SEQS = 32
DEFAULT_CUDA_MAX_NUM_BATCHED_TOKENS = 8192


def resolve_max_num_seqs(value: int | None, usable_kv_slots: int) -> int:
    """EngineConfig.max_num_seqs as the engine uses it: an explicit value is kept; None (CUDA, sized once the
    KV budget is known) is DEFAULT_CUDA_MAX_NUM_SEQS, fewer when the budget holds less than
    CUDA_SEQ_SIZING_TOKENS slots per sequence (at least 1)."""
    if value is not None:
        return value
    return max(1, min(DEFAULT_CUDA_MAX_NUM_SEQS, usable_kv_slots // CUDA_SEQ_SIZING_TOKENS))


def _check(ok: bool, field: str, limit: str) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{field}: {limit}")


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
    `query_tile`. A DVR prompt's first token comes from a prefill pass, so it changes committed bits."""
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
        return self.query_tile if self.prefill_pass_tile is None else self.prefill_pass_tile

    def canonical_kernel_id(self) -> str:
        """The verifier's kernels (and every kernel of mode batch_invariant): tile shapes and chunk."""
        return (f"{PAGED_KERNEL_VERSION}-m{self.query_tile}n{PREFILL_BLOCK_N}w{PREFILL_NUM_WARPS}"
                f"c{self.chunk}")

    def kernel_id(self) -> str:
        """canonical_kernel_id, and the plain prefill passes' tile where it differs (`-p<rows>`)."""
        p = self.prefill_tile
        return self.canonical_kernel_id() + ("" if p == self.query_tile else f"-p{p}")


DEFAULT_KERNEL_SETTINGS = KernelSettings()


class Mode(str, enum.Enum):
    """How the engine makes deterministic requests reproducible."""

    DVR = "dvr"                            # decode-verify-rollback for requests that ask for it
    NONDETERMINISTIC = "nondeterministic"  # every request on the fast path, never verified
    BATCH_INVARIANT = "batch_invariant"    # batch-invariant kernels everywhere: every request
    #                                        deterministic without verification (no verify passes)


@dataclass(frozen=True)
class EngineConfig:
    """All engine options. Unknown options raise (dataclass), bad values raise ValueError.

    KV budget: `num_kv_blocks` blocks of `block_size` token slots, shared by all sequences; the first
    two blocks are reserved (block 0 = zero block for block-table padding, block 1 = scratch for dummy
    tokens of verify passes), so usable slots = (num_kv_blocks - 2) * block_size.
    """

    model: str = DEFAULT_MODEL          # "default" (SmolLM2 GGUF), a HF model folder, a .gguf file, a Hugging Face
                                        # model id ORG/NAME[@REVISION] (engine/hub.py), or
                                        # "synthetic:<preset>[:peaked]" (engine/models/synthetic.py: seeded
                                        # random weights, e.g. synthetic:llama-3.1-8b:peaked for GPU benches)
    device: str = "auto"                # auto / cpu / cuda
    dtype: str = "auto"                 # auto (float32 on CPU, bfloat16 on CUDA) / float32 / bfloat16 / float16
    mode: Mode = Mode.DVR
    window: int = 32                    # W: tokens per verify row
    group: int = 8                      # G: rows per verify pass
    block_size: int = 16
    num_kv_blocks: int | None = None    # KV budget (incl. the 2 reserved blocks); None: 514 on the CPU,
                                        # on CUDA `kv_memory_share` of the memory free after the weights
    kv_memory_share: float = 0.9        # CUDA only, when num_kv_blocks is None
    max_num_seqs: int | None = None     # max running sequences. None: 32 on the CPU; on CUDA sized by the model
                                        # runner from the KV budget (resolve_max_num_seqs): up to
                                        # DEFAULT_CUDA_MAX_NUM_SEQS while the budget holds CUDA_SEQ_SIZING_TOKENS
                                        # token slots per sequence
    max_num_batched_tokens: int | None = None  # prefill token budget per step (and max prompt length). None:
                                        # 8192 on CUDA, 4096 on the CPU
    canonical_prefill_min_tokens: int | None = None  # DVR / replay prompts are prefilled in passes of exactly
                                        # max(this, next pow2 >= prompt) tokens (packed, dummy-padded), at most
                                        # max_num_batched_tokens; None: DEFAULT_CUDA_CANONICAL_PREFILL_MIN_TOKENS
                                        # (2048, at most the budget) on CUDA, 64 on the CPU. Part of the runtime
                                        # identity. On the H200, 2048 against the 8192 budget raises dvr 100 %
                                        # on the short / matched mix and costs dvr 50 % and the 1k set about
                                        # one point.
    max_model_len: int | None = None    # defaults to the model's context length
    attention_backend: str = "auto"     # auto (triton on CUDA, torch on the CPU) / torch / triton / flash
    cuda_graphs: bool | None = None     # CUDA only: decode steps per padded batch size, and the verify pass
                                        # when its graph is bit-exact with eager (checked at capture).
                                        # None: on for CUDA (off on the CPU, where there is nothing to capture)
    dvr_decode_attention: str = "auto"  # DVR rows of a decode step: "canonical" = the verifier's attention
                                        # numerics (fewer rollbacks), "split" = the fast kernel like every other
                                        # row; "canonical_step" = as canonical, and a step holding a DVR row runs
                                        # every row canonical (one kernel; Triton only, else as canonical);
                                        # "canonical_step_short" = canonical_step in the decode graphs of rows
                                        # up to GRAPH_MAX_LEN (4096) tokens, canonical past them and in eager
                                        # steps (the canonical kernel on every long row costs more than the
                                        # second stream saves on the H200); auto: canonical_step_short on
                                        # CUDA, split on the CPU (whose fp32 fast path already agrees with the
                                        # verifier). Never changes committed bits.
    dvr_lookahead: int | None = None    # DVR rows waiting for their verify pass keep decoding up to this many
                                        # candidates past the window, and a pass verifies up to G windows,
                                        # several of one row if it ran ahead (None: (G-1)*W with canonical DVR
                                        # decode rows, so one row can fill a pass; W-1 with split; 0: wait
                                        # idle). Never changes committed bits: it trades commit latency (tokens
                                        # stream once verified) and the work a rollback discards for fewer,
                                        # fuller verify passes.
    overlap: bool | None = None         # decode steps run one step ahead of the host: the next step is planned
                                        # and launched (its input ids taken from the device) before this one's
                                        # tokens are read. None: on for CUDA, off on the CPU. Never changes a
                                        # committed token of a deterministic request.
    decode_cublaslt_min_rows: int | None = None  # CUDA only, used with cuda_graphs: decode graphs of at least
                                        # this many padded rows capture their GEMMs with cuBLASLt, not cuBLAS
                                        # (0: never). None: DEFAULT_DECODE_CUBLASLT_MIN_ROWS with CUDA graphs,
                                        # else 0. On the H200 it replayed the 8B step at batch 64 2.8-5 %
                                        # faster and batch 1 slower. Fast path only: prefill and verify keep
                                        # cuBLAS, so committed bits never change (rollbacks may).
    verify_decode_rows: int | None = None  # D: every verify pass also carries one decode step of up to D running
                                        # rows that are not in it (the rows a decode step would take now), so the
                                        # verify tokens and that step share one read of the weights. The pass is
                                        # always G*W + D tokens (dummy rows where fewer are carried): the verify
                                        # bits depend on D (part of the runtime identity), never on what is
                                        # carried. None: DEFAULT_VERIFY_DECODE_ROWS in mode dvr on the triton
                                        # backend, else 0 (off); always 0 outside mode dvr. Never changes a
                                        # committed bit for a given D.
    verify_early_decode: bool | None = None  # None: on for CUDA, off on the CPU. With overlap: a verify pass
                                        # launches its samples and the next decode step before reading them, so the
                                        # GPU does not idle while the host applies them. The pass's rows with
                                        # run-ahead candidates past their windows decode on speculatively (a rollback
                                        # voids that token); the others sit the step out. On the H200 it raises
                                        # dvr 100 % on the short and matched mixes. Never changes a committed bit.
    chained_verify: bool | None = None  # None: on for CUDA, off on the CPU. With overlap: a verify pass that is due
                                        # while a decode step is in flight is planned before that step is read and
                                        # launched behind it: the rows it carries, and windows that end at a token in
                                        # flight, take their input ids from that step's tokens on the device (a full
                                        # window's end does not depend on that token's value), so the GPU does not
                                        # idle while the host reads the step and plans the pass. With fault injection
                                        # its windows hold known candidates only. Where KV is short the pass is
                                        # planned after the read. On the H200 it raises dvr 50 % and 100 % on the
                                        # short and matched mixes by about 1 point. Never changes a committed bit.
    verify_packing: str | None = None   # None: "packed" on CUDA, "padded" on the CPU. "padded": every window of a
                                        # verify pass takes W token slots (a window that ends at a stop or max_tokens is
                                        # padded with dummies); "packed": windows sit back to back, so a pass takes as
                                        # many as fit in its G*W tokens (at most verify_max_windows) and dummy rows fill
                                        # the rest. The pass keeps its token count (every GEMM its shape) and each query
                                        # its absolutely aligned attention tiles, so a window's bits do not depend on
                                        # where it sits: never changes a committed bit (tests compare the two bit for
                                        # bit, on the H200 too; not part of the runtime identity). On the H200 it
                                        # takes fewer passes on the short mix and raises dvr 100 % on both mixes.
    verify_max_windows: int | None = None  # packed: windows per verify pass (None: 2G); padded: always G
    verify_trigger: str | None = None   # when a verify pass is due because enough windows are ready: "tokens" = G*W
                                        # tokens of windows or verify_max_windows windows (a full packed pass);
                                        # "windows" = G windows (the padded rule; a packed pass then still takes every
                                        # ready window that fits). None: "tokens" when packed, "windows" when padded
                                        # (where the two are the same rule). The H200 figures of packed passes are at
                                        # "tokens", which takes more decode steps on the short mix than padded passes;
                                        # "windows" is not measured on a GPU. Never changes a committed bit.
    tensor_parallel_size: int = 1       # ranks the model is sharded over, one process each (engine.parallel): one
                                        # CUDA device per rank (NCCL), or CPU processes (gloo). Part of the runtime
                                        # identity when > 1: the all-reduce is part of the numerics
    tp_reduction: str = "gather_sum"    # how row-parallel partial sums are added (tensor_parallel_size > 1):
                                        # "gather_sum" = all-gather, then a float32 sum in rank order on the device
                                        # (batch invariant on every backend); "nccl" = NCCL's all_reduce with
                                        # NCCL_ALGO / NCCL_PROTO pinned (Ring / Simple unless set; CUDA only;
                                        # batch invariant at 2 ranks). Part of the runtime identity
    # verify cadence (docs/engine.md, "Verify cadence"): while the running batch is small, verify sooner
    verify_cadence_steps: int | None = None  # k: while at most verify_cadence_max_rows sequences run, a verify
                                        # pass is also due once a deterministic row took k candidates (decode
                                        # steps) since its last commit, or holds candidates and can take no
                                        # more, and every pass then takes each deterministic row's unfinished
                                        # window too: its tokens stream after about k steps, not W-1 and more.
                                        # Under load (more rows) passes wait for full windows (throughput).
                                        # 0: off. None: DEFAULT_CUDA_VERIFY_CADENCE_STEPS on CUDA,
                                        # DEFAULT_CPU_VERIFY_CADENCE_STEPS on the CPU. Never changes a committed
                                        # bit (window-boundary invariance; not part of the runtime identity).
    verify_cadence_max_rows: int | None = None  # the largest running batch (sequences of any kind) at which the
                                        # cadence applies. None: G (group)
    kernels: KernelSettings = DEFAULT_KERNEL_SETTINGS  # the Triton attention kernels' launch settings (CUDA)
    fault_rate: float = 0.0             # probability a fast-path candidate is replaced by a wrong token
    fault_seed: int = 0
    num_threads: int | None = None      # torch intra-op threads (None: leave torch's default)
    cache_dir: str | None = None        # where the loader caches dequantized weights

    def __post_init__(self) -> None:
        modes = [m.value for m in Mode]
        _check(self.mode in modes, "mode", f"one of {modes}, got {self.mode!r}")
        object.__setattr__(self, "mode", Mode(self.mode))
        _check(self.device in ("auto", "cpu", "cuda"), "device", f"one of auto/cpu/cuda, got {self.device!r}")
        _check(self.dtype in _DTYPES, "dtype", f"one of {sorted(_DTYPES)}, got {self.dtype!r}")
        _check(self.window >= 2, "window", f"W must be >= 2, got {self.window}")
        _check(self.group >= 1, "group", f"G must be >= 1, got {self.group}")
        _check(self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 3, "num_kv_blocks",
               f"must be >= 3 (2 reserved), got {self.num_kv_blocks}")
        _check(0.0 < self.kv_memory_share <= 1.0, "kv_memory_share", f"must be in (0, 1], got {self.kv_memory_share}")
        _check(self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs",
               f"must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is None:
            budget = DEFAULT_CUDA_MAX_NUM_BATCHED_TOKENS if self.resolved_device.type == "cuda" else 4096
            object.__setattr__(self, "max_num_batched_tokens", budget)
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
               f"must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.dvr_decode_attention in ("auto", "canonical", "canonical_step", "canonical_step_short", "split"),
               "dvr_decode_attention",
               f"one of auto/canonical/canonical_step/canonical_step_short/split, got {self.dvr_decode_attention!r}")
        _check(0.0 <= self.fault_rate <= 1.0, "fault_rate", f"must be in [0, 1], got {self.fault_rate}")
        if self.mode == Mode.BATCH_INVARIANT:  # the mode fixes the numerics, attention included
            _check(self.attention_backend in ("auto", "torch", "batch_invariant"), "attention_backend",
                   f"mode batch_invariant runs its own attention; leave it unset, got {self.attention_backend!r}")
            object.__setattr__(self, "attention_backend", "batch_invariant")
        backends = ("auto", "torch", "triton", "flash", "batch_invariant")
        _check(self.attention_backend in backends, "attention_backend",
               f"one of {list(backends)}, got {self.attention_backend!r}")
        on_cuda = self.resolved_device.type == "cuda"
        if self.attention_backend == "auto":
            object.__setattr__(self, "attention_backend", "triton" if on_cuda else "torch")
        _check(on_cuda or self.attention_backend not in ("triton", "flash"), "attention_backend",
               f"{self.attention_backend!r} runs on CUDA only; this config resolves to the CPU")
        if self.cuda_graphs is None:
            object.__setattr__(self, "cuda_graphs", on_cuda)
        _check(isinstance(self.cuda_graphs, bool), "cuda_graphs", f"must be a bool or None, got {self.cuda_graphs!r}")
        if self.max_num_seqs is None and not on_cuda:
            object.__setattr__(self, "max_num_seqs", CPU_MAX_NUM_SEQS)
        if self.canonical_prefill_min_tokens is None:
            # CUDA: the prefill token budget, so a canonical pass holds as much as a plain prefill pass (fast
            # prompts fill it under load); a lone deterministic prompt pays for the whole pass. CPU: small.
            minimum = min(DEFAULT_CUDA_CANONICAL_PREFILL_MIN_TOKENS, self.max_num_batched_tokens) if on_cuda else 64
            object.__setattr__(self, "canonical_prefill_min_tokens", minimum)
        _check(self.canonical_prefill_min_tokens >= 1, "canonical_prefill_min_tokens",
               f"must be >= 1, got {self.canonical_prefill_min_tokens}")
        if self.overlap is None:
            object.__setattr__(self, "overlap", on_cuda)
        _check(isinstance(self.overlap, bool), "overlap", f"must be a bool or None, got {self.overlap!r}")
        if self.verify_early_decode is None:
            object.__setattr__(self, "verify_early_decode", on_cuda)
        _check(isinstance(self.verify_early_decode, bool), "verify_early_decode",
               f"must be a bool or None, got {self.verify_early_decode!r}")
        if self.chained_verify is None:
            object.__setattr__(self, "chained_verify", on_cuda)
        _check(isinstance(self.chained_verify, bool), "chained_verify",
               f"must be a bool or None, got {self.chained_verify!r}")
        if self.dvr_decode_attention == "auto":
            object.__setattr__(self, "dvr_decode_attention", "canonical_step_short" if on_cuda else "split")
        if self.dvr_lookahead is None:
            # canonical DVR rows decode with the verifier's numerics (rollbacks are rare), so a row may run
            # ahead G-1 more windows and have them all verified in one pass; the split kernel rolls back
            # often enough that run-ahead past one window mostly feeds rollbacks
            fuller = self.dvr_decode_attention != "split"
            object.__setattr__(self, "dvr_lookahead", (self.group - 1) * self.window if fuller else self.window - 1)
        _check(self.dvr_lookahead >= 0, "dvr_lookahead", f"must be >= 0, got {self.dvr_lookahead}")
        rows = resolve_decode_cublaslt_min_rows(self.decode_cublaslt_min_rows, on_cuda and self.cuda_graphs)
        object.__setattr__(self, "decode_cublaslt_min_rows", rows)
        _check(isinstance(self.decode_cublaslt_min_rows, int) and self.decode_cublaslt_min_rows >= 0,
               "decode_cublaslt_min_rows", f"must be an int >= 0, got {self.decode_cublaslt_min_rows!r}")
        _check(self.decode_cublaslt_min_rows == 0 or on_cuda, "decode_cublaslt_min_rows",
               "CUDA only (it picks the BLAS library of CUDA decode graphs; unused without cuda_graphs)")
        _check(self.verify_decode_rows is None or (isinstance(self.verify_decode_rows, int)
                                                   and self.verify_decode_rows >= 0), "verify_decode_rows",
               f"must be an int >= 0 or None, got {self.verify_decode_rows!r}")
        if self.mode != Mode.DVR:  # no verify passes: nothing to carry
            object.__setattr__(self, "verify_decode_rows", 0)
        elif self.verify_decode_rows is None:
            carry = self.attention_backend == "triton"
            object.__setattr__(self, "verify_decode_rows", DEFAULT_VERIFY_DECODE_ROWS if carry else 0)
        _check(self.verify_decode_rows == 0 or self.attention_backend in ("torch", "triton"), "verify_decode_rows",
               f"the {self.attention_backend!r} attention backend cannot carry decode rows in a verify pass; "
               "use triton or torch, or set it to 0")
        if self.verify_packing is None:
            object.__setattr__(self, "verify_packing", "packed" if on_cuda else "padded")
        _check(self.verify_packing in ("padded", "packed"), "verify_packing",
               f"one of padded/packed, got {self.verify_packing!r}")
        if self.verify_max_windows is None:
            object.__setattr__(self, "verify_max_windows", 2 * self.group if self.verify_packing == "packed"
                               else self.group)
        _check(isinstance(self.verify_max_windows, int) and self.verify_max_windows >= self.group,
               "verify_max_windows", f"must be an int >= G = {self.group}, got {self.verify_max_windows!r}")
        if self.verify_trigger is None:
            object.__setattr__(self, "verify_trigger", "tokens" if self.verify_packing == "packed" else "windows")
        _check(self.verify_trigger in ("tokens", "windows"), "verify_trigger",
               f"one of tokens/windows, got {self.verify_trigger!r}")
        _check(self.verify_packing == "packed" or self.verify_max_windows == self.group, "verify_max_windows",
               f"a padded verify pass holds exactly G = {self.group} windows, got {self.verify_max_windows}")
        if self.verify_cadence_steps is None:
            steps = DEFAULT_CUDA_VERIFY_CADENCE_STEPS if on_cuda else DEFAULT_CPU_VERIFY_CADENCE_STEPS
            object.__setattr__(self, "verify_cadence_steps", steps)
        _check(isinstance(self.verify_cadence_steps, int) and self.verify_cadence_steps >= 0, "verify_cadence_steps",
               f"must be an int >= 0 (0: off) or None, got {self.verify_cadence_steps!r}")
        if self.verify_cadence_max_rows is None:
            object.__setattr__(self, "verify_cadence_max_rows", self.group)
        _check(isinstance(self.verify_cadence_max_rows, int) and self.verify_cadence_max_rows >= 1,
               "verify_cadence_max_rows", f"must be an int >= 1 or None, got {self.verify_cadence_max_rows!r}")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
               f"must be >= 2, got {self.max_model_len}")
        _check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
               "tensor_parallel_size", f"must be an int >= 1, got {self.tensor_parallel_size!r}")
        _check(self.tp_reduction in ("gather_sum", "nccl"), "tp_reduction",
               f"one of gather_sum/nccl, got {self.tp_reduction!r}")
        _check(self.tp_reduction != "nccl" or on_cuda, "tp_reduction",
               "nccl runs on CUDA only; this config resolves to the CPU (use gather_sum)")
        _check(self.tp_reduction != "nccl" or self.mode != Mode.BATCH_INVARIANT or self.tensor_parallel_size <= 2,
               "tp_reduction", f"nccl past 2 ranks sums in an order that follows the message size, so mode "
               f"batch_invariant needs gather_sum at tensor_parallel_size {self.tensor_parallel_size}")

    @property
    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.resolved_device.type == "cpu" else torch.bfloat16
        return _DTYPES[self.dtype]


RESERVED_BLOCKS = 2
ZERO_BLOCK = 0     # block-table padding points here; never written, stays zero
SCRATCH_BLOCK = 1  # K/V of dummy tokens / dummy rows of verify passes land here; never read as a key

_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}
