"""Block manager: randomized operation sequences keep the integrity check true; nothing leaks."""
from __future__ import annotations

import random

import pytest

from engine import config
from engine.block_manager import RESERVED_BLOCKS, BlockManager, OutOfBlocks
from engine.sampling import SamplingParams
from engine.scheduler import seq_key


def test_the_reserved_blocks_agree_with_the_config() -> None:
    """The model runner sizes the KV cache with the config's count, the block manager hands out the rest."""
    assert RESERVED_BLOCKS == config.RESERVED_BLOCKS == max(config.ZERO_BLOCK, config.SCRATCH_BLOCK) + 1


@pytest.mark.parametrize("seed", range(5))
def test_randomized_ops_keep_integrity(seed: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=40, block_size=4)
    slots: dict[str, int] = {}
    for _ in range(2000):
        owner = f"s{rng.randrange(12)}"
        op = rng.choice(["ensure", "ensure", "truncate", "free"])
        if op == "ensure":
            want = slots.get(owner, 0) + rng.randrange(1, 12)
            free_before = bm.num_free
            try:
                bm.ensure(owner, want)
                slots[owner] = want
            except OutOfBlocks:
                assert bm.num_free == free_before  # a failed allocation changes nothing
        elif op == "truncate" and owner in slots:
            slots[owner] = rng.randrange(0, slots[owner] + 1)
            bm.truncate(owner, slots[owner])
        elif op == "free":
            bm.free(owner)
            slots.pop(owner, None)
        bm.check()
        for o, n in slots.items():
            assert len(bm.table(o)) == bm.blocks_for(n)
            assert all(b >= RESERVED_BLOCKS for b in bm.table(o))
    for o in list(slots):
        bm.free(o)
    bm.check()
    assert bm.num_free == bm.num_usable


def test_check_detects_corruption() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.ensure("a", 8)
    bm.ensure("b", 4)
    bm.table("b").append(bm.table("a")[0])  # a block shared by two tables
    with pytest.raises(AssertionError, match="shared"):
        bm.check()
    bm2 = BlockManager(num_blocks=10, block_size=4)
    bm2.ensure("a", 4)
    bm2.table("a").pop()
    bm2.table("a").append(3)
    bm2._tables["a"].clear()
    with pytest.raises(AssertionError):
        bm2.check()


def test_no_leaks_after_finish_abort_and_preemption(make_mock_llm) -> None:
    llm = make_mock_llm(num_kv_blocks=2 + 10, block_size=4, max_num_seqs=8)
    core = llm.core
    det = SamplingParams(max_tokens=20, temperature=0.7, seed=3, deterministic=True, ignore_eos=True)
    fast = SamplingParams(max_tokens=20, temperature=0.7, seed=4, ignore_eos=True)
    seqs = [core.add_request(f"r{i}", [5 + i, 6, 7, 8], det if i % 2 else fast) for i in range(8)]

    def check_owners() -> None:
        """Only running sequences hold blocks: finished, aborted and preempted (waiting) ones hold none."""
        core.scheduler.blocks.check()
        assert set(core.scheduler.blocks.owners()) <= {seq_key(s) for s in core.scheduler.running}

    for _ in range(6):
        core.step()
        check_owners()
    assert core.abort("r3").finish_reason == "abort" and core.abort("r4").finish_reason == "abort"
    check_owners()
    while core.has_work():
        core.step()
        check_owners()
    assert core.scheduler.preemptions > 0, "budget too large to exercise preemption"
    assert all(s.is_finished for s in seqs)
    assert sum(s.finish_reason == "length" for s in seqs) == 6
    assert core.scheduler.blocks.num_free == core.scheduler.blocks.num_usable
    assert core.scheduler.blocks.owners() == []


def test_kv_cache_size_follows_config_not_requests(make_mock_llm) -> None:
    small, large = make_mock_llm(num_kv_blocks=20), make_mock_llm(num_kv_blocks=40)
    per_block = small.core.runner.kv.nbytes // 20
    assert large.core.runner.kv.nbytes == 40 * per_block
    before = small.core.runner.kv.nbytes
    small.generate([[3 + i, 4, 5] for i in range(12)], SamplingParams(max_tokens=10, ignore_eos=True))
    assert small.core.runner.kv.nbytes == before
