"""One description of a layer: `AttentionConfig` holds every option, and a built module follows it or refuses.

Invariants: a module rebuilt from its own `config` computes what it computes; an option set on a built module
either makes it compute what a module built with that option computes (decoding included), or is refused with
`ConfigError` naming `from_config(dataclasses.replace(...))`, the module left as it was. Never half applied.
"""

import dataclasses
from typing import Any

import pytest
import torch

import shapesafe_mha as ssm
from shapesafe_mha._modules.config import OPTIONS, SIZES
from shapesafe_mha._modules.latent_config import LATENT_OPTIONS, LATENT_SIZES

# A module with most options on, so that an option set after construction meets the others.
BASE = {"d_model": 32, "num_heads": 4, "num_kv_heads": 2, "rope_theta": 10000.0, "qk_norm": True, "window": 6}

# For every option, a value other than BASE's (and valid beside it). A field added to AttentionConfig fails
# test_every_option_has_a_value_here until it is listed: its behaviour on a built module is then tested.
CHANGED: dict[str, Any] = {
    "bias": False,
    "dropout": 0.25,
    "rope_theta": 500.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8},
    "rope_dim": 4,
    "rope_interleaved": True,
    "qk_norm": False,
    "qk_norm_over": "per_head",
    "qk_norm_centred": True,
    "qk_norm_offset": 1.0,
    "qk_norm_after_rope": True,
    "norm_eps": 1e-3,
    "window": 3,
    "logit_softcap": 2.0,
    "query_pre_attn_scalar": 3.0,
    "clip_qkv": 0.5,
    "temperature_tuning": (2, 0.5),
    "chunk_size": None,  # (with a window: both are refused together; None is its other value here)
    "attention_sinks": True,
    "alibi": True,
    "output_gate": True,
    "differential_lambda_init": 0.2,  # DiffLlama's layer 0
}  # fmt: skip


def test_every_option_has_a_value_here() -> None:
    assert set(CHANGED) == set(OPTIONS) - set(SIZES)


def _outputs(module: ssm.MultiHeadAttention | ssm.LatentAttention, x: torch.Tensor) -> list[torch.Tensor]:
    """A causal prefill, then two decoding steps through the module's own cache."""
    module = module.double().eval()
    with torch.no_grad():
        cache = module.new_cache(x.shape[0], 8)
        outs = [module(x, is_causal=True)]
        outs.append(module(x[:, :3], is_causal=True, kv_cache=cache))
        for t in (3, 4):
            outs.append(module(x[:, t : t + 1], is_causal=True, kv_cache=cache))
    return outs


def _agree(a: ssm.MultiHeadAttention | ssm.LatentAttention, b: ssm.MultiHeadAttention | ssm.LatentAttention) -> None:
    x = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for got, expected in zip(_outputs(a, x), _outputs(b, x), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-8)


def test_a_module_rebuilt_from_its_config_computes_what_it_computes() -> None:
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(**BASE, logit_softcap=5.0, attention_sinks=True)
    rebuilt = ssm.MultiHeadAttention.from_config(module.config)
    rebuilt.load_state_dict(module.state_dict())
    assert rebuilt.config == module.config and repr(rebuilt) == repr(module)
    _agree(rebuilt, module)


@pytest.mark.parametrize("name", list(CHANGED))
def test_an_option_set_on_a_built_module_is_followed_or_refused_never_half_applied(name: str) -> None:
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(**BASE)
    x = torch.randn(1, 4, 32)
    with torch.no_grad():
        module(x, is_causal=True)  # remembered: a verdict, the fused view
    value = CHANGED[name]
    try:
        target = ssm.MultiHeadAttention.from_config(dataclasses.replace(module.config, **{name: value}))
    except ssm.ConfigError:  # a combination no module takes: setting it must be refused as well
        target = None
    before, state = module.config, {k: v.clone() for k, v in module.state_dict().items()}
    try:
        setattr(module, name, value)
    except ssm.ConfigError as error:
        if target is not None:
            assert "from_config(dataclasses.replace(module.config" in str(error)
        assert module.config == before  # refused: nothing changed
        assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())
        return
    assert target is not None, f"{name}={value!r} was accepted on a built module but refused at construction"
    assert module.config == target.config
    target.load_state_dict(module.state_dict())
    _agree(module, target)


