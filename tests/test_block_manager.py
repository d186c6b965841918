"""The block manager: allocation, sharing, freeing, and its invariants under random use."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_proc.block_manager import (
    BlockManager,
    BlockState,
    OutOfBlocksError,
    blocks_for_tokens,
)


def test_fresh_manager_has_every_block_free() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    assert manager.num_free_blocks == 8
    assert manager.usage == 0.0
    assert all(manager.state(b) is BlockState.FREE for b in range(8))
    manager.check_invariants()


def test_allocate_gives_distinct_owned_blocks() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    first = manager.allocate(3)
    second = manager.allocate(5)
    assert len(set(first + second)) == 8
    assert manager.num_free_blocks == 0
    assert manager.usage == 1.0
    assert all(manager.ref_count(b) == 1 for b in first + second)
    assert all(manager.state(b) is BlockState.OWNED for b in first)
    assert not manager.can_allocate(1)
    assert manager.can_allocate(0)
    manager.check_invariants()


def test_allocation_is_all_or_nothing() -> None:
    manager = BlockManager(num_blocks=4, block_size=4)
    manager.allocate(3)
    with pytest.raises(OutOfBlocksError):
        manager.allocate(2)
    assert manager.num_free_blocks == 1
    manager.check_invariants()


def test_free_returns_blocks_and_rejects_double_free() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    blocks = manager.allocate(2)
    manager.free(blocks)
    assert manager.num_free_blocks == 4
    with pytest.raises(ValueError):
        manager.free(blocks[:1])
    manager.check_invariants()


def test_shared_block_is_free_only_after_last_reference() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    blocks = manager.allocate(2)
    manager.incref(blocks[:1])
    assert manager.ref_count(blocks[0]) == 2
    manager.free(blocks)
    assert manager.state(blocks[0]) is BlockState.OWNED
    assert manager.state(blocks[1]) is BlockState.FREE
    assert manager.num_free_blocks == 3
    manager.free(blocks[:1])
    assert manager.num_free_blocks == 4
    with pytest.raises(ValueError):
        manager.incref(blocks[:1])  # sharing a free block would resurrect garbage
    manager.check_invariants()


def test_freed_blocks_are_reused_last() -> None:
    # FIFO reuse keeps recently freed content around longest (the prefix cache relies on it).
    manager = BlockManager(num_blocks=4, block_size=2)
    first = manager.allocate(2)
    manager.free(first)
    assert set(manager.allocate(2)).isdisjoint(first)


def test_blocks_for_tokens() -> None:
    assert blocks_for_tokens(0, 4) == 0
    assert blocks_for_tokens(1, 4) == 1
    assert blocks_for_tokens(4, 4) == 1
    assert blocks_for_tokens(5, 4) == 2


def test_invariant_check_catches_corruption() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.allocate(1)
    manager._free.append(manager._free[0])  # a block twice in the free queue
    with pytest.raises(AssertionError):
        manager.check_invariants()
    manager = BlockManager(num_blocks=4, block_size=2)
    manager._free.popleft()  # a block lost: neither free nor owned
    with pytest.raises(AssertionError):
        manager.check_invariants()


def test_reusable_blocks_are_cached_when_released_and_evicted_lru_first() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    evicted: list[int] = []
    manager.on_evict = evicted.append
    a, b, c = manager.allocate(3)
    for block in (a, b, c):
        manager.mark_reusable(block)
    manager.free([a])
    manager.free([c, b])  # released in reverse: b, then c
    assert [manager.state(x) for x in (a, b, c)] == [BlockState.CACHED] * 3
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 3
    assert manager.usage == 0.0
    manager.check_invariants()
    # Taking a cached block back makes it owned and no longer evictable.
    manager.incref([b])
    assert manager.state(b) is BlockState.OWNED and manager.num_free_blocks == 3
    # The free block goes first, then the least recently released cached one.
    first, second = manager.allocate(2)
    assert evicted == [a] and second == a
    assert manager.state(c) is BlockState.CACHED
    manager.check_invariants()
    manager.free([b])  # still reusable: cached again, most recently used
    manager.allocate(1)
    assert evicted == [a, c]
    manager.check_invariants()


def test_forget_turns_a_cached_block_free_and_an_owned_one_plain() -> None:
    manager = BlockManager(num_blocks=3, block_size=2)
    a, b = manager.allocate(2)
    manager.mark_reusable(a)
    manager.mark_reusable(b)
    manager.free([a])
    manager.forget(a)
    manager.forget(b)
    assert manager.state(a) is BlockState.FREE and not manager.is_reusable(b)
    manager.free([b])
    assert manager.state(b) is BlockState.FREE and manager.num_cached_blocks == 0
    with pytest.raises(ValueError):
        manager.mark_reusable(a)  # a free block holds nothing to keep
    with pytest.raises(ValueError):
        manager.incref([a])
    manager.check_invariants()


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 16),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["alloc", "free", "share", "mark", "revive", "forget"]),
            st.integers(0, 6),
            st.integers(),
        ),
        max_size=60,
    ),
)
def test_random_use_keeps_invariants_and_leaks_nothing(
    num_blocks: int, ops: list[tuple[str, int, int]]
) -> None:
    manager = BlockManager(num_blocks=num_blocks, block_size=4)
    evicted: list[int] = []
    manager.on_evict = evicted.append
    owners: list[list[int]] = []  # each owner holds one reference to each of its blocks
    for op, count, pick in ops:
        if op == "alloc":
            if manager.can_allocate(count):
                owners.append(manager.allocate(count))
            else:
                with pytest.raises(OutOfBlocksError):
                    manager.allocate(count)
        elif op == "free" and owners:
            manager.free(owners.pop(pick % len(owners)))
        elif op == "share" and owners:
            blocks = owners[pick % len(owners)][:count]
            manager.incref(blocks)
            owners.append(blocks)
        elif op == "mark" and owners:
            for block in owners[pick % len(owners)][:count]:
                manager.mark_reusable(block)
        elif op == "revive" and manager.num_cached_blocks:
            cached = [b for b in range(num_blocks) if manager.state(b) is BlockState.CACHED]
            block = cached[pick % len(cached)]
            manager.incref([block])
            owners.append([block])
        elif op == "forget":
            manager.forget(pick % num_blocks)
        manager.check_invariants()
        held = {b for blocks in owners for b in blocks}
        assert manager.num_free_blocks == num_blocks - len(held)
        for block in held:
            assert manager.ref_count(block) == sum(blocks.count(block) for blocks in owners)
        # Evictions happen only to serve an allocation, which now owns the evicted blocks,
        # and they lose their content.
        if evicted:
            assert op == "alloc" and set(evicted) <= set(owners[-1])
            assert not any(manager.is_reusable(b) for b in evicted)
            evicted.clear()
    for blocks in owners:
        manager.free(blocks)
    manager.check_invariants()
    assert manager.num_free_blocks == num_blocks
