"""The canonical kernels at a 16-row query tile (triton_paged.set_query_tile(16)), on CUDA.

The tenth session's lever for canonical decode steps: the packed canonical decode kernel holds a GQA group
(4 heads on Llama-3.1-8B) in one query tile of the prefill kernel's shape, so at 64 rows 60 of them are dead
MMA rows. At 16 rows the verifier's bits change (new KERNEL_ID), and whether the packed kernel still gives
them is a hardware property that `packed_matches_prefill` checks per device. These are the bitwise
invariances of test_gpu_attention and test_canonical_decode rerun at that tile, plus that check itself.
Not yet run on a GPU.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.attention import triton_paged as tp
from tests.engine.test_canonical_decode import test_gpu_canonical_rows
from tests.engine.test_gpu_attention import (
    test_canonical_decode_equals_the_verifier_bitwise,
    test_canonical_rows_equal_the_verifier_bitwise,
    test_decode_matches_reference,
    test_prefill_matches_reference,
    test_verify_row_and_batch_invariance,
    test_verify_window_start_invariance,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# imported tests run here again, under the fixture below
REUSED = (test_canonical_decode_equals_the_verifier_bitwise, test_canonical_rows_equal_the_verifier_bitwise,
          test_decode_matches_reference, test_gpu_canonical_rows, test_prefill_matches_reference,
          test_verify_row_and_batch_invariance, test_verify_window_start_invariance)


@pytest.fixture(autouse=True)
def query_tile_16() -> Iterator[None]:
    tp.set_query_tile(16)
    yield
    tp.set_query_tile(64)



@pytest.mark.parametrize("group,head_dim", [(4, 128), (3, 64)])
def test_packed_kernel_gives_the_prefill_bits_at_16_rows(group: int, head_dim: int) -> None:
    """The lever holds on this device only if this passes (Llama-3.1-8B and SmolLM2 heads, bf16); where it
    fails, canonical rows at this tile fall back to the prefill kernel (correct bits, no speed-up)."""
    from engine.attention import triton_canonical_decode as packed

    assert packed.packed_matches_prefill(torch.device("cuda"), torch.bfloat16, group, head_dim)