@pytest.mark.parametrize("name", list(CHANGED))
def test_an_option_followed_on_a_built_module_keeps_a_cache_filled_before_it_right(name: str) -> None:
    """A cache filled before an option was set holds keys and values computed without it: decoding on through that
    cache equals a module built with the option decoding through its own, or the option was refused."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(**BASE).double().eval()
    x = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 4
    cache = module.new_cache(2, 8)
    with torch.no_grad():
        module(x[:, :3], is_causal=True, kv_cache=cache)
    try:
        setattr(module, name, CHANGED[name])
    except ssm.ConfigError:
        return  # refused (how: the test above)
    target = ssm.MultiHeadAttention.from_config(module.config).double().eval()
    target.load_state_dict(module.state_dict())
    fresh = target.new_cache(2, 8)
    with torch.no_grad():
        target(x[:, :3], is_causal=True, kv_cache=fresh)
        for t in (3, 4):
            expected = target(x[:, t : t + 1], is_causal=True, kv_cache=fresh)
            got = module(x[:, t : t + 1], is_causal=True, kv_cache=cache)
            torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize(
    ("name", "value"),
    [("window", 0), ("logit_softcap", -1.0), ("query_pre_attn_scalar", float("nan")), ("dropout", 1.0),
     ("clip_qkv", 0), ("temperature_tuning", (0, 1.0)), ("chunk_size", 4)],  # (chunks beside the window)
)  # fmt: skip
def test_an_option_set_out_of_its_range_is_refused_as_at_construction(name: str, value: Any) -> None:
    module = ssm.MultiHeadAttention(**BASE)
    with pytest.raises(ssm.ConfigError) as constructed:
        ssm.MultiHeadAttention(**(BASE | {name: value}))
    with pytest.raises(ssm.ConfigError) as set_later:
        setattr(module, name, value)
    assert str(set_later.value) == str(constructed.value)
    assert module.config == ssm.MultiHeadAttention(**BASE).config


# LatentAttention: the same invariants, over `LatentConfig`.
LATENT_BASE: dict[str, Any] = {"d_model": 32, "num_heads": 4, "q_lora_rank": 12, "kv_lora_rank": 8, "d_nope": 4,
                               "d_rope": 4, "d_value": 6}  # fmt: skip
LATENT_CHANGED: dict[str, Any] = {
    "bias": True,
    "rope_theta": 50.0,
    "interleaved": True,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    "scale": 0.3,
    "norm_eps": 0.5,
    "dropout": 0.25,
}


def test_every_latent_option_has_a_value_here() -> None:
    assert set(LATENT_CHANGED) == set(LATENT_OPTIONS) - set(LATENT_SIZES)


_F64: dict[str, Any] = {"atol": 1e-10, "rtol": 1e-8}


@pytest.mark.parametrize("changed", [{}, *({name: value} for name, value in LATENT_CHANGED.items())])
def test_a_latent_module_rebuilt_from_its_config_computes_what_it_computes(changed: dict[str, Any]) -> None:
    torch.manual_seed(0)
    module = ssm.LatentAttention(**LATENT_BASE, **changed)
    rebuilt = ssm.LatentAttention.from_config(module.config)
    rebuilt.load_state_dict(module.state_dict())
    assert rebuilt.config == module.config == ssm.LatentConfig(**LATENT_BASE, **changed)
    assert repr(rebuilt) == repr(module)
    _agree(rebuilt, module)


@pytest.mark.parametrize("name", list(LATENT_CHANGED))
def test_a_latent_option_set_on_a_built_module_is_followed_or_refused_never_half_applied(name: str) -> None:
    torch.manual_seed(0)
    module = ssm.LatentAttention(**LATENT_BASE)
    with torch.no_grad():
        module(torch.randn(1, 4, 32), is_causal=True)  # remembered: a verdict
    value = LATENT_CHANGED[name]
    target = ssm.LatentAttention.from_config(dataclasses.replace(module.config, **{name: value}))
    before, state = module.config, {k: v.clone() for k, v in module.state_dict().items()}
    try:
        setattr(module, name, value)
    except ssm.ConfigError as error:
        assert "LatentAttention.from_config(dataclasses.replace(module.config" in str(error)
        assert module.config == before  # refused: nothing changed
        assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())
        return
    assert module.config == target.config
    target.load_state_dict(module.state_dict())
    _agree(module, target)


@pytest.mark.parametrize("name", list(LATENT_CHANGED))
def test_a_latent_option_followed_on_a_built_module_keeps_a_cache_filled_before_it_right(name: str) -> None:
    """As for MultiHeadAttention: decoding on through a cache filled before the option was set equals a module built
    with it decoding through its own, or the option was refused."""
    torch.manual_seed(0)
    module = ssm.LatentAttention(**LATENT_BASE).double().eval()
    x = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cache = module.new_cache(2, 8)
    with torch.no_grad():
        module(x[:, :3], is_causal=True, kv_cache=cache)
    try:
        setattr(module, name, LATENT_CHANGED[name])
    except ssm.ConfigError:
        return
    target = ssm.LatentAttention.from_config(module.config).double().eval()
    target.load_state_dict(module.state_dict())
    fresh = target.new_cache(2, 8)
    with torch.no_grad():
        target(x[:, :3], is_causal=True, kv_cache=fresh)
        for t in (3, 4):
            expected = target(x[:, t : t + 1], is_causal=True, kv_cache=fresh)
            torch.testing.assert_close(module(x[:, t : t + 1], is_causal=True, kv_cache=cache), expected, **_F64)


def test_a_latent_size_set_on_a_built_module_derives_the_default_scale_again() -> None:
    """Without a scale of its own, the scores' scale is the sizes' `(d_nope + d_rope) ** -0.5`: a size set (pruning
    with the parts replaced) makes it the new sizes', as a module built with them has; a given scale stays."""
    smaller = LATENT_BASE | {"d_nope": 2}
    for given in ({}, {"scale": 0.3}):
        module = ssm.LatentAttention(**LATENT_BASE, **given)
        fresh = ssm.LatentAttention(**smaller, **given)
        module.d_nope = 2
        for name in ("q_b_proj", "kv_b_proj"):
            setattr(module, name, getattr(fresh, name))
        module.load_state_dict(fresh.state_dict())
        assert module.scale == fresh.scale and module.config == fresh.config
        _agree(module, fresh)


