"""Block hashes of a token sequence: the identity of a full KV-cache block, everywhere.

The engine (which blocks it holds), the prefix index in Redis (which worker holds which block)
and the gateway (which worker holds the longest prefix of a prompt) must agree bit for bit, so
the function lives here, torch-free, and all three import it.

    seed  = H(b"edgeinfer-kv-v1" | cache identity)      cache identity: model revision, dtype,
    h[0]  = H(seed | tokens[0 : B])                      block size (whatever changes the KV)
    h[i]  = H(h[i-1] | tokens[i*B : (i+1)*B])
    H     = BLAKE2b, 8-byte digest; tokens as little-endian int32

A block's hash covers its whole prefix (the chain), so equal hashes mean equal KV contents.
Only full blocks have hashes; a partial last block is never shared.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

VERSION = b"edgeinfer-kv-v1"
HASH_BYTES = 8


def cache_seed(identity: str) -> bytes:
    """The chain's root for one cache identity (e.g. "<revision>/float32/16")."""
    return hashlib.blake2b(VERSION + identity.encode(), digest_size=HASH_BYTES).digest()


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def extend_block_hashes(
    hashes: list[bytes], seed: bytes, tokens: Sequence[int], block_size: int
) -> list[bytes]:
    """Append the hashes of the full blocks of `tokens` not yet in `hashes` (in place).

    `hashes` holds the hashes of the first len(hashes) blocks of the same sequence, so a request
    that grows by a token per step hashes each block once, when it fills.
    """
    n_full = len(tokens) // block_size
    parent = hashes[-1] if hashes else seed
    for i in range(len(hashes), n_full):
        block = _tokens_bytes(tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.blake2b(parent + block, digest_size=HASH_BYTES).digest()
        hashes.append(parent)
    return hashes


def block_hashes(seed: bytes, tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Hashes of every full block of `tokens`."""
    return extend_block_hashes([], seed, tokens, block_size)
