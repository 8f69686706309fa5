"""Bugs planted in the variants check_hf_attention computes, each in a real transformers class.

One per variant: a patch of one function of the class's modeling module, or a subclass whose forward has
the mistake, as a mistake in that code would be. `tests/test_hf_variants_check.py` checks that each is
caught with the property named.
"""

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import (
    BitNetConfig,
    BloomConfig,
    CodeGenConfig,
    CohereConfig,
    Gemma2Config,
    GPTJConfig,
    GPTNeoXConfig,
    GptOssConfig,
    GraniteConfig,
    HunYuanDenseV1Config,
    Llama4TextConfig,
    MistralConfig,
    MptConfig,
    Olmo2Config,
    PersimmonConfig,
    PhiConfig,
    Qwen3Config,
    Qwen3NextConfig,
    masking_utils,
)
from transformers.models.bitnet import modeling_bitnet
from transformers.models.bitnet.modeling_bitnet import BitNetAttention
from transformers.models.bloom import modeling_bloom
from transformers.models.bloom.modeling_bloom import BloomAttention
from transformers.models.codegen import modeling_codegen
from transformers.models.codegen.modeling_codegen import CodeGenAttention
from transformers.models.cohere import modeling_cohere
from transformers.models.cohere.modeling_cohere import CohereAttention
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention
from transformers.models.gpt_neox import modeling_gpt_neox
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention
from transformers.models.gptj import modeling_gptj
from transformers.models.gptj.modeling_gptj import GPTJAttention
from transformers.models.granite.modeling_granite import GraniteAttention
from transformers.models.hunyuan_v1_dense import modeling_hunyuan_v1_dense as modeling_hunyuan
from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1Attention
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import rotate_half as llama_rotate_half
from transformers.models.llama4 import modeling_llama4
from transformers.models.llama4.modeling_llama4 import Llama4TextAttention
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.mpt import modeling_mpt
from transformers.models.mpt.modeling_mpt import MptAttention
from transformers.models.olmo2 import modeling_olmo2
from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention
from transformers.models.persimmon import modeling_persimmon
from transformers.models.persimmon.modeling_persimmon import PersimmonAttention
from transformers.models.phi.modeling_phi import PhiAttention, PhiRotaryEmbedding
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention
from transformers.models.qwen3_next import modeling_qwen3_next
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention


