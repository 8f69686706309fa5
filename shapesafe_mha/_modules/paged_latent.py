"""One sequence of a `PagedKVCache` as `LatentAttention`'s cache stage reads and writes a `LatentCache`."""

from typing import Any

import torch
from torch import Tensor

from .._compute.paged import PagedKVCache
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


def latent_view(module: Any) -> Any:
    """The `view` factory `serving_forward` takes, for `module` (a `LatentAttention`)."""
    return lambda cache, seq, owner: PagedLatentView(cache, seq, owner, module.kv_lora_rank)