@pytest.mark.parametrize(
    ("name", "value"), [("scale", 0), ("scale", float("inf")), ("dropout", 1.0), ("interleaved", 1)]
)
def test_a_latent_option_set_out_of_its_range_is_refused_as_at_construction(name: str, value: Any) -> None:
    module = ssm.LatentAttention(**LATENT_BASE)
    with pytest.raises(ssm.ConfigError) as constructed:
        ssm.LatentAttention(**(LATENT_BASE | {name: value}))
    with pytest.raises(ssm.ConfigError) as set_later:
        setattr(module, name, value)
    assert str(set_later.value) == str(constructed.value)
    assert module.config == ssm.LatentAttention(**LATENT_BASE).config


def test_a_latent_config_is_validated_where_it_is_made() -> None:
    with pytest.raises(ssm.ConfigError, match=r"^LatentAttention\(d_model=32, num_heads=4\): d_rope=3 is odd"):
        ssm.LatentConfig(**(LATENT_BASE | {"d_rope": 3}))
    with pytest.raises(ssm.ConfigError, match=r"rope_theta must be a positive finite number .* but got None\.$"):
        ssm.LatentConfig(**(LATENT_BASE | {"rope_theta": None}))
    with pytest.raises(ssm.ConfigError, match=r"^LatentAttention\.from_config\(\): config must be a LatentConfig"):
        ssm.LatentAttention.from_config(ssm.AttentionConfig(32, 4))  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "value"), [("scale", 0.05), ("group", 2), ("native_shape", False)])
