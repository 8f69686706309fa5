"""The conversions of a `MultiHeadAttention` to and from torch's and transformers' layers and bare weights.

Each builds the other side, then verifies it against this one on a float64 probe: a conversion is checked, never
trusted. The implementations live beside (`torch_nn`, `hf`); this is their public door on the module.
"""

from collections.abc import Mapping
from typing import Any, Self

from torch import nn

from .._core.weights import AttentionWeights


class Conversions:
    """`from_weights`, `from_torch`, `from_hf`, `to_hf`, `to_torch` of `MultiHeadAttention`."""

    @classmethod
    def from_weights(
        cls,
        weights: AttentionWeights,
        *,
        num_heads: int,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        rope_theta: float | None = None,
        rope_scaling: Mapping[str, Any] | None = None,
        verify: bool = True,
    ) -> Self:
        """A module holding copies of `weights` (on their device, in their dtype), each bias as given.

        Verified on a float64 probe against `reference.per_head_attention` with the same weights
        (`verify=False` skips it; `meta` weights are not probed).

        Example:
            >>> import torch, shapesafe_mha as ssm
            >>> a = ssm.MultiHeadAttention(16, num_heads=4, num_kv_heads=2)
            >>> b = ssm.MultiHeadAttention.from_weights(a.weights(), num_heads=4, num_kv_heads=2)
            >>> x = torch.randn(1, 3, 16)
            >>> torch.equal(a(x), b(x))
            True

        Raises:
            ConfigError, ShapeError: the weights do not fit the head counts, or are not floating point.
        """
        from .._interop.torch_nn import from_weights

        return from_weights(
            cls,
            weights,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            dropout=dropout,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            verify=verify,
        )

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> Self:
        """A `MultiHeadAttention` computing what a batch-first `module` computes.

        Masks translate as: our bool `attn_mask` is True where attending is allowed, torch's
        module's is True where it is *forbidden*, so pass `~their_mask`; `key_padding_mask` means
        the same in both (True = padding).

        Example:
            >>> import torch, shapesafe_mha as ssm
            >>> theirs = torch.nn.MultiheadAttention(32, 4, batch_first=True)
            >>> ours = ssm.MultiHeadAttention.from_torch(theirs)
            >>> x = torch.randn(2, 5, 32)
            >>> bool(torch.allclose(ours(x), theirs(x, x, x, need_weights=False)[0], atol=1e-6))
            True

        Raises:
            ConfigError: `module` is not batch-first (the message says how to convert), or uses
                features without an equivalent here (`kdim`/`vdim`, `add_bias_kv`, `add_zero_attn`).
        """
        from .._interop.torch_nn import from_torch

        return from_torch(cls, module)

    @classmethod
    def from_hf(cls, attention: nn.Module, *, config: Any = None, verify: bool = True) -> Self:
        """A `MultiHeadAttention` computing what a transformers attention layer computes (causal, with RoPE).

        For layers in the q/k/v/o_proj layout (Llama, Mistral, Qwen2/3, Gemma 2 and alike; Phi's `dense` as
        o_proj; GPT-NeoX's per-head fused `query_key_value` and Phi-3's stacked `qkv_proj` as q/k/v_proj),
        configured by `attention.config`: sizes, GQA, biases per projection, dropout, RoPE (default, llama3, YaRN,
        dynamic or LongRoPE scaling; tables computed as
        transformers computes them; partial rotary from `partial_rotary_factor`, interleaved pairs read
        from the model's own rotary parts), and the variants: sliding window, QK-norm, logit softcapping,
        `query_pre_attn_scalar` (QK-norm: per head, over every head, `1 + weight`, Cohere's LayerNorm of each
        head); ALiBi (Bloom's per-head fused `query_key_value`, MPT's `Wqkv`), with the slopes
        their model passes them, read from transformers' own `build_alibi_tensor` / `build_mpt_alibi_tensor`.
        Bloom's and MPT's layers keep no config: pass their model's, `from_hf(layer, config=model.config)`.
        Call it `is_causal=True`; positions
        default to `len(kv_cache) + arange(seq)`, and decoding uses our `KVCache` (windowed where
        the layer is). Multi-head latent attention (DeepSeek) loads with `LatentAttention.from_hf`.

        The result is verified, not trusted: both layers run a causal forward and a decoding step on
        a small float64 probe (the layer as its model calls it: its rotary class, its mask function, a
        `DynamicCache`), and a layer that computes something else is refused, naming the difference.
        `verify=False` skips the probe (layers on `meta`, which hold no values, are not probed).

        Example:
            >>> import torch, shapesafe_mha as ssm
            >>> from transformers import LlamaConfig
            >>> from transformers.models.llama.modeling_llama import LlamaAttention
            >>> config = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2)
            >>> ours = ssm.MultiHeadAttention.from_hf(LlamaAttention(config, layer_idx=0))
            >>> ours
            MultiHeadAttention(
              d_model=64, num_heads=8, num_kv_heads=2, d_head=8, dropout=0.0, rope_theta=10000.0
              ...

        Raises:
            ConfigError: a variant computed differently here (another RoPE scaling, a QK-norm other
                than those above, latent attention), named by its config field or the submodule; or the
                converted layer differs from `attention` on the probe.
        """
        from .._interop.hf import from_hf

        return from_hf(cls, attention, config=config, verify=verify)

    def to_hf(self, config: Any, *, verify: bool = True) -> nn.Module:
        """The transformers attention layer for `config` (a LlamaConfig, Qwen2Config, ...), with these weights.

        Verified as `from_hf` is: the layer, called as its model calls it, against this module on a
        float64 probe (`verify=False` skips it).

        Raises:
            ConfigError: `config` describes other sizes, biases, RoPE (theta or scaling), dropout or
                variants than this module, or its model type has no such attention class, or the
                layer differs from this module on the probe.
        """
        from .._interop.hf import to_hf

        return to_hf(self, config, verify=verify)

    def to_torch(self, *, verify: bool = True) -> nn.MultiheadAttention:
        """An equivalent `nn.MultiheadAttention(batch_first=True)`; MHA with `num_heads*d_head == d_model` only.

        Biases on some projections only become zero biases there (it has all or none). Verified on a
        float64 probe (`verify=False` skips it).

        Raises:
            ConfigError: the configuration has no `nn.MultiheadAttention` equivalent (GQA/MQA,
                `num_heads * d_head != d_model`, or a variant: RoPE, QK-norm, a window, softcapping,
                `query_pre_attn_scalar`, sinks, ALiBi), named.
        """
        from .._interop.torch_nn import to_torch

        return to_torch(self, verify=verify)
