"""Hugging Face interop: load a transformers attention layer (Llama, Mistral, Qwen2/3, Gemma 2 layout), and back.

transformers is an optional dependency (`pip install "shapesafe_mha[hf]"`); it is imported only
when `to_hf` needs it. Sliding windows, QK-norm, logit softcapping and `query_pre_attn_scalar`
become the module's options; a variant it does not compute (partial RoPE, RoPE scaling other than
llama3, a QK-norm other than RMSNorm) is a `ConfigError` naming the config field, never a silently
different layer.
"""

import importlib
from typing import Any

import torch
from torch import nn

from ._errors import ConfigError
from ._rotary import SUPPORTED_SCALING

_OWNER = "MultiHeadAttention.from_hf()"


def _refuse(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(
        f"{_OWNER}: {field}={value!r}: {why}; this layer would compute something else, so it is refused."
    )


def rope_of(config: Any) -> tuple[float | None, dict[str, Any] | None]:
    """`(rope_theta, scaling)` of a transformers config (`rope_parameters` in transformers 5, else `rope_theta`)."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind not in SUPPORTED_SCALING:
        raise _refuse("rope_parameters['rope_type']", kind, f"only {', '.join(SUPPORTED_SCALING)} RoPE is supported")
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise _refuse("partial_rotary_factor", config.partial_rotary_factor, "only full-width RoPE is supported")
    return theta, (dict(parameters) if kind != "default" else None)


def variant_options(attention: nn.Module, config: Any) -> dict[str, Any]:
    """The `MultiHeadAttention` options of the variants `attention` uses; refuse the others, naming the field."""
    options: dict[str, Any] = {}
    window = getattr(attention, "sliding_window", None)
    if window is None and not hasattr(attention, "sliding_window"):  # Mistral: the config's window applies
        window = getattr(config, "sliding_window", None)
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            field = "sliding_window"
            raise _refuse(field, window, "a sliding window must be a positive number of keys (None: no window)")
        options["window"] = window
    norms = [getattr(attention, norm, None) for norm in ("q_norm", "k_norm")]
    if any(norm is not None for norm in norms):
        options["qk_norm"] = True
        options["norm_eps"] = _norm_eps(norms[0])
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        options["logit_softcap"] = float(softcap)
    head_dim = _head_dim(config)
    scalar = getattr(config, "query_pre_attn_scalar", None)
    expected = head_dim**-0.5
    if scalar is not None:
        options["query_pre_attn_scalar"] = float(scalar)
        expected = float(scalar) ** -0.5
    scaling = getattr(attention, "scaling", expected)
    if abs(scaling - expected) > 1e-12:
        raise _refuse("scaling", scaling, f"only 1/sqrt(query_pre_attn_scalar or head_dim) = {expected:g} is supported")
    if not getattr(attention, "is_causal", True):
        raise _refuse("is_causal", False, "only causal (decoder) attention layers are supported")
    return options


def _norm_eps(norm: Any) -> float:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(eps, float):
        raise _refuse("q_norm", type(norm).__name__, "a QK-norm without an epsilon is not an RMSNorm we know")
    return eps


def load_norms(module: Any, attention: nn.Module) -> None:
    """Copy QK-norm weights, after checking on a probe that their norm is an RMSNorm over `d_head` as ours is."""
    for name in ("q_norm", "k_norm"):
        theirs, ours = getattr(attention, name), module._modules[name]
        with torch.no_grad():
            ours.weight.copy_(theirs.weight)
            probe = torch.randn(3, ours.weight.shape[0], generator=torch.Generator().manual_seed(0))
            probe = probe.to(device=ours.weight.device, dtype=ours.weight.dtype)
            if not torch.allclose(theirs(probe), ours(probe), rtol=1e-3, atol=1e-5):
                why = "it computes something other than weight * x / rms(x) (Gemma 3's 1 + weight?)"
                raise _refuse(name, type(theirs).__name__, why)


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def from_hf(cls: Any, attention: nn.Module) -> Any:
    """Build `cls` (a `MultiHeadAttention`) computing what `attention`, a transformers layer, computes."""
    config = getattr(attention, "config", None)
    if config is None:
        raise ConfigError(f"{_OWNER}: {type(attention).__name__} has no .config; pass a transformers attention layer.")
    if isinstance(getattr(attention, "kv_a_proj_with_mqa", None), nn.Linear):
        raise ConfigError(
            f"{_OWNER}: {type(attention).__name__} is multi-head latent attention (kv_a_proj_with_mqa); "
            "load it with shapesafe_mha.LatentAttention.from_hf(layer)."
        )
    projections: dict[str, Any] = {
        name: getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    missing = [name for name, proj in projections.items() if not isinstance(proj, nn.Linear)]
    if missing:
        raise ConfigError(
            f"{_OWNER}: {type(attention).__name__} has no nn.Linear {', '.join(missing)}; only the q/k/v/o_proj layout "
            "(Llama, Mistral, Qwen2) is supported."
        )
    options = variant_options(attention, config)
    theta, scaling = rope_of(config)
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    q_proj = projections["q_proj"]
    module = cls(
        config.hidden_size,
        num_heads,
        num_kv_heads,
        d_head=_head_dim(config),
        bias=True,
        dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
        rope_theta=theta,
        rope_scaling=scaling,
        device=q_proj.weight.device,
        dtype=q_proj.weight.dtype,
        **options,
    )
    if module.qk_norm:
        load_norms(module, attention)
    with torch.no_grad():
        for name, theirs in projections.items():
            ours: Any = module._modules[name]
            ours.weight.copy_(theirs.weight)
            if theirs.bias is None:
                ours.register_parameter("bias", None)
            else:
                ours.bias.copy_(theirs.bias)
    return module.train(attention.training)


def to_hf(module: Any, config: Any) -> nn.Module:
    """The transformers attention layer of `config`'s model type, holding `module`'s weights."""
    kind = type(config).__name__.removesuffix("Config")
    try:
        modeling = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
        layer_cls = getattr(modeling, f"{kind}Attention")
    except (ImportError, AttributeError):
        raise ConfigError(
            f"MultiHeadAttention.to_hf(): no transformers attention class for model_type={config.model_type!r}."
        ) from None
    theta, _ = rope_of(config)
    wanted = {
        "hidden_size": module.d_model,
        "num_attention_heads": module.num_heads,
        "num_key_value_heads": module.num_kv_heads,
        "head_dim": module.d_head,
        "rope_theta": module.rope_theta,
    }
    found = {**{k: getattr(config, k, None) for k in wanted if k != "head_dim"}, "head_dim": _head_dim(config)}
    found["rope_theta"] = theta
    different = {k: (found[k], v) for k, v in wanted.items() if found[k] != v}
    if different:
        listed = ", ".join(f"{k}={theirs!r} (module: {ours!r})" for k, (theirs, ours) in different.items())
        raise ConfigError(f"MultiHeadAttention.to_hf(): the config does not describe this module: {listed}.")
    weight = module.q_proj.weight
    theirs = layer_cls(config, layer_idx=0).to(device=weight.device, dtype=weight.dtype)
    options = variant_options(theirs, config)
    ours = {
        "window": module.window,
        "qk_norm": module.qk_norm or None,
        "logit_softcap": module.logit_softcap,
        "query_pre_attn_scalar": module.query_pre_attn_scalar,
    }
    different = {k: (options.get(k), v) for k, v in ours.items() if options.get(k) != v}
    if different:
        listed = ", ".join(f"{k}={theirs_!r} (module: {mine!r})" for k, (theirs_, mine) in different.items())
        raise ConfigError(f"MultiHeadAttention.to_hf(): the config's layer 0 computes another variant: {listed}.")
    with torch.no_grad():
        if module.qk_norm:
            for name in ("q_norm", "k_norm"):
                getattr(theirs, name).weight.copy_(module._modules[name].weight)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            mine: Any = module._modules[name]
            other = getattr(theirs, name)
            if (mine.bias is None) != (other.bias is None):
                raise ConfigError(
                    f"MultiHeadAttention.to_hf(): {name} has bias={mine.bias is not None} here but "
                    f"{other.bias is not None} in {layer_cls.__name__} (config.attention_bias?)."
                )
            other.weight.copy_(mine.weight)
            if mine.bias is not None:
                other.bias.copy_(mine.bias)
    return theirs.train(module.training)


def latent_from_hf(cls: Any, attention: nn.Module) -> Any:
    """Build `cls` (a `LatentAttention`) computing what `attention` (DeepseekV3Attention or alike) computes."""
    owner = "LatentAttention.from_hf()"
    config = getattr(attention, "config", None)
    if config is None or not isinstance(getattr(attention, "kv_a_proj_with_mqa", None), nn.Linear):
        raise ConfigError(
            f"{owner}: {type(attention).__name__} is not a multi-head latent attention layer (no .config and "
            "kv_a_proj_with_mqa); for q/k/v/o_proj layers use MultiHeadAttention.from_hf."
        )
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    kind = parameters.get("rope_type", "default")
    if kind != "default":
        raise ConfigError(
            f"{owner}: rope_parameters['rope_type']={kind!r}: only default RoPE is supported (its positions and "
            "score scale would differ); this layer would compute something else, so it is refused."
        )
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    num_heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", num_heads) or num_heads
    if kv_heads != num_heads:  # transformers' layer repeats the rebuilt K/V; MLA has every head's own
        raise ConfigError(
            f"{owner}: num_key_value_heads={kv_heads} != num_attention_heads={num_heads}: latent attention "
            "rebuilds a key and a value for every head; this layer would compute something else, so it is refused."
        )
    norm = attention.kv_a_layernorm
    projection: Any = attention.kv_a_proj_with_mqa
    weight = projection.weight
    module = cls(
        config.hidden_size,
        num_heads,
        kv_lora_rank=config.kv_lora_rank,
        d_nope=config.qk_nope_head_dim,
        d_rope=config.qk_rope_head_dim,
        d_value=config.v_head_dim,
        q_lora_rank=config.q_lora_rank,
        bias=bool(getattr(config, "attention_bias", False)),
        rope_theta=theta,
        interleaved=bool(getattr(config, "rope_interleave", False)),
        norm_eps=_norm_eps(norm),
        dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
        device=weight.device,
        dtype=weight.dtype,
    )
    scaling = getattr(attention, "scaling", module.scale)
    if abs(scaling - module.scale) > 1e-12:
        raise _refuse("scaling", scaling, f"only 1/sqrt(qk_head_dim) = {module.scale:g} is supported")
    theirs = attention.state_dict()
    missing, unexpected = module.load_state_dict(theirs, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"{owner}: {type(attention).__name__}'s parameters do not match the layout: missing {missing}, "
            f"unexpected {unexpected}."
        )
    return module.train(attention.training)