def test_what_a_module_derives_set_on_it_is_refused_naming_its_source(name: str, value: Any) -> None:
    """`scale`, `group` and `native_shape` follow the options and sizes: set directly, the scale was read by some paths
    and not torch's fused kernel (0.15 apart), and the others were undone by the next derivation."""
    module = ssm.MultiHeadAttention(32, 4)
    before = {n: getattr(module, n) for n in ("scale", "group", "native_shape")}
    with pytest.raises(ssm.ConfigError, match=rf"^MultiHeadAttention: {name} cannot be set: it is derived from "):
        setattr(module, name, value)
    assert {n: getattr(module, n) for n in before} == before


@pytest.mark.parametrize(
    ("options", "name", "make", "fits"),
    [
        ({}, "rotary", lambda: ssm.RotaryEmbedding(8, 10000.0), False),  # a NoPE module would ignore it
        ({"rope_theta": 1e4}, "rotary", lambda: ssm.RotaryEmbedding(8, 5e5), False),  # config.rope_theta would lie
        ({"rope_theta": 1e4}, "rotary", lambda: None, False),
        ({"rope_theta": 1e4}, "rotary", lambda: ssm.RotaryEmbedding(8, 1e4), True),
        ({}, "q_norm", lambda: torch.nn.RMSNorm(8), False),  # a module without a QK-norm would ignore it
        ({"qk_norm": True}, "k_norm", lambda: torch.nn.RMSNorm(8, eps=0.5), False),  # config.norm_eps would lie
        ({"qk_norm": True}, "k_norm", lambda: torch.nn.RMSNorm(8, eps=1e-6), True),
    ],
)
def test_a_part_replaced_on_a_built_module_fits_its_config_or_is_refused(
    options: dict[str, Any], name: str, make: Any, fits: bool
) -> None:
    """The submodules the options build (rotary tables, QK-norms), replaced: one the config describes is taken, and the
    module then equals one rebuilt from its config; any other is refused naming from_config, the module unchanged."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(32, 4, **options)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    if not fits:
        with pytest.raises(ssm.ConfigError, match=rf"^MultiHeadAttention: {name} cannot be replaced by this one: "):
            setattr(module, name, make())
        assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
        return
    setattr(module, name, make())
    rebuilt = ssm.MultiHeadAttention.from_config(module.config)
    rebuilt.load_state_dict(module.state_dict())
    _agree(module, rebuilt)


@pytest.mark.parametrize(
    ("name", "make", "fits"),
    [
        ("rotary", lambda: ssm.RotaryEmbedding(4, 5e5), False),  # config.rope_theta would lie
        ("rotary", lambda: ssm.RotaryEmbedding(4, 10000.0), True),
        ("q_a_layernorm", lambda: torch.nn.RMSNorm(12, eps=10.0), False),  # config.norm_eps would lie
        ("kv_a_layernorm", lambda: torch.nn.RMSNorm(8, eps=1e-6), True),
        ("kv_a_layernorm", lambda: None, False),
    ],
)
def test_a_latent_part_replaced_on_a_built_module_fits_its_config_or_is_refused(
    name: str, make: Any, fits: bool
) -> None:
    torch.manual_seed(0)
    module = ssm.LatentAttention(**LATENT_BASE)
    if not fits:
        with pytest.raises(ssm.ConfigError, match=rf"^LatentAttention: {name} cannot be replaced by this one: "):
            setattr(module, name, make())
        return
    setattr(module, name, make())
    rebuilt = ssm.LatentAttention.from_config(module.config)
    rebuilt.load_state_dict(module.state_dict())
    _agree(module, rebuilt)


def test_setting_anything_to_the_value_it_has_is_accepted_and_changes_nothing() -> None:
    """An override loop (`for k, v in options.items(): setattr(m, k, v)`) over the values a built object already has
    changes nothing and raises nothing, whether that attribute may be set to another value or not."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(**BASE, clip_qkv=2.0)
    latent = ssm.LatentAttention(**LATENT_BASE)
    rope = ssm.RotaryEmbedding(8, 10000.0)
    cache = module.new_cache(1, 8)
    for target, names in (
        (module, [*OPTIONS, "scale", "group", "native_shape", "rotary", "q_norm", "k_norm"]),
        (latent, [*LATENT_OPTIONS, "rotary", "kv_a_layernorm"]),
        (rope, ["d_head", "theta", "scaling", "interleaved"]),
        (cache, ["window"]),
    ):
        before, config = repr(target), getattr(target, "config", None)
        for name in names:
            setattr(target, name, getattr(config, name) if hasattr(config, name) else getattr(target, name))
        assert repr(target) == before
    rebuilt = ssm.MultiHeadAttention.from_config(module.config)
    rebuilt.load_state_dict(module.state_dict())
    _agree(module, rebuilt)


