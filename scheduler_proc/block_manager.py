"""Logical KV cache blocks: which are free, which are owned by sequences, and how often.

The scheduler hands out block ids; the workers own the physical tensors behind them. A block
is in exactly one state at a time:

- FREE: unreferenced and holding nothing worth keeping; it sits in the free queue.
- OWNED: referenced by one or more sequences (ref count > 0).
- CACHED: unreferenced but holding a full block of a known prefix (the prefix cache marked it
  reusable), so a later request with the same prefix can take it back, or it is evicted,
  least recently used first, once the free queue runs dry. ``num_free_blocks`` counts it:
  an allocation can always have it.

The block manager knows nothing of tokens. The prefix cache marks blocks reusable
(``mark_reusable``) and hears of every eviction through ``on_evict``, so that it can drop
the block from its index; ``forget`` is its way to say that a block's content is no longer
reachable.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from enum import Enum


class BlockState(Enum):
    FREE = "free"
    OWNED = "owned"
    CACHED = "cached"


class OutOfBlocksError(RuntimeError):
    """An allocation asked for more blocks than can be made free."""


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need positive num_blocks and block_size, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        # FIFO: a freed block goes to the back, so the blocks freed longest ago are reused
        # first.
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts: list[int] = [0] * num_blocks
        # Unreferenced reusable blocks, least recently used first (the eviction order).
        self._cached: OrderedDict[int, None] = OrderedDict()
        # Blocks whose content the prefix cache indexes, owned or cached.
        self._reusable: set[int] = set()
        # Called with a cached block's id when an allocation evicts it.
        self.on_evict: Callable[[int], None] | None = None

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get right now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks kept for their content (a subset of ``num_free_blocks``)."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by sequences (0.0 to 1.0)."""
        return self.num_used_blocks / self.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_unreferenced(self, block_ids: Iterable[int]) -> int:
        """How many of these (cached) blocks taking a reference would remove from the free
        count."""
        return sum(1 for block_id in block_ids if self._ref_counts[block_id] == 0)

    def is_reusable(self, block_id: int) -> bool:
        return block_id in self._reusable

    def state(self, block_id: int) -> BlockState:
        if self._ref_counts[block_id] > 0:
            return BlockState.OWNED
        if block_id in self._cached:
            return BlockState.CACHED
        return BlockState.FREE

    # -- changes ---------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks, each with ref count 1. All or nothing."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if not self.can_allocate(num_blocks):
            raise OutOfBlocksError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        allocated = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                # Evict the least recently used cached block; its content is lost. The hook
                # may ``forget`` other cached blocks, which only moves them to the free queue.
                block_id, _ = self._cached.popitem(last=False)
                self._reusable.discard(block_id)
                if self.on_evict is not None:
                    self.on_evict(block_id)
            self._ref_counts[block_id] = 1
            allocated.append(block_id)
        return allocated

    def incref(self, block_ids: list[int]) -> None:
        """One more reference to each block: share an owned block, or take a cached one
        back (it stops being evictable).

        A warm admission takes a reference to every block of a long cached prefix, so the
        loops work on locals."""
        ref_counts = self._ref_counts
        cached = self._cached
        for block_id in block_ids:
            if ref_counts[block_id] <= 0 and block_id not in cached:
                raise ValueError(f"block {block_id} is free; its content cannot be shared")
        for block_id in block_ids:
            count = ref_counts[block_id]
            if count == 0:
                del cached[block_id]
            ref_counts[block_id] = count + 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block. A block nobody references becomes cached if its
        content is reusable, else free.

        Blocks are released in reverse order, so that the tail of a sequence (the part least
        likely to be shared) is evicted or reused first.
        """
        ref_counts = self._ref_counts
        for block_id in block_ids:
            if ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed more times than it was allocated")
        reusable = self._reusable
        cached = self._cached
        free = self._free
        for block_id in reversed(block_ids):
            count = ref_counts[block_id] - 1
            ref_counts[block_id] = count
            if count == 0:
                if block_id in reusable:
                    cached[block_id] = None
                else:
                    free.append(block_id)

    def mark_reusable(self, block_id: int) -> None:
        """An owned block now holds indexed content: keep it cached when it is released."""
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not owned; only owned blocks gain content")
        self._reusable.add(block_id)

    def forget(self, block_id: int) -> None:
        """The block's content can no longer be found: a cached block becomes free, an owned
        one will be free when released."""
        self._reusable.discard(block_id)
        if block_id in self._cached:
            del self._cached[block_id]
            self._free.append(block_id)

    # -- checking --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError unless every block is in exactly one state.

        Meant for tests: it walks every block, so it is O(num_blocks).
        """
        free = list(self._free)
        free_set = set(free)
        assert len(free) == len(free_set), "a block is in the free queue twice"
        cached_set = set(self._cached)
        assert not free_set & cached_set, "a block is both free and cached"
        assert cached_set <= self._reusable, "a cached block is not reusable"
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has ref count {count}"
            in_free = block_id in free_set
            in_cached = block_id in cached_set
            if count > 0:
                assert not in_free and not in_cached, f"owned block {block_id} is also free/cached"
            else:
                assert in_free or in_cached, f"unreferenced block {block_id} was lost"
                assert in_free != (block_id in self._reusable), (
                    f"unreferenced block {block_id}: free and reusable, or cached and not"
                )
        assert all(0 <= b < self.num_blocks for b in free_set | cached_set), "foreign block id"
