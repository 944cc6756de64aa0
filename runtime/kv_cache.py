"""The paged KV-cache block manager: can-allocate / allocate / free over fixed-size blocks.

    block table of a request (block ids, in order)      KV cache (per layer, keys and values)
    ┌────┬────┬────┐                                     block 0 ┌─────────────── block_size tokens
    │  7 │  2 │  9 │ ──── token j lives in block         block 1 │
    └────┴────┴────┘      table[j // block_size] at      block 2 │ ◀── tokens 16..31 of the request
                          offset j % block_size            ...   │
                                                          block 9 │ ◀── tokens 32..(n-1), partly full

Blocks are handed out from a free list; a request's blocks return to it when it finishes, is
aborted or is preempted. "No room" is a return value (`None`), never an exception. The manager
holds only integers; the cache tensors live with the model runner.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks for the request to hold num_tokens tokens in all."""
        have = len(self._tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold num_tokens tokens. Returns its table, or None if no room."""
        need = self.blocks_needed(request_id, num_tokens)
        if need > len(self._free):
            return None
        table = self._tables.setdefault(request_id, [])
        for _ in range(need):
            table.append(self._free.popleft())
        return table

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def free(self, request_id: str) -> int:
        """Return the request's blocks to the free list; returns how many were freed."""
        table = self._tables.pop(request_id, [])
        # Most recently used blocks go to the back: they are handed out last.
        self._free.extend(reversed(table))
        return len(table)
