"""The prefix cache: which KV blocks hold which token prefixes, so requests can share them.

Keys. Full block ``i`` of a sequence (tokens ``i*B .. (i+1)*B - 1``) is keyed by a 64-bit
hash of its parent block's key and its own tokens (packed int32), so a key covers every
token before it. Python's ``hash`` is salted per process, which is fine: keys never leave
the scheduler, and a cryptographic digest would cost the warm time to first token several
times more (a 4k-token prompt has 256 blocks to key). A key alone never decides a hit: each entry
(``PrefixNode``) also stores its tokens and its parent entry, and a lookup walks from the
first block, checking at every block that the entry's parent is the entry matched one block
earlier and that its tokens equal the request's. By induction a hit holds exactly the
request's prefix; a key collision costs a miss, never wrong KV.

Entries are per content, not per block: requests that computed the same prefix at the same
time each hold a block with that content, and its node lists them all. A node lives while
some block holds its content. When the last one is evicted the node dies, and so does every
node below it (a lookup would have to walk through the dead one to reach them); their
unreferenced blocks go straight back to the free queue.

When. A block is indexed once it is full, its tokens are known (not still in flight on the
workers) and the step that computes its last token has been planned. Indexing happens
after that step's plan is built, never during it, so a later step, which the workers run
after the computing one, is the first that can read it.
"""

from __future__ import annotations

import logging

from scheduler_proc.block_manager import BlockManager
from scheduler_proc.request import Request

logger = logging.getLogger(__name__)

_ROOT_DIGEST = 0


def block_digest(parent_digest: int, packed_tokens: bytes) -> int:
    """The key of a block, chained over its parent's key."""
    return hash((parent_digest, packed_tokens))


class PrefixNode:
    """One indexed block content: a digest, its tokens, its parent, the blocks holding it."""

    __slots__ = ("digest", "tokens", "parent", "children", "blocks", "alive")

    def __init__(self, digest: int, tokens: bytes, parent: PrefixNode | None) -> None:
        self.digest = digest
        self.tokens = tokens  # packed int32
        self.parent = parent
        self.children: dict[int, PrefixNode] = {}
        self.blocks: dict[int, None] = {}  # insertion-ordered set of block ids
        self.alive = True


class PrefixCache:
    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self._index: dict[int, PrefixNode] = {}
        self._block_node: dict[int, PrefixNode] = {}
        block_manager.on_evict = self._on_evict

    def __len__(self) -> int:
        """The number of live entries (distinct cached block contents)."""
        return len(self._index)

    @property
    def num_indexed_blocks(self) -> int:
        return len(self._block_node)

    # -- lookups ---------------------------------------------------------------------------

    def match(self, request: Request) -> list[PrefixNode]:
        """The entries of the longest cached prefix of the request's tokens.

        At least one token is left to compute (the step that computes it samples the next
        token), so at most ``num_tokens - 1`` tokens, rounded down to full blocks, match.
        """
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= 0 or not self._index:
            return []
        self._extend_keys(request, max_blocks)
        nodes: list[PrefixNode] = []
        parent: PrefixNode | None = None
        for digest, tokens in request.block_keys[:max_blocks]:
            node = self._index.get(digest)
            if node is None or node.parent is not parent or node.tokens != tokens:
                break
            nodes.append(node)
            parent = node
        return nodes

    @staticmethod
    def blocks_of(nodes: list[PrefixNode]) -> list[int]:
        """One block holding each entry's content, to put in a block table."""
        return [next(iter(node.blocks)) for node in nodes]

    # -- indexing --------------------------------------------------------------------------

    def register(self, request: Request) -> None:
        """Index the request's blocks that became full, known and computed since last time."""
        if request.prefix_chain_broken:
            return
        done = len(request.prefix_nodes)
        upto = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if upto <= done:
            return
        self._extend_keys(request, upto)
        parent = request.prefix_nodes[-1] if done else None
        for index in range(done, upto):
            if parent is not None and not parent.alive:
                request.prefix_chain_broken = True  # its prefix is gone from the index
                return
            digest, tokens = request.block_keys[index]
            block_id = request.block_ids[index]
            node = self._index.get(digest)
            if node is None:
                node = PrefixNode(digest, tokens, parent)
                self._index[digest] = node
                if parent is not None:
                    parent.children[digest] = node
            elif node.parent is not parent or node.tokens != tokens:
                logger.warning(
                    "prefix cache: digest collision at block %d of request %s; not indexed",
                    index,
                    request.request_id,
                )
                request.prefix_chain_broken = True
                return
            if block_id not in node.blocks:
                # A block computed alongside an equal one of another request: index it too,
                # so the content survives as long as either block does.
                node.blocks[block_id] = None
                self._block_node[block_id] = node
                self.block_manager.mark_reusable(block_id)
            request.prefix_nodes.append(node)
            parent = node

    def _extend_keys(self, request: Request, num_blocks: int) -> None:
        """Compute the keys of the request's first ``num_blocks`` full blocks (their tokens
        must be known)."""
        keys = request.block_keys
        first = len(keys)
        if first >= num_blocks:
            return
        size = self.block_size
        # One packed run for all the new blocks, then byte slices: packing per block costs
        # more than hashing.
        packed = request.packed_tokens(first * size, num_blocks * size)
        step = 4 * size
        parent = keys[-1][0] if keys else _ROOT_DIGEST
        digest = block_digest
        for offset in range(0, len(packed), step):
            tokens = packed[offset : offset + step]
            parent = digest(parent, tokens)
            keys.append((parent, tokens))

    # -- eviction --------------------------------------------------------------------------

    def _on_evict(self, block_id: int) -> None:
        node = self._block_node.pop(block_id, None)
        if node is None:
            return
        del node.blocks[block_id]
        if not node.blocks:
            self._kill(node)

    def _kill(self, node: PrefixNode) -> None:
        """Remove a node whose content no block holds, and every node below it."""
        if node.parent is not None:
            node.parent.children.pop(node.digest, None)
        stack = [node]
        while stack:
            dead = stack.pop()
            dead.alive = False
            if self._index.get(dead.digest) is dead:
                del self._index[dead.digest]
            for block_id in dead.blocks:
                del self._block_node[block_id]
                self.block_manager.forget(block_id)
            dead.blocks.clear()
            stack.extend(dead.children.values())
            dead.children.clear()

    # -- checking --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the index and the block states disagree (for tests)."""
        manager = self.block_manager
        for block_id, node in self._block_node.items():
            assert node.alive and block_id in node.blocks, f"block {block_id}: stale entry"
            assert manager.is_reusable(block_id), f"indexed block {block_id} is not reusable"
        reusable = {b for b in range(manager.num_blocks) if manager.is_reusable(b)}
        assert reusable == set(self._block_node), "reusable blocks and the index disagree"
        for digest, node in self._index.items():
            assert node.alive and node.digest == digest, "a dead or misfiled entry"
            assert node.blocks, "a live entry that no block holds"
            assert node.parent is None or (
                node.parent.alive and node.parent.children.get(digest) is node
            ), "a live entry under a dead or unlinked parent"
            expected = block_digest(
                node.parent.digest if node.parent else _ROOT_DIGEST, node.tokens
            )
            assert expected == digest, "an entry filed under the wrong digest"
