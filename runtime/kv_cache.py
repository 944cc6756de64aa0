"""The paged KV-cache block manager: can-allocate / allocate / free over fixed-size blocks,
with prefix caching.

    block table of a request (block ids, in order)      KV cache (per layer, keys and values)
    ┌────┬────┬────┐                                     block 0 ┌─────────────── block_size tokens
    │  7 │  2 │  9 │ ──── token j lives in block         block 1 │
    └────┴────┴────┘      table[j // block_size] at      block 2 │ ◀── tokens 16..31 of the request
                          offset j % block_size            ...   │
                                                          block 9 │ ◀── tokens 32..(n-1), partly full

Prefix caching. Once a block is full of computed tokens it gets the chained hash of its whole
prefix (kvstore/block_hash.py) and enters the cache map hash -> block. A new request first
takes every cached block of its longest cached prefix (`match_prefix`, reference-counted, so
several requests share them read-only) and computes only the rest. Blocks whose requests are
all gone stay cached: they wait in an LRU list and are handed out again (evicted) only when no
block that holds nothing reusable is left; a request's tail blocks are queued for eviction
before its head blocks, which more prompts share.

A request's partial last block is kept too when it ends (`free` given its computed tokens): the
next turn of a conversation re-sends the previous prompt and reply and more, and would otherwise
recompute those last tokens (half a block on average). A tail is keyed by the hash of the full
blocks before it; a prompt whose full blocks match up to there and that holds all of the tail's
tokens next takes the block over (it is no one else's: a tail is never shared, as its new
owner writes its next tokens into it) and computes from the tail's end. While that owner holds
it, the block's first slots still hold the tail's tokens: a second prompt that continues them
(the other sequences of an n > 1 request, a conversation's turns sent at once) gets a fresh
block with those slots copied in (`copy_slots`, the runner's copy; without one, as with a model
split over ranks, it computes them again). A prompt that shares only part of a tail does not
take it, so a conversation's tail is not lost to another that starts the same way. Tails are
local (the cluster's prefix index knows full blocks only) and are evicted like cached blocks.

    free, reusable nothing:  plain heap     (handed out first, lowest block id first)
    free, still cached:      LRU dict       (least recently freed first; evicting drops the hash
                                             or the tail)
    in use:                  ref_count > 0  (a cached block may be in many tables)

"No room" is a return value (`None`), never an exception. The manager holds only integers and
hashes; the cache tensors live with the model runner. Lowest id first: the blocks in use stay
packed at the start of the cache, whose memory the runner commits only as it is first touched
(EngineConfig.kv_cache_commit), so a worker's memory grows with the most it has ever held at
once, not with every block it has cycled through. Cache events (hashes stored and evicted)
queue up for the worker to publish to the cluster's prefix index (`drain_events`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvstore.block_hash import extend_block_hashes


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, seed: bytes | None = None, caching: bool = True
    ):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.seed = seed or b"\0" * 8  # the hash chain's root: what identifies this KV layout
        self.caching = caching  # prefix caching on/off
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._plain: list[int] = list(range(num_blocks))  # a heap (sorted is one)
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # per request: hashes of its full blocks
        # partial last blocks of ended requests: parent hash (of the full blocks before the
        # tail; the seed for a first block) -> {block: the tokens it holds}
        self._tails: dict[bytes, dict[int, tuple[int, ...]]] = {}
        self._tail_parent: dict[int, bytes] = {}  # tail block -> its key in _tails
        # tails taken over, while their owner holds them: the same maps (the tokens their first
        # slots still hold), sources of copies for the prompts that continue them too
        self._used_tails: dict[bytes, dict[int, tuple[int, ...]]] = {}
        self._used_parent: dict[int, bytes] = {}
        # copy_slots(src, dst, n): the KV of block src's first n slots into block dst's (the
        # model runner's, set by the engine where it can); None: used tails are not copied
        self.copy_slots: Callable[[int, int, int], None] | None = None
        self.record_events = False  # queue cache events for drain_events (a worker publishes them)
        self._stored: list[bytes] = []  # cache events not yet drained
        self._evicted: list[bytes] = []
        # the hit rate, since start: prompt tokens of the requests looked up, each request
        # once (the scheduler counts its first admission, not its readmission after preemption)
        self.query_tokens = 0
        self.hit_tokens = 0  # of those, found cached

    @property
    def num_free_blocks(self) -> int:
        return len(self._plain) + len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_tail_blocks(self) -> int:
        """Partial last blocks kept from ended requests (see the module docstring)."""
        return len(self._tail_parent)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks for the request to hold num_tokens tokens in all."""
        have = len(self._tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_tokens) <= self.num_free_blocks

    def match_prefix(
        self, request_id: str, token_ids: Sequence[int], tails: bool = True, count: bool = True
    ) -> int:
        """Give a request that holds no blocks the cached blocks of its longest cached prefix,
        and after them a kept partial block whose tokens the prompt continues (`tails`).

        Returns how many tokens they hold (the request's computed tokens). At least one token is
        always left to compute, since the last prompt token's logits are needed. `count=False`
        leaves the hit-rate counters to the caller (`count_query` once the request is first
        admitted: a request that waits for room is matched again at every step, and a preempted
        one again when readmitted).
        """
        if request_id in self._tables:
            raise ValueError(f"{request_id!r} already holds blocks")
        table: list[int] = []
        hashes: list[bytes] = []
        hit = 0
        if self.caching:
            usable = (len(token_ids) - 1) // self.block_size * self.block_size
            extend_block_hashes(hashes, self.seed, token_ids[:usable], self.block_size)
            for h in hashes:
                block = self._cached.get(h)
                if block is None:
                    break
                table.append(block)
            del hashes[len(table) :]
            for block in table:
                if self._ref[block] == 0:
                    del self._lru[block]
                self._ref[block] += 1
            hit = len(table) * self.block_size
            if tails and (self._tails or self._used_tails):
                parent = hashes[-1] if hashes else self.seed
                tail = self._take_tail(parent, token_ids, hit)
                if tail is not None:
                    table.append(tail[0])
                    hit += tail[1]
            if count:
                self.count_query(len(token_ids), hit)
        self._tables[request_id] = table
        self._hashes[request_id] = hashes
        return hit

    def count_query(self, tokens: int, hit: int) -> None:
        """A prefix lookup of `tokens` tokens that found `hit` cached, in the hit-rate counters
        (`prefix_cache_query_tokens`, `prefix_cache_hit_tokens`)."""
        if self.caching:
            self.query_tokens += tokens
            self.hit_tokens += hit

    def _take_tail(
        self, parent: bytes, token_ids: Sequence[int], start: int
    ) -> tuple[int, int] | None:
        """The longest tail under `parent` whose tokens `token_ids` holds from `start` on
        (leaving one to compute), for the caller: (block, its tokens). A kept one is taken off
        the cache; one in use (a tie goes to a kept one) is copied into a fresh block."""
        room = len(token_ids) - 1 - start
        best, best_n, used = -1, 0, False
        for in_use, tails in ((False, self._tails), (True, self._used_tails)):
            if in_use and self.copy_slots is None:
                break
            for block, tokens in tails.get(parent, {}).items():
                n = len(tokens)
                if best_n < n <= room and tuple(token_ids[start : start + n]) == tokens:
                    best, best_n, used = block, n, in_use
        if best < 0:
            return None
        tokens = tuple(token_ids[start : start + best_n])
        if used:
            if not self.num_free_blocks:
                return None
            assert self.copy_slots is not None
            src, best = best, self._take()  # (may evict a kept block, never one in use: src)
            self.copy_slots(src, best, best_n)
        else:
            self._drop_tail(best)
            del self._lru[best]
            self._ref[best] = 1
        self._used_tails.setdefault(parent, {})[best] = tokens
        self._used_parent[best] = parent
        return best, best_n

    def _forget_used(self, block: int) -> None:
        """A block its last holder gave up is no used tail any more (if it was one)."""
        parent = self._used_parent.pop(block, None)
        if parent is not None:
            tails = self._used_tails[parent]
            del tails[block]
            if not tails:
                del self._used_tails[parent]

    def _drop_tail(self, block: int) -> None:
        parent = self._tail_parent.pop(block)
        tails = self._tails[parent]
        del tails[block]
        if not tails:
            del self._tails[parent]

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold num_tokens tokens. Returns its table, or None if no room."""
        need = self.blocks_needed(request_id, num_tokens)
        if need > self.num_free_blocks:
            return None
        table = self._tables.setdefault(request_id, [])
        self._hashes.setdefault(request_id, [])
        for _ in range(need):
            table.append(self._take())
        return table

    def _take(self) -> int:
        if self._plain:
            block = heapq.heappop(self._plain)
        else:
            block, _ = self._lru.popitem(last=False)
            h = self._hash[block]
            if h is None:
                self._drop_tail(block)  # a kept partial block: local, no event
            else:
                del self._cached[h]
                self._hash[block] = None
                if self.record_events:
                    self._evicted.append(h)
        self._ref[block] = 1
        return block

    def num_hashed(self, request_id: str) -> int:
        """Blocks of the request already hashed (full and computed)."""
        return len(self._hashes.get(request_id, ()))

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Cache the request's blocks that `token_ids` (its computed tokens) fill completely."""
        if not self.caching:
            return
        hashes = self._hashes[request_id]
        table = self._tables[request_id]
        first = len(hashes)
        extend_block_hashes(hashes, self.seed, token_ids, self.block_size)
        for i in range(first, len(hashes)):
            h, block = hashes[i], table[i]
            if h in self._cached or self._hash[block] is not None:
                continue  # another request cached the same prefix first; ours stays private
            self._hash[block] = h
            self._cached[h] = block
            if self.record_events:
                self._stored.append(h)

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Free the request's blocks past those holding its first `num_tokens` tokens (rejected
        speculative drafts); returns how many. Those blocks are never cached: not yet full of
        computed tokens."""
        table = self._tables.get(request_id)
        keep = -(-num_tokens // self.block_size)
        if table is None or len(table) <= keep:
            return 0
        dropped = table[keep:]
        del table[keep:]
        for block in reversed(dropped):
            assert self._hash[block] is None, "a block past the computed tokens was cached"
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._forget_used(block)
                heapq.heappush(self._plain, block)
        return len(dropped)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def holds(self, request_id: str) -> bool:
        """Whether the request has a block table, if an empty one: a KV import of a one-token
        prompt reserves no block, yet is admitted as one that holds its blocks."""
        return request_id in self._tables

    def free(self, request_id: str, computed: Sequence[int] | None = None) -> int:
        """Release the request's blocks; returns how many it held.

        Cached blocks that no other request uses stay cached, tail first in the eviction order.
        `computed`: the request's computed tokens (whose keys and values its blocks hold); given,
        a partial last block of them is kept for a prompt that continues them.
        """
        table = self._tables.pop(request_id, [])
        hashes = self._hashes.pop(request_id, None)
        tail, parent = -1, self.seed
        tokens: tuple[int, ...] = ()
        if computed is not None and self.caching and hashes is not None:
            n_full, rest = divmod(len(computed), self.block_size)
            if rest and n_full < len(table) and n_full <= len(hashes):
                tail = table[n_full]
                tokens = tuple(computed[n_full * self.block_size :])
                parent = hashes[n_full - 1] if n_full else self.seed
        for block in reversed(table):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._forget_used(block)
                if self._hash[block] is not None:
                    self._lru[block] = None
                elif block == tail:
                    self._lru[block] = None
                    self._tails.setdefault(parent, {})[block] = tokens
                    self._tail_parent[block] = parent
                else:
                    heapq.heappush(self._plain, block)
        return len(table)

    def cached_hashes(self) -> list[bytes]:
        """Every hash held now (a worker leaving removes them from the prefix index)."""
        return list(self._cached)

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """Hashes stored and evicted since the last call."""
        stored, evicted = self._stored, self._evicted
        self._stored, self._evicted = [], []
        return stored, evicted
