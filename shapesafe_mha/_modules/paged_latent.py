"""A `PagedKVCache` as `LatentAttention`'s cache stage reads and writes a `LatentCache`: one sequence (a prefill or
a chunk), or one new position of every sequence at once (decoding)."""

from typing import Any

import torch
from torch import Tensor

from .._compute.paged import DecodeView, PagedKVCache
from .latent import LatentCache


class PagedLatentView(LatentCache):
    """Sequence `seq` of a shared-pool `PagedKVCache` (`PagedKVCache.for_module(latent_attention, ...)`): each
    position's entry (its latent, then its rotary key) in a block of the pool. `write` appends the new entries
    and gathers the sequence's held ones, which the module then reads as it reads a `LatentCache`'s buffer."""

    def __init__(self, cache: PagedKVCache, seq: int, owner: str, kv_lora_rank: int) -> None:
        self.paged, self.seq, self.owner, self.kv_lora_rank = cache, seq, owner, kv_lora_rank
        held = cache.length(seq)
        self.buffer = cache.keys_pool.new_zeros(()).expand(1, held, cache.d_head)  # (its sizes; holds no memory)
        self._length = held

    def write(self, latent: Tensor, k_rope: Tensor, owner: str) -> tuple[Tensor, Tensor]:
        # each new position's entry, its latent and rotary key, as keys of one head: (1, 1, new, kv_lora_rank + d_rope)
        entries = torch.cat((latent, k_rope[:, 0].to(latent.dtype)), dim=-1)[:, None]
        keys, _ = self.paged.write(self.seq, entries, entries, self.owner)
        self.buffer, self._length = keys[:, 0], keys.shape[2]
        return self.latent(), self.rope_keys()

    def state(self) -> Any:
        return self.paged.state()

    def restore(self, state: Any) -> None:
        self.paged.restore(state)


class PagedLatentDecodeView(LatentCache):
    """One new position of every live sequence of a shared-pool `PagedKVCache`, as one batch (`DecodeView`'s slots):
    the held entries right-aligned, the shorter sequences padded on the left (`padding`, the call's
    `key_padding_mask`; `positions`, the new tokens' positions)."""

    def __init__(self, cache: PagedKVCache, owner: str, kv_lora_rank: int) -> None:
        self.decode, self.kv_lora_rank = DecodeView(cache, owner), kv_lora_rank
        self.positions, self.padding = self.decode.positions, self.decode.padding
        held = self.decode.slots.shape[1] - 1
        self.buffer = cache._zero.expand(len(self.decode.seqs), held, cache.d_head)  # (sizes only)
        self._length = held

    def write(self, latent: Tensor, k_rope: Tensor, owner: str) -> tuple[Tensor, Tensor]:
        # each sequence's new entry as keys of one head: (num_seqs, 1, 1, kv_lora_rank + d_rope)
        entries = torch.cat((latent, k_rope[:, 0].to(latent.dtype)), dim=-1)[:, None]
        keys, _ = self.decode.write(entries, entries)
        self.buffer, self._length = keys[:, 0], keys.shape[2]
        return self.latent(), self.rope_keys()

    def state(self) -> Any:
        return self.decode.state()

    def restore(self, state: Any) -> None:
        self.decode.restore(state)


def latent_view(module: Any) -> Any:
    """The `view` factory `serving_forward` takes, for `module` (a `LatentAttention`)."""
    return lambda cache, seq, owner: PagedLatentView(cache, seq, owner, module.kv_lora_rank)


def latent_decode(module: Any) -> Any:
    """The `decode` factory `serving_forward` takes, for `module` (a `LatentAttention`)."""
    return lambda cache, owner: PagedLatentDecodeView(cache, owner, module.kv_lora_rank)
