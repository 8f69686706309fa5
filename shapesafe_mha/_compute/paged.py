"""`PagedKVCache`: keys and values of many sequences in one pool of fixed-size blocks, a block table each.

Continuous batching serves sequences of different lengths that join and leave between steps. A contiguous
`KVCache` of `(batch, ..., capacity, ...)` reserves `capacity` positions for every sequence; a paged cache
reserves blocks of `block_size` positions as a sequence grows (a free list hands them out, a sequence that
leaves or whose window has passed them gives them back), so memory follows the positions actually held.

The module reads it through two views that are `KVCache`s to its cache stage (`SequenceView` for one
sequence's prefill or chunk, `DecodeView` for one new token of every sequence at once): the module's own
stages, checks and failure handling run unchanged, and every slot read or written is checked to belong to
the sequence it is read for (a block table pointing outside the pool, or at another sequence's block, is a
`ShapeError`, never a silent gather of someone else's keys): on each call for a prefill or a chunk, and where a
block table changes for decoding, whose steps read slot maps kept between them (`PagedKVCache.decode_slots`).
"""

import math
from typing import Any

import torch
from torch import Tensor

from .._core.contract import Verdicts
from .._core.dims import BlockTable, PagePool
from .._core.errors import ConfigError, ShapeError
from .cache import KVCache
from .fastpath import tensor_kind

PagedState = tuple[Tensor, Tensor, dict[int, list[int]], dict[int, int], dict[int, int], list[int], int]


