"""Paged KV cache bookkeeping: blocks, block tables, allocate / truncate / free, integrity check.

Physical blocks 0..num_blocks-1; block 0 (zero block, block-table padding) and block 1 (scratch for
dummy tokens of verify passes) are reserved and never handed out. A block table is append-only except
for tail truncation, which is how a rollback releases the slots of discarded candidates.
"""
from __future__ import annotations

from collections import deque

ZERO_BLOCK = 0     # block-table padding points here; never written, stays zero
SCRATCH_BLOCK = 1  # K/V of dummy tokens / dummy rows of verify passes land here; never read as a key
RESERVED_BLOCKS = 2  # the zero block and the scratch block, never handed out


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > RESERVED_BLOCKS, num_blocks
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(RESERVED_BLOCKS, num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - RESERVED_BLOCKS

    def blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    def table(self, owner: str) -> list[int]:
        return self._tables.get(owner, [])

    def extra_blocks(self, owner: str, num_slots: int) -> int:
        """Blocks `owner` would need to cover slots [0, num_slots)."""
        return max(0, self.blocks_for(num_slots) - len(self.table(owner)))

    def ensure(self, owner: str, num_slots: int) -> list[int]:
        """Grow `owner`'s table to cover slots [0, num_slots); raises OutOfBlocks (nothing changed)."""
        table = self._tables.get(owner)
        if table is not None and len(table) * self.block_size >= num_slots:  # the common decode step
            return table
        need = self.extra_blocks(owner, num_slots)
        if need > len(self._free):
            raise OutOfBlocks(f"{owner} needs {need} blocks, {len(self._free)} free")
        table = self._tables.setdefault(owner, [])
        table.extend(self._free.popleft() for _ in range(need))
        return table

    def truncate(self, owner: str, num_slots: int) -> None:
        """Keep only the blocks covering slots [0, num_slots); the tail goes back to the free list."""
        table = self._tables.get(owner)
        if table is None:
            return
        keep = self.blocks_for(num_slots)
        while len(table) > keep:
            self._free.append(table.pop())
        if not table:
            del self._tables[owner]

    def free(self, owner: str) -> None:
        self.truncate(owner, 0)

    def owners(self) -> list[str]:
        return list(self._tables)

    def check(self) -> None:
        """Integrity: every usable block is either free or in exactly one table; reserved blocks nowhere."""
        seen: dict[int, str] = {}
        for owner, table in self._tables.items():
            assert table, f"empty table kept for {owner}"
            for b in table:
                assert RESERVED_BLOCKS <= b < self.num_blocks, f"{owner} holds invalid block {b}"
                assert b not in seen, f"block {b} shared by {seen[b]} and {owner}"
                seen[b] = owner
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate block in free list"
        assert not (free & seen.keys()), f"blocks both free and owned: {sorted(free & seen.keys())}"
        assert len(free) + len(seen) == self.num_usable, (
            f"leak: {self.num_usable - len(free) - len(seen)} blocks neither free nor owned")