def test_a_config_is_a_copy_editing_it_leaves_the_module_as_it_was() -> None:
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    module = ssm.MultiHeadAttention(**BASE | {"rope_scaling": scaling})
    latent = ssm.LatentAttention(**LATENT_BASE, rope_scaling=scaling)
    for built in (module, latent):
        config = built.config
        assert config.rope_scaling is not None
        config.rope_scaling["factor"] = 8.0  # (a mapping inside a frozen config: still a mapping)
        assert built.config.rope_scaling == scaling


def test_a_module_pickles_and_copies_with_its_plan() -> None:
    """The plan's transforms are closures: not pickled, but made again from the config on the way back."""
    import copy
    import io
    import pickle

    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(**BASE, clip_qkv=2.0).eval()
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    copies = [pickle.loads(pickle.dumps(module)), copy.deepcopy(module), torch.load(buffer, weights_only=False)]
    for twin in copies:
        assert twin.config == module.config
        _agree(twin, module)


def test_a_norm_of_another_kind_than_the_config_builds_is_refused() -> None:
    """Gemma 3's QK-norm scales by `offset + weight` (`OffsetRMSNorm`): a plain `nn.RMSNorm` put in its place is a kind
    the library builds for another config, not the user's own part, and refused."""
    module = ssm.MultiHeadAttention(**BASE, qk_norm_offset=1.0)
    with pytest.raises(ssm.ConfigError, match=r"it is a RMSNorm, where the config builds a OffsetRMSNorm"):
        module.q_norm = torch.nn.RMSNorm(8, eps=1e-6)


def test_a_latent_module_with_parts_of_the_users_own_kind_still_describes_itself() -> None:
    class Tables(torch.nn.Module):
        def __init__(self, rotary: ssm.RotaryEmbedding) -> None:
            super().__init__()
            self.inner = rotary

        def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
            return self.inner(positions, dtype)

    latent = ssm.LatentAttention(**LATENT_BASE)
    before = latent.config
    latent.rotary = Tables(latent.rotary)
    latent.dropout = 0.1
    assert latent.config == dataclasses.replace(before, dropout=0.1) and "dropout=0.1" in repr(latent)