class PagedKVCache:
    """Keys and values of many sequences, in blocks of `block_size` positions taken from one shared pool.

    Each sequence holds a block table (its blocks in position order) and a length; `add()` starts a sequence
    and returns its id, `remove(seq)` ends it and frees its blocks. A `MultiHeadAttention` called with
    `kv_cache=paged` serves every live sequence in one call (`paged.sequences`, in the order they were added):
    a packed batch `(1, total, d_model)` with `cu_seqlens` (each sequence's new tokens, a prefill or a chunk or
    one token), or `(num_seqs, 1, d_model)`, one new token each (decoding). With a `window`, blocks whose
    positions no query can see any more go back to the free list.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> attn = ssm.MultiHeadAttention(32, num_heads=4, num_kv_heads=2, rope_theta=10000.0)
        >>> cache = ssm.PagedKVCache.for_module(attn, num_blocks=8, block_size=4)
        >>> a, b = cache.add(), cache.add()
        >>> cu = torch.tensor([0, 5, 7], dtype=torch.int32)  # a prompt of 5 tokens, one of 2
        >>> attn(torch.randn(1, 7, 32), cu_seqlens=cu, is_causal=True, kv_cache=cache).shape
        torch.Size([1, 7, 32])
        >>> attn(torch.randn(2, 1, 32), is_causal=True, kv_cache=cache).shape  # one token each
        torch.Size([2, 1, 32])
        >>> cache.length(a), cache.length(b), cache.block_table().shape
        (6, 3, torch.Size([2, 2]))

    Arguments:
        num_blocks, block_size, num_kv_heads, d_head: the pool's shape `(num_blocks, block_size, num_kv_heads,
            d_head)`, for keys and for values.
        dtype, device: the pool's.
        window: keep only the positions a sliding window of this many keys can still see (free the blocks
            before them); None keeps every position.
        shared: one pool for keys and values (`values_pool is keys_pool`): a `LatentAttention`'s cache, one entry
            (latent and rotary key, `d_head = kv_lora_rank + d_rope`, `num_kv_heads = 1`) a position.

    Raises:
        ConfigError: a size that is not a positive int, or a window that is not.
    """

    keys_pool: PagePool
    values_pool: PagePool

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        d_head: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        window: int | None = None,
        shared: bool = False,
    ) -> None:
        for name, size in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("d_head", d_head),
        ):
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                raise ConfigError(f"PagedKVCache(): {name} must be a positive int, but got {size!r}.")
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ConfigError(f"PagedKVCache(): window must be a positive int or None, but got {window!r}.")
        shape = (num_blocks, block_size, num_kv_heads, d_head)
        self.keys_pool = torch.zeros(shape, dtype=dtype, device=device)
        # latent attention caches one entry a position (its latent and rotary key): keys and values are one pool
        self.values_pool = self.keys_pool if shared else torch.zeros(shape, dtype=dtype, device=device)
        self.window = window
        self._tables: dict[int, list[int]] = {}  # each sequence's blocks, in position order (-1: freed by its window)
        self._lengths: dict[int, int] = {}  # positions each sequence has seen
        self._owner_of: dict[int, int] = {}  # block -> the sequence holding it
        self._owners = torch.full((num_blocks,), -1, dtype=torch.int64)  # the same, as the checks read it
        self._owners_stale = False  # (rebuilt from _owner_of when a check next reads it: no tensor write per block)
        self._decoding: _Decoding | None = None  # the decoding steps' tensors, kept between steps (see `decode_slots`)
        flat = (num_blocks * block_size, num_kv_heads, 1, d_head)  # the pools as rows of slots (`_flat`)
        self._flats = (self.keys_pool, self.values_pool, self.keys_pool.view(flat), self.values_pool.view(flat))
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out the lowest first
        self._handed: list[tuple[int, int]] | None = None  # while a decoding step runs: the blocks reserve hands out
        self._zero = self.keys_pool.new_zeros(())  # (what the views' witnesses expand: `_witness`)
        self._next = 0
        self._verdicts = Verdicts()

    @classmethod
    def for_module(cls, module: Any, num_blocks: int, block_size: int) -> "PagedKVCache":
        """A paged cache that fits `module`: a `MultiHeadAttention`'s KV heads, `d_head`, dtype, device and window,
        or a `LatentAttention`'s entries (`shared`: its latent and rotary key, one pool)."""
        if hasattr(module, "kv_lora_rank"):
            dtype, device = tensor_kind(module, module.kv_a_proj_with_mqa)
            width = module.kv_lora_rank + module.d_rope
            return cls(num_blocks, block_size, 1, width, dtype=dtype, device=device, shared=True)
        dtype, device = tensor_kind(module, module.k_proj)
        heads, d_head = module.num_kv_heads, module.d_head
        return cls(num_blocks, block_size, heads, d_head, dtype=dtype, device=device, window=module.window)

    # --- the pool's sizes ---------------------------------------------------------------------------

    @property
    def window(self) -> int | None:
        """The sliding window whose passed blocks the cache frees (None: it keeps every position)."""
        return self._window

    @window.setter
    def window(self, value: int | None) -> None:
        # The blocks it freed were chosen by its window: set on a built cache, it would be half applied.
        if "_tables" in self.__dict__ and value != self._window:
            raise ConfigError(
                f"PagedKVCache: window cannot be set on a built cache: the blocks it freed were chosen by it. Build "
                f"one that has it: PagedKVCache.for_module(module, num_blocks, block_size) from a module of that "
                f"window, or PagedKVCache(..., window={value!r})."
            )
        self._window = value

    @property
    def num_blocks(self) -> int:
        return self.keys_pool.shape[0]

    @property
    def block_size(self) -> int:
        return self.keys_pool.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.keys_pool.shape[2]

    @property
    def d_head(self) -> int:
        return self.keys_pool.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys_pool.dtype

    @property
    def device(self) -> torch.device:
        return self.keys_pool.device

    @property
    def nbytes(self) -> int:
        """Bytes of both pools (what the cache holds, used or free; one pool when `shared`)."""
        pools = 1 if self.values_pool is self.keys_pool else 2
        return pools * self.keys_pool.numel() * self.keys_pool.element_size()

    @property
    def free_blocks(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    # --- sequences ----------------------------------------------------------------------------------

    @property
    def sequences(self) -> tuple[int, ...]:
        """The live sequences' ids, in the order they were added: the order a call's sequences come in."""
        return tuple(self._tables)

    def add(self) -> int:
        """Start an empty sequence (it joins the next call); return its id."""
        seq = self._next
        self._next += 1
        self._tables[seq], self._lengths[seq] = [], 0
        return seq

    def remove(self, seq: int) -> None:
        """End sequence `seq`: its blocks go back to the free list (it leaves the next call).

        Raises:
            ConfigError: `seq` is not a live sequence.
        """
        self._live(seq, "remove")
        for block in self._tables.pop(seq):
            if block >= 0:
                self._release(block)
        del self._lengths[seq]

    def length(self, seq: int) -> int:
        """Positions sequence `seq` has seen (with a window, also those whose blocks were freed)."""
        self._live(seq, "length")
        return self._lengths[seq]

    def block_table(self) -> BlockTable:
        """The live sequences' block tables, `(num_seqs, max_blocks)` int32, -1 past a table's end and where a
        window freed a block (a copy: editing it changes nothing)."""
        tables = list(self._tables.values())
        width = max((len(t) for t in tables), default=0)
        rows = [t + [-1] * (width - len(t)) for t in tables]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, num_kv_heads="
            f"{self.num_kv_heads}, d_head={self.d_head}, dtype={self.dtype}, device={self.device}, "
            f"sequences={len(self._tables)}, free_blocks={self.free_blocks}"
            + (f", window={self.window})" if self.window is not None else ")")
        )

    def _live(self, seq: Any, what: str) -> None:
        if seq not in self._tables:
            raise ConfigError(
                f"PagedKVCache.{what}(): {seq!r} is not a live sequence; the live ones are {list(self._tables)}."
            )

    def _release(self, block: int) -> None:
        self._owner_of.pop(block, None)
        self._owners_stale = True
        self._free.append(block)

    # --- what a failed call undoes ------------------------------------------------------------------

    def state(self) -> PagedState:
        """What `restore` needs to undo later calls (the tables and the free list; the pools are not copied:
        a failed call only writes slots that no sequence holds once it is undone)."""
        return (
            self.keys_pool,
            self.values_pool,
            {s: list(t) for s, t in self._tables.items()},
            dict(self._lengths),
            dict(self._owner_of),
            list(self._free),
            self._next,
        )

    def restore(self, state: PagedState) -> None:
        """Undo the calls since `state()`."""
        self.keys_pool, self.values_pool, tables, lengths, owner_of, free, self._next = state
        self._tables, self._lengths = {s: list(t) for s, t in tables.items()}, dict(lengths)
        self._owner_of, self._free = dict(owner_of), list(free)
        self._owners_stale = True

    def _step_state(self) -> tuple[Tensor, Tensor, dict[int, int], list[tuple[int, int]]]:
        """What `_undo_step` needs to undo one decoding step without a window (`decode_slots`, then
        `write_decoded`): the pools' tensors and the lengths, and, from now until `_undo_step` or
        `_end_step`, each block `reserve` hands out. Such a step changes the tables only by appending those blocks,
        so they are not copied, nor the free list or the owners (which `state()` copies: its cost grows with the
        pool's blocks, this one's with the live sequences).

        Raises:
            ConfigError: the cache keeps a window (its steps free blocks too: use `state()`).
        """
        if self.window is not None:
            raise ConfigError("PagedKVCache._step_state(): a cache with a window frees blocks as it decodes; use "
                              "state() and restore().")  # fmt: skip
        self._handed = []
        return self.keys_pool, self.values_pool, dict(self._lengths), self._handed

    def _undo_step(self, state: tuple[Tensor, Tensor, dict[int, int], list[tuple[int, int]]]) -> None:
        """Undo the decoding step since `_step_state()`: its lengths and pools, and its blocks, given back last
        first (each table's last block, the free list as it was)."""
        self.keys_pool, self.values_pool, lengths, handed = state
        self._lengths = dict(lengths)
        for seq, block in reversed(handed):
            self._tables[seq].pop()
            self._release(block)
        self._end_step()

    def _end_step(self) -> None:
        """The decoding step since `_step_state()` is over: `reserve` records no more."""
        self._handed = None

    # --- reading and writing ------------------------------------------------------------------------

    def first_kept(self, seq: int) -> int:
        """The first position of `seq` still held (0 without a window)."""
        if self.window is None:
            return 0
        table = self._tables[seq]
        dropped = next((i for i, block in enumerate(table) if block >= 0), len(table))
        return min(dropped * self.block_size, self._lengths[seq])

    def reserve(self, news: dict[int, int], owner: str) -> None:
        """Give each sequence the blocks its `news[seq]` new positions need, from the free list; all or none.

        Raises:
            ShapeError: the pool has fewer free blocks than the call needs (nothing is taken).
        """
        wanted = {
            seq: math.ceil((self._lengths[seq] + new) / self.block_size) - len(self._tables[seq])
            for seq, new in news.items()
        }
        needed = sum(max(0, n) for n in wanted.values())
        if needed > len(self._free):
            raise ShapeError(
                f"{owner}: the call's new positions need {needed} more blocks of block_size={self.block_size}, but "
                f"the PagedKVCache has {len(self._free)} free of num_blocks={self.num_blocks}; remove() finished "
                "sequences or make a larger cache."
            )
        for seq, n in wanted.items():
            for _ in range(n):
                block = self._free.pop()
                self._owner_of[block] = seq
                self._tables[seq].append(block)
                self._owners_stale = True
                if self._handed is not None:  # (a decoding step's undo point: `_step_state`)
                    self._handed.append((seq, block))

    def slots(self, seq: int, start: int, end: int) -> Tensor:
        """The pool slots (`block * block_size + offset`) of positions `start..end-1` of `seq`, int64."""
        table = torch.tensor(self._tables[seq], dtype=torch.int64)
        return self.locate(table[None], torch.arange(start, end)[None])[0]

    def locate(self, tables: Tensor, where: Tensor) -> Tensor:
        """The pool slots of positions `where` `(rows, n)` through block tables `tables` `(rows, width)`: position `p`
        is offset `p % block_size` of the table's block `p // block_size` (the one mapping every read and write)."""
        blocks = tables.gather(1, torch.div(where, self.block_size, rounding_mode="floor"))
        return blocks * self.block_size + where % self.block_size

    def check_slots(self, slots: Tensor, seqs: Tensor, owner: str) -> None:
        """`ShapeError` unless every slot is in the pool and in a block of the sequence it is read or written for.

        Arguments:
            slots: pool slots, int64, any shape. seqs: the sequence each is for, the same shape.
        """
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        outside = (blocks < 0) | (blocks >= self.num_blocks)
        if self._owners_stale:
            self._owners.fill_(-1)
            if self._owner_of:
                self._owners[torch.tensor(list(self._owner_of))] = torch.tensor(list(self._owner_of.values()))
            self._owners_stale = False
        owners = self._owners[blocks.clamp(0, self.num_blocks - 1)]
        if not bool((outside | (owners != seqs)).any()):  # (one test, one sync: this runs on every call)
            return
        if bool(outside.any()):
            i = int(outside.flatten().nonzero()[0])
            raise ShapeError(
                f"{owner}: the block table of sequence {int(seqs.flatten()[i])} points at block "
                f"{int(blocks.flatten()[i])}, outside the pool of num_blocks={self.num_blocks}; a block table must "
                "hold blocks the PagedKVCache gave the sequence (reserve/add), never computed ones."
            )
        i = int((owners != seqs).flatten().nonzero()[0])
        block, seq, holder = int(blocks.flatten()[i]), int(seqs.flatten()[i]), int(owners.flatten()[i])
        held = "is free" if holder < 0 else f"belongs to sequence {holder}"
        raise ShapeError(
            f"{owner}: the block table of sequence {seq} points at block {block}, which {held}; reading it would "
            f"gather another sequence's keys (block_size={self.block_size}, slot {int(slots.flatten()[i])})."
        )

    def write(self, seq: int, k: Tensor, v: Tensor, owner: str) -> tuple[Tensor, Tensor]:
        """Write `k, v` `(1, num_kv_heads, new, d_head)` after `seq`'s positions; return its held keys and values,
        `(1, num_kv_heads, held, d_head)` (gathered from its blocks: a copy of the keys attended, not of the pool)."""
        new = k.shape[2]
        self.reserve({seq: new}, owner)
        length = self._lengths[seq]
        written = self.slots(seq, length, length + new)
        read = self.slots(seq, self.first_kept(seq), length + new)
        self.check_slots(torch.cat((written, read)), torch.full((new + read.numel(),), seq), owner)
        written, read = written.to(self.device), read.to(self.device)
        self._scatter(written, k[0], v[0])
        self._lengths[seq] = length + new
        keys, values = self._gather(read)
        self._slide(seq)
        return keys[None], values[None]

    def decode_slots(self, owner: str) -> tuple[Tensor, Tensor, Tensor]:
        """Prepare one new position of every live sequence (a decoding step): reserve the blocks it needs; return the
        positions the new tokens take `(num_seqs, 1)`, the pool slots each sequence attends to, right-aligned, its
        new one last, `(num_seqs, held)` int64 (a shorter sequence's padding reads its own first held slot), and the
        padding on their left `(num_seqs, held)` bool (True = padding).

        The slots are read from each sequence's slot map (`_Decoding`), kept between steps and checked where a block
        table changes (a block appended is checked to be in the pool and the sequence's; any other change, a join or
        a leave rebuilds the map through `locate` and checks every slot with `check_slots`), so a step makes no
        tensor from Python lists, checks nothing on the device and waits for no value from it. Without a window,
        where each sequence's right-aligned slots sit in its map, the padding and the positions are columns of
        buffers made when the lengths are not those of a step the buffers cover (a join, a leave, a prefill): a
        step slices them and reads its slots from the map as the map is now (one gather), so a step undone (a
        restore, blocks given back and others handed out) reads the blocks its redo holds.

        Raises:
            ShapeError: the pool has too few free blocks, or a block table points outside the pool or at a block
                the sequence does not hold.
        """
        seqs, lengths, tables, size = self.sequences, self._lengths, self._tables, self.block_size
        needs = {seq: 1 for seq in seqs if lengths[seq] == len(tables[seq]) * size}
        if needs:  # (a new block every block_size steps of a sequence)
            self.reserve(needs, owner)
        state = self._synced(seqs, owner)
        now = [lengths[seq] for seq in seqs]
        if self.window is not None:
            firsts = [self.first_kept(seq) for seq in seqs]
            held = max(n + 1 - f for n, f in zip(now, firsts, strict=True))
            column = torch.tensor(now, device=self.device)[:, None]
            where = torch.arange(held, device=self.device)[None] + (column + (1 - held))
            first = torch.tensor(firsts, device=self.device)[:, None]
            return column, state.slots.gather(1, torch.maximum(where, first)), where < first
        step = now[0] - state.base[0] if state.base else -1
        if step < 0 or step >= state.room or now != [n + step for n in state.base]:
            state.aligned(now)  # (the lengths are not the buffers' plus some steps: made again)
            step = 0
        held = state.held + step
        read = state.slots.gather(1, state.where[:, :held])  # (the map as it is now: blocks appended since included)
        return state.positions[:, step : step + 1], read, state.padding[:, :held]

    def write_decoded(self, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write one new position of each live sequence, `k, v` `(num_seqs, num_kv_heads, 1, d_head)`, at the last of
        its `slots` `(num_seqs, held)` (from `decode_slots`); return the keys and values at `slots`, `(num_seqs,
        num_kv_heads, held, d_head)` (one gather each: the keys attended, not the pool)."""
        seqs, lengths = self.sequences, self._lengths
        keys_flat, values_flat = self._flat()
        new = slots[:, -1]
        if (
            k.dtype != self.dtype
            or self.keys_pool.requires_grad
            or self.values_pool.requires_grad
            or (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))
        ):
            self._scatter(new, k[:, :, 0].transpose(0, 1), v[:, :, 0].transpose(0, 1))
            keys_flat, values_flat = self._flat()
        else:  # in place, one row a sequence (the flat pools' rows are `(num_kv_heads, 1, d_head)`, as k's are)
            keys_flat.index_copy_(0, new, k)
            if self.values_pool is not self.keys_pool:  # (a shared pool: one write)
                values_flat.index_copy_(0, new, v)
        for seq in seqs:
            lengths[seq] += 1
        # read sequence by sequence: each one's keys a run of rows, as SDPA reads them
        where, shape = slots.reshape(-1), (len(seqs), slots.shape[1], self.num_kv_heads, self.d_head)
        keys = keys_flat.index_select(0, where).view(shape).transpose(1, 2)
        shared = self.values_pool is self.keys_pool  # (a latent cache: its entries are its keys and values)
        values = keys if shared else values_flat.index_select(0, where).view(shape).transpose(1, 2)
        if self.window is not None:
            for seq in seqs:
                self._slide(seq)
        return keys, values

    def _flat(self) -> tuple[Tensor, Tensor]:
        """The pools as `(num_blocks * block_size, num_kv_heads, 1, d_head)` views, a slot a row shaped as one new
        position's keys are (made once per pool)."""
        kept = self._flats
        if kept[0] is not self.keys_pool or kept[1] is not self.values_pool:
            flat = (self.num_blocks * self.block_size, self.num_kv_heads, 1, self.d_head)
            keys, values = self.keys_pool, self.values_pool
            kept = self._flats = (keys, values, keys.view(flat), values.view(flat))
        return kept[2], kept[3]

    def _synced(self, seqs: tuple[int, ...], owner: str) -> "_Decoding":
        """The decoding slot maps of `seqs`, brought up to date with their block tables (see `decode_slots`)."""
        state = self._decoding
        if state is None or state.seqs != seqs or state.locate is not type(self).locate:
            return self._rebuilt(seqs, owner)
        size, width = self.block_size, state.slots.shape[1] // self.block_size
        for i, seq in enumerate(seqs):
            table, seen = self._tables[seq], state.rows[i]
            if table == seen:
                continue
            dropped = next((j for j, block in enumerate(table) if block >= 0), len(table)) if self.window else 0
            common = min(len(table), len(seen))
            if len(table) > width or table[dropped:common] != seen[dropped:common]:
                return self._rebuilt(seqs, owner)  # not a block appended or freed by the window: every slot again
            for j in range(common, len(table)):  # appended blocks (reserve's): each checked, its slots written
                block = table[j]
                if not 0 <= block < self.num_blocks or self._owner_of.get(block) != seq:
                    return self._rebuilt(seqs, owner)  # (which raises, naming the block)
                state.slots[i, j * size : (j + 1) * size] = state.offsets + block * size
            state.rows[i] = list(table)
        return state

    def _rebuilt(self, seqs: tuple[int, ...], owner: str) -> "_Decoding":
        """The slot maps of `seqs` made again through `locate`, every slot a step can read checked."""
        self._decoding = None
        size = self.block_size
        rows = [list(self._tables[seq]) for seq in seqs]
        width = max(len(row) for row in rows) + 4  # room to grow: a block appended needs no new map
        tables = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int64).reshape(-1, width)
        where = torch.arange(width * size)[None].expand(len(rows), -1)
        slots = self.locate(tables, where)
        firsts = torch.tensor([self.first_kept(seq) if self.window else 0 for seq in seqs])
        ends = torch.tensor([len(row) * size for row in rows])
        read = (where >= firsts[:, None]) & (where < ends[:, None])
        ids = torch.tensor(seqs, dtype=torch.int64)[:, None].expand_as(slots)
        self.check_slots(slots[read], ids[read], owner)
        slots = torch.where(read, slots, 0).to(self.device)  # (slots before a row's first or past its end: never read)
        self._decoding = _Decoding(seqs, type(self).locate, rows, slots, torch.arange(size, device=self.device))
        return self._decoding

    def _scatter(self, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Write `k, v` `(num_kv_heads, n, d_head)` into `slots` `(n,)` of the pools, in place."""
        flat = (self.num_blocks * self.block_size, self.num_kv_heads, self.d_head)
        k, v = k.transpose(0, 1).to(self.dtype), v.transpose(0, 1).to(self.dtype)
        tracked = (
            self.keys_pool.requires_grad
            or self.values_pool.requires_grad
            or (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))
        )
        if tracked:  # out of place, as KVCache does: earlier steps' graphs keep the pools they read
            shared = self.values_pool is self.keys_pool
            self.keys_pool = self.keys_pool.view(flat).index_copy(0, slots, k).view(self.keys_pool.shape)
            if shared:
                self.values_pool = self.keys_pool
            else:
                self.values_pool = self.values_pool.view(flat).index_copy(0, slots, v).view(self.values_pool.shape)
            return
        self.keys_pool.view(flat).index_copy_(0, slots, k)
        self.values_pool.view(flat).index_copy_(0, slots, v)

    def _gather(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values at `slots` `(n,)`, as `(num_kv_heads, n, d_head)` views of one gather each."""
        flat = (self.num_blocks * self.block_size, self.num_kv_heads, self.d_head)
        keys = self.keys_pool.view(flat).index_select(0, slots)
        values = self.values_pool.view(flat).index_select(0, slots)
        return keys.transpose(0, 1), values.transpose(0, 1)

    def _slide(self, seq: int) -> None:
        """With a window: free `seq`'s blocks that no later query can see (all before `length - window + 1`)."""
        if self.window is None:
            return
        visible = self._lengths[seq] - self.window + 1  # the first position the next query can see
        table = self._tables[seq]
        for i in range(max(0, visible) // self.block_size):
            if table[i] >= 0:
                self._release(table[i])
                table[i] = -1


def _witness(cache: PagedKVCache, batch: int, held: int) -> Tensor:
    """A `(batch, num_kv_heads, held, d_head)` tensor of the pool's dtype and device that holds no memory: what the
    module's cache stage checks, the sizes of the keys a view holds (read only when the call writes)."""
    return cache._zero.expand(batch, cache.num_kv_heads, held, cache.d_head)


class SequenceView(KVCache):
    """One sequence of a `PagedKVCache`, as the module's cache stage reads and writes a `KVCache`."""

    def __init__(self, cache: PagedKVCache, seq: int, owner: str) -> None:
        self.paged, self.seq, self.owner = cache, seq, owner
        first = cache.first_kept(seq)
        self.window = None  # the paged cache keeps its window; the keys it returns are right-aligned, the module's
        self._start, self._length = first, cache._lengths[seq] - first  # window mask applies as with a KVCache
        self.keys_buffer = self.values_buffer = _witness(cache, 1, self._length)
        self._verdicts = Verdicts()

    def write(self, k: Tensor, v: Tensor, owner: str | None = None) -> tuple[Tensor, Tensor]:
        return self.paged.write(self.seq, k, v, self.owner)

    def state(self) -> Any:
        return self.paged.state()

    def restore(self, state: Any) -> None:
        self.paged.restore(state)


class _Decoding:
    """What the decoding steps of one set of sequences reuse: each one's pool slot by position `(num_seqs, width *
    block_size)` (checked: see `PagedKVCache.decode_slots`) and the block tables it was made from; without a window,
    for the next `room` steps from the lengths `base`, where each sequence's right-aligned slots sit in its map
    `(num_seqs, held + room)` (clamped into it), their padding, the same shape, and the new tokens' positions
    `(num_seqs, room)`: step `s` reads the first `held + s` columns of the first two and column `s` of the third."""

    def __init__(
        self, seqs: tuple[int, ...], locate: Any, rows: list[list[int]], slots: Tensor, offsets: Tensor
    ) -> None:
        self.seqs, self.locate, self.rows, self.slots, self.offsets = seqs, locate, rows, slots, offsets
        self.base: list[int] = []
        self.room = self.held = 0
        self.where = self.padding = self.positions = slots[:0]

    def aligned(self, lengths: list[int], room: int = 64) -> None:
        """The buffers for the steps from `lengths` on (see the class). Step `s` holds `held + s` keys of a sequence
        of length `n + s`, so its column `j` is position `n + s + 1 - (held + s) + j = n + 1 - held + j`, the same
        for every step: the buffers are made once and sliced."""
        device = self.slots.device
        held = max(lengths) + 1
        column = torch.tensor(lengths, device=device)[:, None]
        where = torch.arange(held + room, device=device)[None] + (column + (1 - held))
        self.padding = where < 0
        # (padding reads the sequence's position 0; columns past the map, read by no step the map serves, its last)
        self.where = where.clamp(0, self.slots.shape[1] - 1)
        self.positions = column + torch.arange(room, device=device)[None]
        self.base, self.room, self.held = lengths, room, held


class DecodeView(KVCache):
    """One new position of every live sequence of a `PagedKVCache`, as one batch: held keys right-aligned, the
    shorter sequences padded on the left (`padding`, which the call passes as its `key_padding_mask`, and
    `positions`, the new tokens' positions)."""

    def __init__(self, cache: PagedKVCache, owner: str) -> None:
        self.paged, self.owner, self.seqs = cache, owner, cache.sequences
        self.positions, self.slots, self.padding = cache.decode_slots(owner)
        self.window = None
        self._start, self._length = 0, self.slots.shape[1] - 1
        self.keys_buffer = self.values_buffer = _witness(cache, len(self.seqs), self._length)
        self._verdicts = Verdicts()

    def write(self, k: Tensor, v: Tensor, owner: str | None = None) -> tuple[Tensor, Tensor]:
        return self.paged.write_decoded(self.slots, k, v)

    def state(self) -> Any:
        # what the write changes (the blocks were reserved before the module's forward): the lengths and, under
        # autograd, the pools' tensors; with a window, also the tables (blocks it frees)
        paged = self.paged
        if paged.window is not None:
            return paged.state()
        return paged.keys_pool, paged.values_pool, dict(paged._lengths)

    def restore(self, state: Any) -> None:
        paged = self.paged
        if paged.window is not None:
            paged.restore(state)
        else:
            paged.keys_pool, paged.values_pool, lengths = state
            paged._lengths = dict(lengths)
