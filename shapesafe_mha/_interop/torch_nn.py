"""torch interop, verified: `to_torch` (an `nn.MultiheadAttention`) and the probe of `from_weights`.

Each result is compared with its source on the conversions' probe (`_core/probe.py`): `to_torch`'s module
against ours, `from_weights`' module against the per-head reference holding the same weights.
"""

from typing import Any

import torch
from torch import Tensor, nn

from .._compute.reference import per_head_attention
from .._compute.rotary import inverse_frequencies, long_frequencies
from .._compute.stages import positive_count
from .._core import probe
from .._core.errors import ConfigError
from .._core.weights import AttentionWeights


def _variants(module: Any) -> list[str]:
    """The options of `module` that `nn.MultiheadAttention` does not compute, as `name=value` (every option that
    differs from its default but dropout, which it computes, and biases, which it holds)."""
    variants = module._described().variants()
    return [f"{name}={value!r}" for name, value in variants.items() if name not in ("dropout", "bias")]


def to_torch(module: Any, *, verify: bool = True) -> nn.MultiheadAttention:
    """An `nn.MultiheadAttention(batch_first=True)` computing what `module` computes (`MultiHeadAttention.to_torch`)."""
    owner = "MultiHeadAttention.to_torch()"
    if module.num_kv_heads != module.num_heads or module.num_heads * module.d_head != module.d_model:
        raise ConfigError(
            f"{owner}: nn.MultiheadAttention has no GQA/MQA and needs num_heads * d_head "
            f"== d_model, but this module has num_heads={module.num_heads}, num_kv_heads={module.num_kv_heads}, "
            f"d_head={module.d_head}, d_model={module.d_model}."
        )
    variants = _variants(module)
    if variants:
        raise ConfigError(
            f"{owner}: nn.MultiheadAttention computes none of {', '.join(variants)}; "
            "its attention would be another function, so there is no equivalent."
        )
    projections = (module.q_proj, module.k_proj, module.v_proj, module.o_proj)
    weight = module.q_proj.weight
    biased = any(p.bias is not None for p in projections)
    theirs = nn.MultiheadAttention(
        module.d_model, module.num_heads, dropout=module.dropout, bias=biased, batch_first=True,
        device=weight.device, dtype=weight.dtype,
    )  # fmt: skip
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([p.weight for p in projections[:3]]))
        theirs.out_proj.weight.copy_(module.o_proj.weight)
        if biased:  # all or none there: a projection without one gets zeros, which add nothing
            zeros = [torch.zeros(p.weight.shape[0], dtype=weight.dtype, device=weight.device) for p in projections]
            biases = [z if p.bias is None else p.bias for z, p in zip(zeros, projections, strict=True)]
            theirs.in_proj_bias.copy_(torch.cat(biases[:3]))
            theirs.out_proj.bias.copy_(biases[3])
    theirs.train(module.training)
    if verify and probe.probeable(module):
        with probe.probing(module) as ours_probed, probe.probing(theirs) as theirs_probed:
            x = probe.probe_tokens(module.d_model, weight.device, probe.dtype_of(ours_probed))
            probe.verify(owner, probe.our_outputs(ours_probed, x), _torch_outputs(theirs_probed, x),
                         source="the module")  # fmt: skip
    return theirs


def _torch_outputs(theirs: nn.MultiheadAttention, x: Tensor) -> probe.Outputs:
    """The probe through `nn.MultiheadAttention`: causal by its mask (True = forbidden); decoding is the last row."""
    def causal(x: Tensor) -> Tensor:
        seq = x.shape[1]
        return torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)

    with torch.no_grad():  # the first rows of a causal forward are the causal forward of the prompt
        whole = theirs(x, x, x, attn_mask=causal(x), need_weights=False)[0]
    return {probe.FORWARD: whole[:, : probe.PROMPT], probe.DECODING: whole[:, probe.PROMPT :]}


def verify_weights(module: Any, weights: AttentionWeights) -> None:
    """Raise `ConfigError` unless `module` computes the per-head reference of `weights` on the probe."""
    if not probe.probeable(module):
        return
    owner = "MultiHeadAttention.from_weights()"
    with probe.probing(module) as ours_probed:
        dtype = probe.dtype_of(ours_probed)
        cast: dict[str, Any] = {name: None if t is None else t.detach().to(dtype) for name, t in vars(weights).items()}
        held = AttentionWeights(**cast)
        x = probe.probe_tokens(module.d_model, held.w_q.device, dtype)
        options: dict[str, Any] = {"config": module.config}  # the sizes and options the reference reads from it
        rotary = module.rotary
        if rotary is not None and rotary.scaling is not None:  # scaled RoPE: the reference takes its frequencies
            frequencies = inverse_frequencies(rotary.d_head, rotary.theta, rotary.scaling)
            options["rope_frequencies"] = (frequencies, rotary.attention_factor)
        by_length = rotary is not None and rotary.by_length
        with torch.no_grad():  # the first rows of a causal forward are the causal forward of the prompt
            if by_length:  # the prefill turned by the frequencies of its length, the decoding step by its own
                whole = per_head_attention(x, x, x, held, is_causal=True,
                                           **_frequencies_at(rotary, options, probe.PROMPT))  # fmt: skip
                step = _decoded_by_length(x, held, rotary, options)
            else:
                whole = step = per_head_attention(x, x, x, held, is_causal=True, **options)
        theirs = {probe.FORWARD: whole[:, : probe.PROMPT], probe.DECODING: step[:, probe.PROMPT :]}
        ours = probe.our_outputs(ours_probed, x)
        probe.verify(owner, ours, theirs, source="the per-head reference of these weights")