@contextlib.contextmanager
def _patched(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _attend(module: nn.Module, modeling: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
            **kwargs: Any) -> torch.Tensor:  # fmt: skip
    out, _ = modeling.eager_attention_forward(module, q, k, v, mask, scaling=module.scaling, **kwargs)
    return out.reshape(*q.shape[:1], q.shape[2], -1)


class Qwen3NextGateDropped(Qwen3NextAttention):
    """Output gate: the merged heads projected as they are, the gate computed from q_proj and then left out."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any, attention_mask: Any = None,  # type: ignore[override]
                cache: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, _gate = torch.chunk(self.q_proj(hidden_states).view(*hidden_states.shape[:-1], -1, 2 * self.head_dim), 2, -1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = modeling_qwen3_next.apply_rotary_pos_emb(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        return self.o_proj(_attend(self, modeling_qwen3_next, q, k, v, attention_mask)), None  # the bug: no gate


class Qwen3NormAfterRope(Qwen3Attention):
    """QK-norm: the norm applied after RoPE, where Qwen3 applies it before."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any, attention_mask: Any = None,  # type: ignore[override]
                cache: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = modeling_qwen3.apply_rotary_pos_emb(q, k, *position_embeddings)
        q, k = self.q_norm(q), self.k_norm(k)  # the bug: after the rotation
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        return self.o_proj(_attend(self, modeling_qwen3, q, k, v, attention_mask)), None


class HunYuanNormBeforeRope(HunYuanDenseV1Attention):
    """QK-norm after RoPE (HunYuan's query_layernorm/key_layernorm): the norm applied before the rotation."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any, attention_mask: Any = None,  # type: ignore[override]
                cache: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.query_layernorm(self.q_proj(hidden_states).view(shape).transpose(1, 2))  # the bug: before RoPE
        k = self.key_layernorm(self.k_proj(hidden_states).view(shape).transpose(1, 2))
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = modeling_hunyuan.apply_rotary_pos_emb(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        return self.o_proj(_attend(self, modeling_hunyuan, q, k, v, attention_mask)), None


class PersimmonKeysNormedAsQueries(PersimmonAttention):
    """A LayerNorm of each head (Persimmon's q_layernorm/k_layernorm): the keys normalised with the queries' norm."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, position_ids: Any = None,  # type: ignore[override]
                cache: Any = None, output_attentions: bool = False, use_cache: bool = False,
                position_embeddings: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        q, k, v = self._split_heads(self.query_key_value(hidden_states))
        q, k = self.q_layernorm(q), self.q_layernorm(k)  # the bug: self.k_layernorm was meant for the keys
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        r = self.rotary_ndims
        q_rot, k_rot = modeling_persimmon.apply_rotary_pos_emb(q[..., :r], k[..., :r], *position_embeddings)
        q, k = torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        return self.dense(_attend(self, modeling_persimmon, q, k, v, attention_mask)), None


class BitNetSubNormSkipped(BitNetAttention):
    """BitNet's attn_sub_norm of the merged heads left out before the output projection."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any, attention_mask: Any = None,  # type: ignore[override]
                cache: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = modeling_bitnet.apply_rotary_pos_emb(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        return self.o_proj(_attend(self, modeling_bitnet, q, k, v, attention_mask)), None  # the bug: no sub-norm


class Olmo2KeysUnnormed(Olmo2Attention):
    """QK-norm over every head: the keys' norm left out."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any, attention_mask: Any = None,  # type: ignore[override]
                cache: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states)).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)  # the bug: self.k_norm not applied
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = modeling_olmo2.apply_rotary_pos_emb(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        return self.o_proj(_attend(self, modeling_olmo2, q, k, v, attention_mask)), None


class CohereQKNormConfig(CohereConfig):
    """CohereConfig with `use_qk_norm=True` by default: the check builds a class from its config class's defaults."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("use_qk_norm", True)
        super().__init__(**kwargs)


class _CohereNormed(CohereAttention):
    """Cohere's forward with `use_qk_norm`, its norms computed by `_norms` (the bugs below replace it)."""

    def _norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any, attention_mask: Any = None,  # type: ignore[override]
                cache: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k = self._norms(self.q_proj(hidden_states).view(shape), self.k_proj(hidden_states).view(shape))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = modeling_cohere.apply_rotary_pos_emb(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        return self.o_proj(_attend(self, modeling_cohere, q, k, v, attention_mask)), None


class CohereKeysUnnormed(_CohereNormed):
    """Cohere's QK-norm of each head: the keys' norm left out."""

    def _norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), k  # the bug: self.k_norm not applied


class CohereNormNotCentred(_CohereNormed):
    """Cohere's QK-norm of each head computed as an RMSNorm with its weights: each head's mean not subtracted."""

    def _norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # the bug: x - mean(x) was meant
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.q_norm.variance_epsilon) * weight

        return rms(q, self.q_norm.weight), rms(k, self.k_norm.weight)


class GraniteMultiplierIgnored(GraniteAttention):
    """attention_multiplier: the scores scaled by 1/sqrt(head_dim) instead."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.scaling = self.head_dim**-0.5  # the bug: config.attention_multiplier was meant


class GPTNeoXBlocksNotHeads(GPTNeoXAttention):
    """Per-head fused query_key_value read as [q; k; v] blocks, where each head's rows are [q_h; k_h; v_h]."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any, layer_past: Any = None,  # type: ignore[override]
                position_embeddings: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        shape = (*hidden_states.shape[:-1], -1, self.head_size)
        q, k, v = (t.view(shape).transpose(1, 2) for t in self.query_key_value(hidden_states).chunk(3, dim=-1))
        q, k = modeling_gpt_neox.apply_rotary_pos_emb(q, k, *position_embeddings)
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_idx)
        return self.dense(_attend(self, modeling_gpt_neox, q, k, v, attention_mask)), None


