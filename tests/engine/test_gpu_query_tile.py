"""The canonical kernels at the query tile that is not the default (KernelSettings.query_tile), on CUDA.

The packed canonical decode kernel holds a GQA group
(4 heads on Llama-3.1-8B) in one query tile of the prefill kernel's shape, so at 64 rows 60 of them are dead
MMA rows. The tile changes the verifier's bits (KernelSettings.kernel_id), and whether the packed kernel gives them is a
hardware property that `packed_matches_prefill` checks per device. These are the bitwise invariances of
test_gpu_attention and test_canonical_decode rerun at the other tile, plus that check itself: they keep
the 64-row tile tested, which remains selectable (the default is 16 rows).
"""
from __future__ import annotations

import pytest
import torch

from engine.config import DEFAULT_KERNEL_SETTINGS, KernelSettings
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

# imported tests run here again, with the kernel_settings fixture below
REUSED = (test_canonical_decode_equals_the_verifier_bitwise, test_canonical_rows_equal_the_verifier_bitwise,
          test_decode_matches_reference, test_gpu_canonical_rows, test_prefill_matches_reference,
          test_verify_row_and_batch_invariance, test_verify_window_start_invariance)


OTHER_TILE = 64 if DEFAULT_KERNEL_SETTINGS.query_tile != 64 else 16


@pytest.fixture
def kernel_settings() -> KernelSettings:
    return KernelSettings(query_tile=OTHER_TILE)


@pytest.mark.parametrize("group,head_dim", [(4, 128), (3, 64)])
def test_packed_kernel_gives_the_prefill_bits_at_the_other_tile(group: int, head_dim: int,
                                                                 kernel_settings: KernelSettings) -> None:
    """The lever holds on this device only if this passes (Llama-3.1-8B and SmolLM2 heads, bf16); where it
    fails, canonical rows at this tile fall back to the prefill kernel (correct bits, no speed-up)."""
    from engine.attention import triton_canonical_decode as packed

    assert packed.packed_matches_prefill(torch.device("cuda"), torch.bfloat16, group, head_dim, kernel_settings)