def test_a_latent_trace_config_takes_the_sizes_by_keyword() -> None:
    """`LatentTraceConfig` is a `LatentConfig`: past `d_model` and `num_heads`, positions would bind other sizes than
    they did before it was one, so they are refused rather than read silently another way."""
    with pytest.raises(TypeError, match="positional"):
        ssm.LatentTraceConfig(64, 8, 24, 16, 8, 4, 8)  # type: ignore[misc]
    config = ssm.LatentTraceConfig(64, 8, q_lora_rank=24, kv_lora_rank=16, d_nope=8, d_rope=4, d_value=8)
    assert ssm.LatentAttention.from_config(config).config == ssm.LatentConfig(
        64, 8, q_lora_rank=24, kv_lora_rank=16, d_nope=8, d_rope=4, d_value=8
    )


_ROUTES = {  # nn.Module's routes around __setattr__, each setting `name` to `value` (or removing it)
    "add_module": lambda module, name, value: module.add_module(name, value),
    "register_module": lambda module, name, value: module.register_module(name, value),
    "del": lambda module, name, value: delattr(module, name),
}


@pytest.mark.parametrize("route", list(_ROUTES))
@pytest.mark.parametrize(
    ("kind", "options", "name", "make"),
    [
        ("mha", {"rope_theta": 1e4}, "rotary", lambda: ssm.RotaryEmbedding(8, 5e5)),
        ("mha", {"rope_theta": 1e4}, "rotary", lambda: None),
        ("mha", {"qk_norm": True}, "q_norm", lambda: torch.nn.RMSNorm(8, eps=0.5)),
        ("mla", {}, "rotary", lambda: ssm.RotaryEmbedding(4, 5e5)),
        ("mla", {}, "kv_a_layernorm", lambda: torch.nn.RMSNorm(8, eps=0.5)),
    ],
)
def test_a_part_replaced_or_removed_around_setattr_is_refused_as_setting_it_is(
    route: str, kind: str, options: dict[str, Any], name: str, make: Any
) -> None:
    """`add_module`, `register_module` and `del` reach a module's parts without `__setattr__`: on a built module they
    are refused as setting the part is (`ConfigError` naming from_config), and the module is left as it was."""
    torch.manual_seed(0)
    module: Any = ssm.MultiHeadAttention(32, 4, **options) if kind == "mha" else ssm.LatentAttention(**LATENT_BASE)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    config, part = module.config, module._modules.get(name)
    with pytest.raises(ssm.ConfigError, match=rf"^{type(module).__name__}: {name} cannot be "):
        _ROUTES[route](module, name, make())
    assert module._modules.get(name) is part and module.config == config
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())


@pytest.mark.parametrize("route", ["add_module", "register_module"])
def test_a_fitting_part_added_around_setattr_is_taken_as_setting_it_is(route: str) -> None:
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(32, 4, rope_theta=1e4, qk_norm=True)
    _ROUTES[route](module, "k_norm", torch.nn.RMSNorm(8, eps=1e-6))
    rebuilt = ssm.MultiHeadAttention.from_config(module.config)
    rebuilt.load_state_dict(module.state_dict())
    _agree(module, rebuilt)


@pytest.mark.parametrize(
    ("kind", "norms"), [("mha", ("q_norm", "k_norm")), ("mla", ("q_a_layernorm", "kv_a_layernorm"))]
)
def test_a_norms_eps_set_on_the_part_is_followed_by_the_config_or_the_config_refuses(
    kind: str, norms: tuple[str, str]
) -> None:
    """A torch norm's `eps` is a plain attribute the module cannot see set: its config reads it from the parts, so a
    module rebuilt from it computes what the edited one does; parts left disagreeing cannot be one `norm_eps`."""
    torch.manual_seed(0)
    module: Any = ssm.MultiHeadAttention(**BASE) if kind == "mha" else ssm.LatentAttention(**LATENT_BASE)
    getattr(module, norms[0]).eps = 0.5
    disagree = rf"{norms[0]}\.eps=0\.5, {norms[1]}\.eps=1e-06: its config holds one norm_eps"
    with pytest.raises(ssm.ConfigError, match=disagree):
        module.config  # noqa: B018
    getattr(module, norms[1]).eps = 0.5
    assert module.config.norm_eps == 0.5
    rebuilt = type(module).from_config(module.config)
    rebuilt.load_state_dict(module.state_dict())
    _agree(module, rebuilt)


