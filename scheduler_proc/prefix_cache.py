"""The prefix cache: which KV blocks hold which token prefixes, so requests can share them.

A trie of full blocks. Full block ``i`` of a sequence (tokens ``i*B .. (i+1)*B - 1``) is an
entry (``PrefixNode``) under the entry of block ``i - 1``, filed by its tokens (packed
int32 bytes, the dict key); the entries of first blocks are the roots. A lookup walks down
from the roots one block at a time, so a hit holds exactly the request's prefix: equal
tokens at every block, not an equal hash. A walk costs one bytes slice and one dict lookup
per block, and nothing is hashed ahead: a warm 4k-token prompt walks 254 blocks on its way
to the first token.

Entries are per content, not per block: requests that computed the same prefix at the same
time each hold a block with that content, and its node lists them all. A node lives while
some block holds its content. When the last one is evicted the node dies, and so does every
node below it (a lookup would have to walk through the dead one to reach them); their
unreferenced blocks go straight back to the free queue.

A request with a ``cache_salt`` walks a trie of its own, whose roots are that salt's: it
shares blocks only with requests of the same salt.

When. A block is indexed once it is full, its tokens are known (not still in flight on the
workers) and the step that computes its last token has been planned. Indexing happens
after that step's plan is built, never during it, so a later step, which the workers run
after the computing one, is the first that can read it.
"""

from __future__ import annotations

from scheduler_proc.block_manager import BlockManager
from scheduler_proc.request import Request


class PrefixNode:
    """One indexed block content: its tokens, its parent, its children, the blocks holding
    it."""

    __slots__ = ("tokens", "parent", "children", "blocks", "block", "alive", "salt")

    def __init__(self, tokens: bytes, parent: PrefixNode | None, salt: str | None = None) -> None:
        self.tokens = tokens  # packed int32, also its key among its siblings
        self.parent = parent
        self.salt = salt  # of a root: the cache salt whose trie it roots
        self.children: dict[bytes, PrefixNode] = {}
        self.blocks: dict[int, None] = {}  # insertion-ordered set of block ids
        # The oldest of ``blocks``, the one a hit puts in a block table: kept, not looked up,
        # because a warm admission reads it for every block of a long prompt.
        self.block = -1
        self.alive = True


class PrefixCache:
    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self._roots: dict[bytes, PrefixNode] = {}
        # The roots of each cache salt's trie; a salt leaves when its last root dies.
        self._salted_roots: dict[str, dict[bytes, PrefixNode]] = {}
        self._num_nodes = 0
        self._block_node: dict[int, PrefixNode] = {}
        block_manager.on_evict = self._on_evict

    def __len__(self) -> int:
        """The number of live entries (distinct cached block contents)."""
        return self._num_nodes

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
        salt = request.sampling.cache_salt
        roots = self._roots if salt is None else self._salted_roots.get(salt)
        if max_blocks <= 0 or not roots:
            return []
        packed = request.packed_tokens(0, max_blocks * self.block_size)
        step = 4 * self.block_size
        nodes: list[PrefixNode] = []
        add_node = nodes.append
        level = roots
        for offset in range(0, len(packed), step):
            node = level.get(packed[offset : offset + step])
            if node is None:
                break
            add_node(node)
            level = node.children
        return nodes

    @staticmethod
    def blocks_of(nodes: list[PrefixNode]) -> list[int]:
        """One block holding each entry's content, to put in a block table."""
        return [node.block for node in nodes]

    # -- indexing --------------------------------------------------------------------------

    def register(self, request: Request) -> None:
        """Index the request's blocks that became full, known and computed since last time."""
        if request.prefix_chain_broken:
            return
        done = len(request.prefix_nodes)
        size = self.block_size
        upto = min(request.num_computed_tokens, request.num_tokens) // size
        if upto <= done:
            return
        # One packed run for all the new blocks, then byte slices: packing per block costs
        # more than the lookups.
        packed = request.packed_tokens(done * size, upto * size)
        step = 4 * size
        parent = request.prefix_nodes[-1] if done else None
        for index in range(done, upto):
            if parent is not None and not parent.alive:
                request.prefix_chain_broken = True  # its prefix is gone from the index
                return
            offset = (index - done) * step
            tokens = packed[offset : offset + step]
            if parent is not None:
                level = parent.children
            else:
                salt = request.sampling.cache_salt
                level = self._roots if salt is None else self._salted_roots.setdefault(salt, {})
            node = level.get(tokens)
            if node is None:
                salt = request.sampling.cache_salt if parent is None else None
                node = level[tokens] = PrefixNode(tokens, parent, salt)
                self._num_nodes += 1
            block_id = request.block_ids[index]
            if block_id not in node.blocks:
                # A block computed alongside an equal one of another request: index it too,
                # so the content survives as long as either block does.
                if not node.blocks:
                    node.block = block_id
                node.blocks[block_id] = None
                self._block_node[block_id] = node
                self.block_manager.mark_reusable(block_id)
            request.prefix_nodes.append(node)
            parent = node

    def reset(self) -> tuple[int, int]:
        """Forget every entry; returns (entries forgotten, cached blocks made free). Blocks
        that requests hold stay theirs, and a request whose prefix is gone indexes no more
        of its blocks (``register``)."""
        num_entries = self._num_nodes
        cached_before = self.block_manager.num_cached_blocks
        for roots in [self._roots, *self._salted_roots.values()]:
            for node in list(roots.values()):
                self._kill(node)
        return num_entries, cached_before - self.block_manager.num_cached_blocks

    # -- eviction --------------------------------------------------------------------------

    def _on_evict(self, block_id: int) -> None:
        node = self._block_node.pop(block_id, None)
        if node is None:
            return
        del node.blocks[block_id]
        if not node.blocks:
            self._kill(node)
        elif node.block == block_id:
            node.block = next(iter(node.blocks))

    def _kill(self, node: PrefixNode) -> None:
        """Remove a node whose content no block holds, and every node below it."""
        if node.parent is not None:
            del node.parent.children[node.tokens]
        elif node.salt is None:
            del self._roots[node.tokens]
        else:
            roots = self._salted_roots[node.salt]
            del roots[node.tokens]
            if not roots:
                del self._salted_roots[node.salt]
        stack = [node]
        while stack:
            dead = stack.pop()
            dead.alive = False
            self._num_nodes -= 1
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
        num_nodes = 0
        stack: list[tuple[PrefixNode | None, dict[bytes, PrefixNode]]] = [(None, self._roots)]
        stack += [(None, roots) for roots in self._salted_roots.values()]
        for salt, roots in self._salted_roots.items():
            assert roots and all(node.salt == salt for node in roots.values()), "a salt's roots"
        while stack:
            parent, level = stack.pop()
            for tokens, node in level.items():
                num_nodes += 1
                assert node.alive and node.tokens == tokens, "a dead or misfiled entry"
                assert node.parent is parent, "an entry under the wrong parent"
                assert len(tokens) == 4 * self.block_size, "an entry that is not a full block"
                assert node.blocks, "a live entry that no block holds"
                assert node.block == next(iter(node.blocks)), "a stale representative block"
                stack.append((node, node.children))
        assert num_nodes == self._num_nodes, "the entry count is off"
