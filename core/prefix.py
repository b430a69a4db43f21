"""Prefix caching: a prompt's full blocks of tokens, keyed by a hash of their tokens and all
before them, kept after their request ends and shared by the next prompts that start alike.

The cache holds whatever a backend stores for a block (its ``payload``: the block's keys and
values, the target features a drafter's state is rebuilt from). A block in use by a running
request is pinned (reference-counted); unpinned blocks are evicted least recently used first.
A lookup compares each block's tokens and parent, not only the hash, so a collision can cost
a miss but never a wrong hit."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable


def chain_key(parent: int | None, tokens: tuple[int, ...]) -> int:
    """A block's key: its tokens and, through its parent's key, every token before them."""
    return hash((parent, tokens))


def block_keys(ids: list[int], block_size: int, limit: int) -> list[int]:
    """The keys of the full blocks within ids[:limit], first to last, as the cache keys them."""
    keys, parent = [], None
    for start in range(0, limit - block_size + 1, block_size):
        parent = chain_key(parent, tuple(ids[start : start + block_size]))
        keys.append(parent)
    return keys


@dataclass(eq=False)
class Block:
    key: int  # hash of (parent's key, tokens)
    tokens: tuple[int, ...]
    parent: "Block | None"
    payload: Any
    refs: int = 0  # running requests using it
    children: int = 0  # cached blocks whose parent this is: a block is evicted only without them


@dataclass
class PrefixStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found cached


@dataclass
class PrefixCache:
    """Up to ``capacity`` blocks of ``block_size`` tokens. ``evicted`` is told of each block
    dropped (a backend whose payload is a place in a store of its own frees it there)."""

    block_size: int
    capacity: int
    blocks: "OrderedDict[int, Block]" = field(default_factory=OrderedDict)  # key -> block, least recent first
    stats: PrefixStats = field(default_factory=PrefixStats)
    evicted: Callable[[Block], None] | None = None

    @staticmethod
    def key(parent: Block | None, tokens: tuple[int, ...]) -> int:
        return chain_key(None if parent is None else parent.key, tokens)

    def lookup(self, ids: list[int], limit: int) -> list[Block]:
        """The cached blocks ``ids`` starts with, covering at most ``limit`` tokens, pinned for
        the caller (release them when its request ends); counts the query."""
        found, parent = [], None
        for start in range(0, limit - self.block_size + 1, self.block_size):
            tokens = tuple(ids[start : start + self.block_size])
            block = self.blocks.get(self.key(parent, tokens))
            if block is None or block.tokens != tokens or block.parent is not parent:
                break
            found.append(block)
            parent = block
        for block in found:
            block.refs += 1
            self.blocks.move_to_end(block.key)
        self.stats.queries += len(ids)
        self.stats.hits += len(found) * self.block_size
        return found

    def insert(self, parent: Block | None, tokens: tuple[int, ...], payload: Any) -> Block | None:
        """Cache a full block after ``parent`` (None: the prompt's first), pinned for the caller;
        None when every cached block is pinned (nothing to evict) or the key is taken."""
        key = self.key(parent, tokens)
        if key in self.blocks or (len(self.blocks) >= self.capacity and not self.evict()):
            return None
        block = Block(key, tokens, parent, payload, refs=1)
        self.blocks[key] = block
        if parent is not None:
            parent.children += 1
        return block

    def summary(self) -> dict[str, Any]:
        """What /spec shows: the blocks cached and pinned, the capacity, the tokens found."""
        return {"block_size": self.block_size, "capacity_blocks": self.capacity, "cached_blocks": len(self.blocks),
                "pinned_blocks": sum(b.refs > 0 for b in self.blocks.values()),
                "queried_tokens": self.stats.queries, "hit_tokens": self.stats.hits}

    def release(self, blocks: list[Block]) -> None:
        for block in blocks:
            if block.refs <= 0:
                raise RuntimeError("prefix cache: a block released more often than it was pinned")
            block.refs -= 1

    def evict(self) -> bool:
        """Drop the least recently used unpinned block whose children are gone (a chain is
        evicted from its end, so every cached block's parent stays cached). A lookup moves a
        chain's blocks to the end parent first, so the scan usually passes only the parents of
        the oldest chain (and any pinned blocks older than it) before it finds a leaf."""
        for key, block in self.blocks.items():
            if block.refs == 0 and block.children == 0:
                del self.blocks[key]
                if block.parent is not None:
                    block.parent.children -= 1
                if self.evicted is not None:
                    self.evicted(block)
                return True
        return False