def test_heads_pruned_part_by_part_sizes_then_parts_equal_a_module_of_the_pruned_sizes() -> None:
    """Head pruning by hand on a module with per-head QK-norms: the projections and sizes set, then norms of the new
    sizes, compute what a module built with those sizes and loaded with the kept rows computes. A norm set before the
    sizes is refused saying the order; a call between the sizes and the norms is a ShapeError naming the norm."""
    from shapesafe_mha._compute.norms import HeadNorm

    torch.manual_seed(0)
    options = {"d_head": 8, "rope_theta": 1e4, "qk_norm": True, "qk_norm_over": "per_head"}
    module = ssm.MultiHeadAttention(32, 4, **options).double().eval()
    keep = [0, 2]
    rows = torch.cat([torch.arange(h * 8, h * 8 + 8) for h in keep])

    def norm(old: Any) -> HeadNorm:
        new = HeadNorm(2, 8, 1e-6, False, dtype=torch.float64)
        new.weight.data = old.weight.data[keep].clone()
        return new

    pruned = ssm.MultiHeadAttention(32, 2, **options).double().eval()
    state = {}  # the kept heads' rows: of Q/K/V, their norms' weights, and o_proj's columns
    for key, value in module.state_dict().items():
        part = key.split(".")[0]
        by_rows = part in ("q_proj", "k_proj", "v_proj")
        state[key] = value[rows] if by_rows else value[keep] if "norm" in part else value
    state["o_proj.weight"] = module.o_proj.weight.detach()[:, rows]
    pruned.load_state_dict(state)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        setattr(module, name, getattr(pruned, name))
    with pytest.raises(ssm.ConfigError, match=r"pruning heads\? set the sizes first"):
        module.q_norm = norm(module.q_norm)
    module.num_heads = module.num_kv_heads = 2
    with pytest.raises(ssm.ShapeError, match=r"q_norm\.weight has shape \(4, 8\), but q .* needs \(2, 8\)"):
        module(torch.randn(1, 5, 32, dtype=torch.float64), is_causal=True)
    module.q_norm, module.k_norm = norm(module.q_norm), norm(module.k_norm)
    assert module.config == pruned.config
    _agree(module, pruned)


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
def test_a_torch_norms_normalized_shape_set_alone_is_a_shape_error_naming_it(warm: bool) -> None:
    """Every torch norm the modules build (QK-norms over a head and over all heads, MLA's two bottleneck norms)
    normalises over `normalized_shape` and scales by its weight: one set alone is a ShapeError naming
    `<norm>.normalized_shape` (fresh, or on a module whose call is remembered), and set back the module computes
    what it computed before."""
    cases = [
        (ssm.MultiHeadAttention(32, 4, qk_norm=True), "q_norm"),
        (ssm.MultiHeadAttention(32, 4, 2, qk_norm=True, qk_norm_over="all"), "k_norm"),
        (ssm.LatentAttention(**LATENT_BASE), "q_a_layernorm"),
        (ssm.LatentAttention(**LATENT_BASE), "kv_a_layernorm"),
    ]
    for module, name in cases:
        module = module.double().eval()
        x = torch.randn(2, 5, module.d_model, dtype=torch.float64)
        before = module(x, is_causal=True) if warm else None
        norm = getattr(module, name)
        kept = norm.normalized_shape
        norm.normalized_shape = (*kept[:-1], kept[-1] + 1)
        with pytest.raises(ssm.ShapeError, match=rf"{name}\.normalized_shape is \(.*\), but {name}\.weight"):
            module(x, is_causal=True)
        norm.normalized_shape = kept
        after = module(x, is_causal=True)
        if before is not None:
            torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_norms_of_the_users_own_kind_keep_their_eps_and_the_config_its_norm_eps() -> None:
    """A norm of the user's own kind is theirs (its results checked each call): its `eps` is not the config's, so
    both norms replaced by LayerNorms of another eps leave `config.norm_eps` and options settable as they were."""
    for module, names in (
        (ssm.MultiHeadAttention(**BASE), ("q_norm", "k_norm")),
        (ssm.LatentAttention(**LATENT_BASE), ("q_a_layernorm", "kv_a_layernorm")),
    ):
        width = {n: getattr(module, n).weight.shape[-1] for n in names}
        for name in names:
            setattr(module, name, torch.nn.LayerNorm(width[name], eps=1e-5))
        assert module.config.norm_eps == 1e-6 and repr(module)
        module.dropout = 0.1
        assert module.config.dropout == 0.1


