"""What one forward pass tells attention: pass kind, where K/V go, which keys each row sees."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class PassKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    VERIFY = "verify"


@dataclass(frozen=True)
class AttentionMetadata:
    """Built by the model runner for one forward over T tokens in R rows.

    Token layout (T = query_start_loc[-1]):  | row 0 tokens | row 1 tokens | ... | row R-1 tokens |
    Row r's queries sit at absolute positions seq_lens[r] - n_r ... seq_lens[r] - 1,
    with n_r = query_start_loc[r+1] - query_start_loc[r].
    """

    kind: PassKind
    slot_mapping: torch.Tensor  # Long[T]: block_id * block_size + offset each token's K/V is written to
    query_start_loc: torch.Tensor  # Int[R+1]: cumulative token counts, starts at 0
    seq_lens: torch.Tensor  # Int[R]: keys visible to the row's last query, this pass's tokens included
    block_tables: torch.Tensor  # Int[R, max_blocks]: physical block per logical block; padding -> block 0
    # DECODE only, optional: Int[R], 1 = this row's attention must use the prefill/verify kernel's numerics
    # (a DVR row: its fast-path candidate then agrees with the verifier more often); 0 = any fast kernel.
    # Backends without a separate decode kernel ignore it. A static buffer under CUDA graphs.
    canonical_rows: torch.Tensor | None = None
    # DECODE with canonical_rows: True = every row of this step takes the canonical numerics, flagged or not
    # (one canonical launch instead of the split kernel beside a canonical one; the other rows' bits are
    # free anyway). Backends that do not split decode ignore it.
    canonical_step: bool = False
    # VERIFY only: the last `carried_rows` rows are one-token decode rows the pass carries beside its G rows of
    # W tokens (DvrTuning.verify_decode_rows; dummy rows where fewer are carried). Backends give the G rows
    # the verifier's numerics and the carried rows any decode numerics; no carried row changes a G row's bits.
    carried_rows: int = 0
    # VERIFY only, packed (DvrTuning.verify_packing): W, the most tokens a verify row holds; its rows then hold
    # 0 .. W tokens each (0: every verify row holds exactly W). Backends give each verify query the bits it gets
    # in a padded pass (rows of exactly W tokens).
    verify_window: int = 0

    @property
    def num_rows(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