def _gptj_last_features_rotated(self: Any, hidden_states: torch.Tensor, position_embeddings: Any,
                                attention_mask: Any = None, cache: Any = None, **kwargs: Any) -> Any:  # fmt: skip
    """GPT-J's forward rotating the last rotary_dim features of each head, where the first are meant."""
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    q, k = self.q_proj(hidden_states).view(shape), self.k_proj(hidden_states).view(shape)
    v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    sin, cos = position_embeddings
    r = q.shape[-1] - self.rotary_dim  # the bug: the rotated part taken from the end
    q = torch.cat((q[..., :r], modeling_gptj.apply_rotary_pos_emb(q[..., r:], sin, cos)), dim=-1).transpose(1, 2)
    k = torch.cat((k[..., :r], modeling_gptj.apply_rotary_pos_emb(k[..., r:], sin, cos)), dim=-1).transpose(1, 2)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx)
    return self.out_proj(_attend(self, modeling_gptj, q, k, v, attention_mask)), None


def _codegen_blocks_read_as_qkv(forward: Callable[..., Any]) -> Callable[..., Any]:
    """CodeGen's forward reading each block of qkv_proj as [q; k; v], where its rows are [q; v; k]."""

    @functools.wraps(forward)  # its signature too, which the check reads
    def wrong(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = self.qkv_proj.weight.detach().clone()
        with torch.no_grad():  # the bug: the value rows read as keys and the key rows as values
            self.qkv_proj.weight.copy_(saved.unflatten(0, (self.mp_num, 3, -1))[:, [0, 2, 1]].flatten(0, 2))
        try:
            return forward(self, *args, **kwargs)
        finally:
            with torch.no_grad():
                self.qkv_proj.weight.copy_(saved)

    return wrong


def _softcap_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    def attention(*a: Any, **kw: Any) -> Any:
        return original(*a, **{**kw, "softcap": None})  # the bug: attn_logit_softcapping not applied

    return attention


def _sinks_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    def attention(module: Any, *a: Any, **kw: Any) -> Any:
        # the bug: Llama's softmax, without the sink logit of each head
        return modeling_llama.eager_attention_forward(module, *a, **{k: v for k, v in kw.items() if k != "s_aux"})

    return attention


def _slopes_reversed(original: Callable[..., Any]) -> Callable[..., Any]:
    def slopes(num_heads: int, device: Any) -> Any:
        return original(num_heads, device).flip(0)  # the bug: head h given head (n - 1 - h)'s slope

    return slopes


def _biases_over_the_keys_reversed(original: Callable[..., Any]) -> Callable[..., Any]:
    def biases(*a: Any, **kw: Any) -> Any:
        return original(*a, **kw).flip(-1)  # the bug: the newest key biased as the oldest, and so on

    return biases


def _window_one_longer(sliding_window: int) -> Callable[..., bool]:
    def inner_mask(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx > q_idx - sliding_window - 1  # the bug: each query sees one key more than its window

    return inner_mask


def _frequencies_over_head_dim(config: Any, device: Any = None, **kwargs: Any) -> tuple[torch.Tensor, float]:
    """Phi's RoPE frequencies, spaced over head_dim where the rotated part (rotary_dim) was meant."""
    base = config.rope_parameters["rope_theta"]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / head_dim)), 1.0  # the bug: / head_dim