def test_what_else_a_built_part_holds_is_refused_or_read_back() -> None:
    """A built part's other values: the offset of Gemma's norm and the centring of Cohere's are refused (the module's
    config describes them); with differential attention, whose own norm holds `norm_eps`, QK-norms set to another eps
    leave no one `norm_eps`, and reading the config says so."""
    gemma = ssm.MultiHeadAttention(**BASE, qk_norm_offset=1.0)
    with pytest.raises(ssm.ConfigError, match=r"^OffsetRMSNorm: offset cannot be set on a built norm"):
        gemma.q_norm.offset = 2.0
    cohere = ssm.MultiHeadAttention(**BASE, qk_norm_over="per_head")
    with pytest.raises(ssm.ConfigError, match=r"^HeadNorm: centred cannot be set on a built norm"):
        cohere.k_norm.centred = True
    both = ssm.MultiHeadAttention(**BASE, differential_lambda_init=0.8)
    both.q_norm.eps = both.k_norm.eps = 0.5
    with pytest.raises(ssm.ConfigError, match=r"differential attention's norm holds norm_eps=1e-06"):
        both.config  # noqa: B018


@pytest.mark.parametrize("name", ["sinks", "alibi_slopes", "lambda_q1"])
def test_a_variant_tensor_parametrized_is_refused_not_dropped(name: str) -> None:
    """`register_parametrization` deletes the tensor first: a module then neither held it nor described it (its sinks
    dropped silently, 0.396 off). Deleting one of a built module's variant tensors is refused, the module unchanged."""
    from torch.nn.utils import parametrize

    options = {"sinks": {"attention_sinks": True}, "alibi_slopes": {"alibi": True},
               "lambda_q1": {"differential_lambda_init": 0.8}}[name]  # fmt: skip
    module = ssm.MultiHeadAttention(32, 4, **options)
    config = module.config

    class Twice(torch.nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return 2 * t

    with pytest.raises(ssm.ConfigError, match=rf"^MultiHeadAttention: {name} cannot be deleted"):
        parametrize.register_parametrization(module, name, Twice())
    assert module.config == config and not parametrize.is_parametrized(module)


def test_a_module_whose_projection_weight_is_int8_makes_caches_of_its_float_kind() -> None:
    """An int8 weight (bitsandbytes' layout) is not the kind the module computes in: its caches take the dtype of
    the module's floating tensors."""
    for module, projection in (
        (ssm.MultiHeadAttention(32, 4, 2, dtype=torch.float64), "k_proj"),
        (ssm.LatentAttention(**LATENT_BASE, dtype=torch.float64), "kv_a_proj_with_mqa"),
    ):
        part = getattr(module, projection)
        part.weight = torch.nn.Parameter(part.weight.detach().to(torch.int8), requires_grad=False)
        assert module.new_cache(1, 4).dtype == torch.float64
        assert ssm.PagedKVCache.for_module(module, num_blocks=2, block_size=4).dtype == torch.float64
