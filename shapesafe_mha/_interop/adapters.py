"""Load an `AttentionWeights` into someone else's attention module, whatever its projections are called.

Three layouts cover most code: four projections (`q_proj, k_proj, v_proj, o_proj` or any names),
one fused query-key-value projection (`qkv`, `c_attn`, `Wqkv`: rows `[q; k; v]`), and GPT-2's
`Conv1D`, which stores its weight transposed (`(d_in, d_out)`). Biases follow the module: where it
has none, the loaded weights have none either, so the reference computes what the module can.
"""

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import Tensor, nn

from .._core.weights import AttentionWeights

NAMES: dict[str, tuple[str, ...]] = {
    "q": ("q_proj", "query", "to_q", "wq", "q_lin", "q"),
    "k": ("k_proj", "key", "to_k", "wk", "k_lin", "k"),
    "v": ("v_proj", "value", "to_v", "wv", "v_lin", "v"),
    "o": ("o_proj", "out_proj", "c_proj", "dense", "to_out", "wo", "out_lin", "proj", "o"),
    "qkv": ("qkv_proj", "qkv", "c_attn", "Wqkv", "in_proj", "to_qkv"),
}


def _is_conv1d(layer: nn.Module) -> bool:
    """GPT-2's Conv1D (transformers.pytorch_utils): a linear layer whose weight is `(d_in, d_out)`."""
    return type(layer).__name__ == "Conv1D" and isinstance(getattr(layer, "weight", None), Tensor)


def _is_projection(layer: object) -> bool:
    return isinstance(layer, nn.Linear) or (isinstance(layer, nn.Module) and _is_conv1d(layer))


def _find(module: nn.Module, role: str, names: Mapping[str, str]) -> tuple[str, nn.Module] | None:
    candidates = (names[role],) if role in names else NAMES[role]
    for name in candidates:
        layer = module.get_submodule(name) if "." in name else getattr(module, name, None)
        if _is_projection(layer):
            return name, layer  # type: ignore[return-value]
    return None


def _copy(layer: nn.Module, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """Copy into `layer`; return the bias it now computes with (None if it has none)."""
    target: Tensor = layer.weight  # type: ignore[assignment]
    target.copy_(weight.T if _is_conv1d(layer) else weight)
    own: Tensor | None = getattr(layer, "bias", None)  # type: ignore[assignment]
    if own is None:
        return None
    own.copy_(torch.zeros_like(own) if bias is None else bias)
    return None if bias is None else bias


def load_weights(
    module: nn.Module, weights: AttentionWeights, *, names: Mapping[str, str] | None = None
) -> AttentionWeights:
    """Copy `weights` into `module`'s projections; return the weights it now computes with.

    The projections are found by name (`names={"q": "query", "o": "attn.out"}` to say yours; else
    the usual `q_proj/query/to_q/wq`, ..., `o_proj/out_proj/c_proj/dense/to_out/wo`), or as one fused
    `qkv_proj/qkv/c_attn/Wqkv/in_proj` projection whose rows are `[q; k; v]`. Each is an `nn.Linear`
    or GPT-2's `Conv1D` (weight transposed). A projection without a bias drops the drawn one; a
    bias the weights lack is zeroed.

    Example:
        >>> import shapesafe_mha as ssm
        >>> from torch import nn
        >>> from shapesafe_mha.testing import load_weights
        >>> class Fused(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.qkv, self.proj = nn.Linear(8, 24, bias=True), nn.Linear(8, 8, bias=False)
        >>> w = ssm.MultiHeadAttention(8, 2, bias=True).weights()
        >>> loaded = load_weights(Fused(), w)
        >>> loaded.b_q is not None, loaded.b_o is None
        (True, True)

    Raises:
        ValueError: no projection under any known name (the message lists what the module has).
    """
    names = dict(names or {})
    found = {role: _find(module, role, names) for role in ("q", "k", "v", "o")}
    fused = None if all(found[r] for r in "qkv") else _find(module, "qkv", names)
    missing = [role for role in ("q", "k", "v") if found[role] is None] if fused is None else []
    if found["o"] is None:
        missing.append("o")
    if missing:
        children = ", ".join(f"{n} ({type(c).__name__})" for n, c in module.named_children()) or "none"
        raise ValueError(
            f"load_weights: no {'/'.join(missing)} projection found in {type(module).__name__} (its children: "
            f"{children}); pass names={{'q': ..., 'k': ..., 'v': ..., 'o': ...}} or a fused 'qkv'"
        )
    with torch.no_grad():
        if fused is not None:
            _, layer = fused
            weight = torch.cat((weights.w_q, weights.w_k, weights.w_v))
            parts = (weights.b_q, weights.b_k, weights.b_v)
            bias = None if all(b is None for b in parts) else torch.cat(
                [torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) if b is None else b
                 for w, b in zip((weights.w_q, weights.w_k, weights.w_v), parts, strict=True)]
            )  # fmt: skip
            kept = _copy(layer, weight, bias)
            b_q, b_k, b_v = (None, None, None) if kept is None else parts
        else:
            b_q, b_k, b_v = (
                _copy(found[role][1], getattr(weights, f"w_{role}"), getattr(weights, f"b_{role}"))  # type: ignore[index]
                for role in "qkv"
            )
        b_o = _copy(found["o"][1], weights.w_o, weights.b_o)  # type: ignore[index]
    return replace(weights, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o)