def _llama4_rope_in_halves(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[Any, Any]:
    """Llama 4's complex angles applied to halves (rotate_half), where view_as_complex pairs adjacent features."""
    cos = torch.cat((freqs_cis.real, freqs_cis.real), -1)[:, :, None, :]  # the bug: cat(angles, angles)
    sin = torch.cat((freqs_cis.imag, freqs_cis.imag), -1)[:, :, None, :]

    def turn(x: torch.Tensor) -> torch.Tensor:
        return (x.float() * cos + llama_rotate_half(x.float()) * sin).type_as(x)

    return turn(xq), turn(xk)


def _llama4_forward(bug: str) -> Callable[..., Any]:
    """Llama4TextAttention's forward with one mistake: "keys unnormed" (qk_norm applied to the queries alone) or
    "temperature off by one" (the NoPE layers' scale read at floor(i / floor_scale), not floor((i + 1) / ...))."""

    @functools.wraps(Llama4TextAttention.forward)  # its signature too, which the check reads
    def forward(self: Any, hidden_states: torch.Tensor, position_embeddings: Any, attention_mask: Any,
                cache: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape)
        k = self.k_proj(hidden_states).view(shape)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if self.use_rope:
            q, k = modeling_llama4.apply_rotary_emb(q, k, position_embeddings)
        if hasattr(self, "qk_norm"):
            q = self.qk_norm(q)
            k = k if bug == "keys unnormed" else self.qk_norm(k)
        if self.attn_temperature_tuning and not self.use_rope:
            seen = cache.get_seq_length(self.layer_idx) if cache is not None else 0
            positions = torch.arange(hidden_states.shape[1], device=hidden_states.device) + seen
            shift = 0.0 if bug == "temperature off by one" else 1.0
            scales = torch.log1p(torch.floor((positions.float() + shift) / self.floor_scale)) * self.attn_scale + 1.0
            q = (q * scales.view(1, -1, 1, 1)).to(q.dtype)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        return self.o_proj(_attend(self, modeling_llama4, q, k, v, attention_mask)), None

    return forward


def _chunks_one_longer(chunk_size: int, left_padding: torch.Tensor) -> Callable[..., Any]:
    def inner_mask(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        start = left_padding[batch_idx]  # the bug: chunks of chunk_size + 1 keys
        return (kv_idx - start) // (chunk_size + 1) == (q_idx - start) // (chunk_size + 1)

    return inner_mask


@dataclass(frozen=True)
class VariantBug:
    """A bug planted in one variant: the class, the patch, the property that must catch it."""

    variant: str
    name: str
    attention_cls: type[nn.Module]
    config_cls: type
    patch: Callable[[], contextlib.AbstractContextManager[Any]]
    prop: str
    named: str | None = None  # a phrase of the report's bug class line, where a variant of the reference matches


def _none() -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


VARIANT_BUGS = [
    VariantBug("QK-norm (RMSNorm of each head)", "Qwen3: the norm applied after RoPE", Qwen3NormAfterRope,
               Qwen3Config, _none, "RoPE/positions", "qk_norm_after_rope=True where False was asked"),
    VariantBug("QK-norm after RoPE", "HunYuan: the norm applied before RoPE", HunYuanNormBeforeRope,
               HunYuanDenseV1Config, _none, "RoPE/positions", "qk_norm_after_rope=True not applied"),
    VariantBug("QK LayerNorm of each head", "Persimmon: the keys normalised with the queries' LayerNorm",
               PersimmonKeysNormedAsQueries, PersimmonConfig, _none, "heads"),
    VariantBug("QK LayerNorm of each head, weights of its own", "Cohere: the keys' norm left out",
               CohereKeysUnnormed, CohereQKNormConfig, _none, "heads"),
    VariantBug("QK LayerNorm of each head, centred", "Cohere: an RMSNorm where its LayerNorm was meant",
               CohereNormNotCentred, CohereQKNormConfig, _none, "heads", "qk_norm_centred=True not applied"),
    VariantBug("output norm of the merged heads", "BitNet: attn_sub_norm left out", BitNetSubNormSkipped,
               BitNetConfig, _none, "heads", "the merged heads' norm not applied"),
    VariantBug("QK-norm over every head", "OLMo-2: the keys' norm left out", Olmo2KeysUnnormed, Olmo2Config,
               _none, "heads"),
    VariantBug("logit softcapping", "Gemma 2: softcap not applied", Gemma2Attention, Gemma2Config,
               lambda: _patched(modeling_gemma2, "eager_attention_forward",
                                _softcap_dropped(modeling_gemma2.eager_attention_forward)), "heads",
               "not applied (cap the scores"),
    VariantBug("attention_multiplier", "Granite: 1/sqrt(head_dim) where the multiplier was meant",
               GraniteMultiplierIgnored, GraniteConfig, _none, "heads", "not the config's scale"),
    VariantBug("attention sinks", "gpt-oss: the sinks left out of the softmax", GptOssAttention, GptOssConfig,
               lambda: _patched(modeling_gpt_oss, "eager_attention_forward",
                                _sinks_dropped(modeling_gpt_oss.eager_attention_forward)), "heads",
               "attention_sinks=True not applied"),
    VariantBug("sliding window", "Mistral: the window one key longer", MistralAttention, MistralConfig,
               lambda: _patched(masking_utils, "sliding_window_overlay", _window_one_longer), "heads",
               "sliding window one key longer"),
    VariantBug("partial rotary", "Phi: frequencies over head_dim, not the rotated part", PhiAttention, PhiConfig,
               lambda: _patched(PhiRotaryEmbedding, "compute_default_rope_parameters",
                                staticmethod(_frequencies_over_head_dim)), "RoPE/positions"),
    VariantBug("interleaved RoPE", "Cohere: rotate_half of halves where adjacent pairs were meant", CohereAttention,
               CohereConfig, lambda: _patched(modeling_cohere, "rotate_half", llama_rotate_half), "RoPE/positions"),
    VariantBug("per-head fused QKV", "GPT-NeoX: query_key_value read as [q; k; v] blocks", GPTNeoXBlocksNotHeads,
               GPTNeoXConfig, _none, "heads"),
    VariantBug("RoPE of rotary_dim features", "GPT-J: the last rotary_dim features rotated, not the first",
               GPTJAttention, GPTJConfig, lambda: _patched(GPTJAttention, "forward", _gptj_last_features_rotated),
               "RoPE/positions"),
    VariantBug("adjacent pairs of rotary_dim features", "CodeGen: rotate_half of halves where pairs were meant",
               CodeGenAttention, CodeGenConfig,
               lambda: _patched(modeling_codegen, "rotate_every_two", llama_rotate_half), "RoPE/positions"),
    VariantBug("CodeGen's blocks of [q; v; k]", "CodeGen: each block of qkv_proj read as [q; k; v]", CodeGenAttention,
               CodeGenConfig, lambda: _patched(CodeGenAttention, "forward",
                                               _codegen_blocks_read_as_qkv(CodeGenAttention.forward)), "heads"),
    VariantBug("RoPE of a complex table", "Llama 4: its angles applied to halves, where adjacent pairs were meant",
               Llama4TextAttention, Llama4TextConfig,
               lambda: _patched(modeling_llama4, "apply_rotary_emb", _llama4_rope_in_halves), "RoPE/positions",
               "rope_interleaved=True not applied"),
    VariantBug("weightless QK-norm after RoPE", "Llama 4: qk_norm applied to the queries alone",
               Llama4TextAttention, Llama4TextConfig,
               lambda: _patched(Llama4TextAttention, "forward", _llama4_forward("keys unnormed")), "heads"),
    VariantBug("chunked attention", "Llama 4: chunks one key longer than attention_chunk_size", Llama4TextAttention,
               Llama4TextConfig, lambda: _patched(masking_utils, "chunked_overlay", _chunks_one_longer), "heads"),
    VariantBug("ALiBi (Bloom)", "Bloom: the slopes in the reverse head order", BloomAttention, BloomConfig,
               lambda: _patched(modeling_bloom, "_get_alibi_slopes",
                                _slopes_reversed(modeling_bloom._get_alibi_slopes)), "heads",
               "ALiBi slopes in the reverse head order"),
    VariantBug("ALiBi (MPT)", "MPT: the biases laid over the keys back to front", MptAttention, MptConfig,
               lambda: _patched(modeling_mpt, "build_mpt_alibi_tensor",
                                _biases_over_the_keys_reversed(modeling_mpt.build_mpt_alibi_tensor)), "heads"),
    VariantBug("output gate", "Qwen3-Next: the gate left out", Qwen3NextGateDropped, Qwen3NextConfig, _none, "heads",
               "output_gate=True not applied"),
    VariantBug("temperature tuning of NoPE layers", "Llama 4: the scale read one position early",
               Llama4TextAttention, Llama4TextConfig,
               lambda: _patched(Llama4TextAttention, "forward", _llama4_forward("temperature off by one")), "heads"),
]  # fmt: skip
