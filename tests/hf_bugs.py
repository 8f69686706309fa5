"""Bugs planted in real transformers attention classes, each with the property that must catch it.

Each bug is a subclass of the real class or a patch of one function of its modeling module (undone
on exit), as a mistake in that code would be. `tests/test_hf_attention.py` checks that each is caught
and named; `python -m benchmarks.toolkit_reports` times them.
"""

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config
from transformers.models.gpt2 import modeling_gpt2
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.phi3.modeling_phi3 import Phi3Attention
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

# The unchanged classes, each with its config class.
REAL: list[tuple[type[nn.Module], type]] = [
    (LlamaAttention, LlamaConfig),
    (Qwen2Attention, Qwen2Config),
    (MistralAttention, MistralConfig),
    (GPT2Attention, GPT2Config),
    (Phi3Attention, Phi3Config),  # one fused qkv_proj nn.Linear
]


@contextlib.contextmanager
def _patched(module: Any, name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, replacement(original))
    try:
        yield
    finally:
        setattr(module, name, original)


def _tiled_repeat_kv(_: Callable[..., Any]) -> Callable[..., Any]:
    def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
        return hidden_states.repeat(1, n_rep, 1, 1)  # the bug: repeat where repeat_interleave was meant

    return repeat_kv


def _rotate_half_wrong_sign(_: Callable[..., Any]) -> Callable[..., Any]:
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((x2, -x1), dim=-1)  # the bug: (-x2, x1) was meant

    return rotate_half


def _positions_restart(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
        return original(self, x, position_ids - position_ids[:, :1])  # the bug: every call counts from 0

    return forward


def _own_causal_mask(shift: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An attention function that builds its own causal mask (ignoring the one it is given), off by `shift`."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def attention(
            module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kw: Any
        ) -> Any:
            q, k = query.shape[-2], key.shape[-2]
            allowed = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(k - q + shift)
            own = torch.zeros(q, k, dtype=query.dtype, device=query.device).masked_fill(~allowed, -math.inf)
            return original(module, query, key, value, own, **kw)

        return attention

    return wrap


def _swap_k_v(original: Callable[..., Any]) -> Callable[..., Any]:
    def attention(
        module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any, **kw: Any
    ) -> Any:
        return original(module, query, value, key, *a, **kw)

    return attention


def _unscaled(original: Callable[..., Any]) -> Callable[..., Any]:
    def attention(*a: Any, **kw: Any) -> Any:
        return original(*a, **{**kw, "scaling": 1.0})  # the bug: scores not divided by sqrt(head_dim)

    return attention


class ScaledByHiddenSize(LlamaAttention):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.scaling = config.hidden_size**-0.5  # the bug: 1/sqrt(d_model) where 1/sqrt(head_dim) was meant


class CacheAppendedTwice(LlamaAttention):
    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Any,
        attention_mask: Any = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> Any:
        if cache is not None:
            update = cache.update

            def twice(*a: Any, **kw: Any) -> Any:
                update(*a, **kw)  # the bug: the new keys and values are appended twice
                return update(*a, **kw)

            cache.update = twice
        try:
            return super().forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        finally:
            if cache is not None:
                del cache.update


class RopeAfterCache(LlamaAttention):
    """Llama's forward with RoPE applied after the cache update: cached keys get the new token's angle."""

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Any,
        attention_mask: Any = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> Any:
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        cos, sin = position_embeddings
        q, k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)  # the bug: after the update, on every key
        out, weights = modeling_llama.eager_attention_forward(self, q, k, v, attention_mask, scaling=self.scaling)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights


@dataclass(frozen=True)
class Bug:
    """A planted bug: the class (with its config class) and patch, and the property that must catch it."""

    name: str
    attention_cls: type[nn.Module]
    config_cls: type
    patch: Callable[[], contextlib.AbstractContextManager[Any]]
    prop: str  # the property named first in the report: heads, RoPE/positions, padding/mask, decoding/cache
    named: str | None  # a phrase of the bug class line, where a variant of the reference matches


def _none() -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


BUGS = [
    Bug("repeat_kv tiles (repeat, not repeat_interleave)", LlamaAttention, LlamaConfig,
        lambda: _patched(modeling_llama, "repeat_kv", _tiled_repeat_kv), "heads", "KV heads tiled"),
    Bug("rotate_half with the wrong sign", LlamaAttention, LlamaConfig,
        lambda: _patched(modeling_llama, "rotate_half", _rotate_half_wrong_sign), "RoPE/positions", "wrong way"),
    Bug("causal mask off by one (each query sees the next key)", LlamaAttention, LlamaConfig,
        lambda: _patched(modeling_llama, "eager_attention_forward", _own_causal_mask(1)), "heads", "sees the next key"),
    Bug("scale 1/sqrt(hidden_size)", ScaledByHiddenSize, LlamaConfig, _none, "heads", "1/sqrt(d_model)"),
    Bug("k and v swapped", LlamaAttention, LlamaConfig,
        lambda: _patched(modeling_llama, "eager_attention_forward", _swap_k_v), "heads", "k and v swapped"),
    Bug("padding mask ignored (a causal mask of its own)", LlamaAttention, LlamaConfig,
        lambda: _patched(modeling_llama, "eager_attention_forward", _own_causal_mask(0)),
        "padding/mask", "padding ignored"),
    Bug("cache appended twice", CacheAppendedTwice, LlamaConfig, _none, "decoding/cache", None),
    Bug("RoPE applied after the cache update", RopeAfterCache, LlamaConfig, _none, "decoding/cache", None),
    Bug("rotary positions restart at 0 on every call", LlamaAttention, LlamaConfig,
        lambda: _patched(LlamaRotaryEmbedding, "forward", _positions_restart), "decoding/cache", None),
    Bug("Qwen2: rotate_half with the wrong sign", Qwen2Attention, Qwen2Config,
        lambda: _patched(modeling_qwen2, "rotate_half", _rotate_half_wrong_sign), "RoPE/positions", "wrong way"),
    Bug("GPT-2: scores not scaled", GPT2Attention, GPT2Config,
        lambda: _patched(modeling_gpt2, "eager_attention_forward", _unscaled), "heads", "not scaled"),
]  # fmt: skip