def _frequencies_at(rotary: Any, options: dict[str, Any], length: int) -> dict[str, Any]:
    """`options` with the frequencies of a call `length` long (RoPE scaled by length)."""
    frequencies = long_frequencies(rotary.d_head, rotary.theta, rotary.scaling, length)
    return {**options, "rope_frequencies": (frequencies, rotary.attention_factor)}


def _decoded_by_length(x: Tensor, held: AttentionWeights, rotary: Any, options: dict[str, Any]) -> Tensor:
    """The reference of the probe's decoding step under RoPE scaled by length: its query and its key turned by the
    frequencies of its call (`PROMPT + 1` long), the cached keys by the prefill's (`PROMPT` long)."""
    prefill = long_frequencies(rotary.d_head, rotary.theta, rotary.scaling, probe.PROMPT)
    step = long_frequencies(rotary.d_head, rotary.theta, rotary.scaling, probe.PROMPT + 1)
    keys = torch.stack([prefill] * probe.PROMPT + [step])[None]  # each key position's own frequencies
    stepped = _frequencies_at(rotary, options, probe.PROMPT + 1)
    return per_head_attention(x, x, x, held, is_causal=True, key_rope_frequencies=(keys, rotary.attention_factor),
                              **stepped)  # fmt: skip


def from_weights(
    cls: Any,
    weights: AttentionWeights,
    *,
    num_heads: int,
    num_kv_heads: int | None,
    verify: bool,
    **options: Any,
) -> Any:
    """A `cls` (`MultiHeadAttention`) holding copies of `weights`, verified (`MultiHeadAttention.from_weights`); its
    `options`, the constructor's keywords of that name."""
    if not isinstance(weights, AttentionWeights):
        raise ConfigError(
            f"MultiHeadAttention.from_weights(): weights must be an AttentionWeights(w_q, w_k, w_v, w_o, b_q, b_k, "
            f"b_v, b_o) of tensors in nn.Linear's layout, but got {type(weights).__name__}."
        )
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    for name, count in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        positive_count("MultiHeadAttention.from_weights(): ", name, count)
    d_head = weights.check(num_heads, num_kv_heads)
    biases = {name: getattr(weights, f"b_{name}") for name in "qkvo"}
    module = cls(
        weights.d_model,
        num_heads,
        num_kv_heads,
        d_head=d_head,
        bias=any(b is not None for b in biases.values()),
        **options,
        device=weights.w_q.device,
        dtype=weights.w_q.dtype,
    )
    with torch.no_grad():
        for name, proj in (("q", module.q_proj), ("k", module.k_proj), ("v", module.v_proj), ("o", module.o_proj)):
            proj.weight.copy_(getattr(weights, f"w_{name}"))
            bias = biases[name]
            if bias is None:
                proj.register_parameter("bias", None)  # some models bias q/k/v but not o (Qwen2)
            elif proj.bias is not None:
                proj.bias.copy_(bias)
    if verify:
        verify_weights(module, weights)
    return module


def from_torch(cls: Any, module: nn.MultiheadAttention) -> Any:
    """A `cls` (`MultiHeadAttention`) computing what a batch-first `module` computes (see its `from_torch`)."""
    if not isinstance(module, nn.MultiheadAttention):
        raise ConfigError(
            f"MultiHeadAttention.from_torch(): module must be a torch.nn.MultiheadAttention, but got "
            f"{type(module).__name__}; for projections of your own, pass their weights to "
            "MultiHeadAttention.from_weights(AttentionWeights(w_q, w_k, w_v, w_o, ...), num_heads=...)."
        )
    if not module.batch_first:
        raise ConfigError(
            "MultiHeadAttention.from_torch(): this nn.MultiheadAttention has batch_first=False, so it takes "
            "(seq, batch, embed_dim), but MultiHeadAttention is batch-first. Set module.batch_first = True "
            "(the weights are the same) and pass x.transpose(0, 1) where you passed x."
        )
    if not module._qkv_same_embed_dim:
        raise ConfigError(
            "MultiHeadAttention.from_torch(): modules with kdim or vdim != embed_dim are not supported."
        )
    if module.bias_k is not None or module.add_zero_attn:
        raise ConfigError("MultiHeadAttention.from_torch(): add_bias_kv and add_zero_attn are not supported.")
    weight = module.in_proj_weight
    ours = cls(
        module.embed_dim,
        module.num_heads,
        bias=module.in_proj_bias is not None,
        dropout=module.dropout,
        device=weight.device,
        dtype=weight.dtype,
    )
    with torch.no_grad():
        for proj, w in zip((ours.q_proj, ours.k_proj, ours.v_proj), weight.chunk(3), strict=True):
            proj.weight.copy_(w)
        ours.o_proj.weight.copy_(module.out_proj.weight)
        if module.in_proj_bias is not None:
            for proj, b in zip((ours.q_proj, ours.k_proj, ours.v_proj), module.in_proj_bias.chunk(3), strict=True):
                proj.bias.copy_(b)  # pyright: ignore[reportOptionalMemberAccess]  (built with bias above)
            ours.o_proj.bias.copy_(module.out_proj.bias)  # pyright: ignore[reportOptionalMemberAccess]
    return ours
