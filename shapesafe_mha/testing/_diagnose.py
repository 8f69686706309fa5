"""Name the bug class of a failed check: which variant of the reference the wrong output matches.

A wrong output that equals the reference computed *with one classic mistake* (KV heads tiled,
the causal mask shifted, RoPE turned the wrong way, ...) is that mistake, whatever the code looks
like. Each variant is the reference with one argument changed, so a match is evidence, not a guess.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor

from .._compute.reference import KVHeads, MaskMod, ScoreMod, per_head_attention
from .._core.errors import ConfigError
from .._core.weights import AttentionWeights
from .._modules.config import BUILT_FROM, AttentionConfig, of_reference
from .._modules.config import described as option_described

# Below this a float64 deviation is float32 rounding, not a wrong formula (float32's epsilon is 1.2e-7).
FLOAT32_INSIDE = 1e-5


@dataclass(frozen=True)
class Tolerance:
    """`|got - expected| <= atol + rtol * |expected|` elementwise, as `torch.allclose`."""

    atol: float
    rtol: float = 0.0

    def excess(self, got: Tensor, expected: Tensor) -> Tensor:
        """How far each element is beyond the tolerance (NaN where either is NaN: compare with `<= 0`)."""
        deviation = (got.double() - expected.double()).abs()
        return deviation - self.atol - self.rtol * expected.double().abs()

    def holds(self, got: Tensor, expected: Tensor) -> bool:
        if got.shape != expected.shape:
            return False
        return not got.numel() or self.excess(got, expected).max().item() <= 0

    def __str__(self) -> str:
        return f"tolerance {self.atol:g}" if not self.rtol else f"tolerance atol={self.atol:g}, rtol={self.rtol:g}"


@dataclass(frozen=True)
class Scenario:
    """Everything the reference needs for one example, in float64: one call of `per_head_attention`, the layer
    described by `config` (its sizes and options), the tensors of its options in `tensors` by the reference's
    keywords (and those of what a transformers layer computes beyond the options, `out_norm`, `qk_norm_bias`).
    `Scenario.of` builds one from the reference's keyword form."""

    query: Tensor
    key: Tensor
    value: Tensor
    weights: AttentionWeights
    config: AttentionConfig
    is_causal: bool = False
    attn_mask: Tensor | None = None
    key_padding_mask: Tensor | None = None
    positions: Tensor | None = None
    key_positions: Tensor | None = None
    kv_heads: KVHeads = "grouped"
    scale: float | None = None
    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Any] = field(default_factory=dict)
    # how the code merged the heads `(batch, seq, num_heads * d_head)` before W_O, where a mistake did it its own way
    merge: Callable[[Tensor], Tensor] | None = None

    @classmethod
    def of(cls, query: Tensor, key: Tensor, value: Tensor, weights: AttentionWeights, **keywords: Any) -> "Scenario":
        """The scenario of `per_head_attention(query, key, value, weights, **keywords)`: its config the one the
        keywords describe, each keyword not a field here (an option's tensors) one of `tensors`."""
        config, rest = of_reference(weights, **keywords)
        own = {f.name for f in fields(cls)}
        tensors = {name: value for name, value in rest.items() if name not in own and value is not None}
        return cls(query, key, value, weights, config, **{k: v for k, v in rest.items() if k in own}, tensors=tensors)

    def expected(self) -> Tensor:
        if self.merge is not None:  # the heads merged right (W_O the identity), merged the code's way, then W_O
            w_o, b_o = self.weights.w_o, self.weights.b_o
            eye = torch.eye(w_o.shape[1], dtype=w_o.dtype, device=w_o.device)
            heads = replace(self, merge=None, weights=replace(self.weights, w_o=eye, b_o=None)).expected()
            return torch.nn.functional.linear(self.merge(heads), w_o, b_o)
        # every other field is the reference's keyword of the same name
        passed = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_PASSED}
        return per_head_attention(self.query, self.key, self.value, self.weights, self.config, **passed, **self.tensors)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.config.kv_heads

    @property
    def d_head(self) -> int:
        return self.config.head_width


# the call's tensors, its config and the options' tensors (passed apart); not the reference's keywords
_NOT_PASSED = ("query", "key", "value", "weights", "config", "extra", "tensors", "merge")


def _causal_shifted(s: Scenario, shift: int) -> Tensor:
    """A bool mask, True = may attend: lower-right aligned causal, each query seeing `shift` more keys."""
    seq, kv_seq = s.query.shape[1], s.key.shape[1]
    return torch.ones(seq, kv_seq, dtype=torch.bool).tril(kv_seq - seq + shift)


def _merge_dh(w: AttentionWeights, num_heads: int, d_head: int) -> AttentionWeights:
    """W_O as seen by code that merges heads as `(d_head num_heads)` instead of `(num_heads d_head)`."""
    order = torch.arange(num_heads * d_head).view(d_head, num_heads).T.reshape(-1)
    return replace(w, w_o=w.w_o[:, order])


def _positions(s: Scenario) -> tuple[Tensor, Tensor]:
    batch, seq, kv_seq = s.query.shape[0], s.query.shape[1], s.key.shape[1]
    q = torch.arange(seq).expand(batch, seq) if s.positions is None else s.positions
    if s.key_positions is not None:
        return q, s.key_positions
    return q, q if kv_seq == seq else torch.arange(kv_seq).expand(batch, kv_seq)


Variant = tuple[str, str, Callable[[Scenario], Scenario]]


def _score_mod_heads(mod: ScoreMod, heads: Callable[[Tensor], Tensor]) -> ScoreMod:
    """`mod` given another head index than the query head's."""
    return lambda score, b, h, q_idx, kv_idx: mod(score, b, heads(h), q_idx, kv_idx)


def _mod_variants(s: Scenario) -> list[Variant]:
    """The classic mistakes of code that applies a score_mod or a mask_mod (FlexAttention's signatures)."""
    out: list[Variant] = []
    group, num_kv_heads, last = s.num_heads // s.num_kv_heads, s.num_kv_heads, s.num_heads - 1
    if s.score_mod is not None:
        mod = s.score_mod
        out.append(("score_mod", "score_mod not applied", lambda t: replace(t, score_mod=None)))
        if s.num_kv_heads != s.num_heads:
            out.append(
                (
                    "score_mod",
                    "score_mod given the KV head index (h // group) instead of the query head h: "
                    "a per-head parameter (temperature, slope) indexed per KV head",
                    lambda t: replace(t, score_mod=_score_mod_heads(mod, lambda h: h // group)),
                )
            )
            if s.num_kv_heads > 1:
                out.append(
                    (
                        "score_mod",
                        "score_mod given h % num_kv_heads instead of the query head h",
                        lambda t: replace(t, score_mod=_score_mod_heads(mod, lambda h: h % num_kv_heads)),
                    )
                )
        if s.num_heads > 1:
            out.append(
                (
                    "score_mod",
                    "score_mod's heads in reverse order (h read as num_heads - 1 - h: ALiBi's slopes reversed?)",
                    lambda t: replace(t, score_mod=_score_mod_heads(mod, lambda h: last - h)),
                )
            )
        out.append(
            (
                "score_mod",
                "score_mod's change to the scores negated (a bias with the wrong sign: ALiBi's distance reversed?)",
                lambda t: replace(t, score_mod=lambda score, *idx: 2 * score - mod(score, *idx)),
            )
        )
        out.append(
            (
                "score_mod",
                "score_mod given q_idx and kv_idx swapped",
                lambda t: replace(t, score_mod=lambda score, b, h, q, kv: mod(score, b, h, kv, q)),
            )
        )
    if s.mask_mod is not None:
        allowed = s.mask_mod
        out.append(("mask_mod", "mask_mod not applied", lambda t: replace(t, mask_mod=None)))
        out.append(
            (
                "mask_mod",
                "mask_mod negated (True taken as masked out; FlexAttention's True = may attend)",
                lambda t: replace(t, mask_mod=lambda *idx: ~allowed(*idx).to(torch.bool)),
            )
        )
        out.append(
            (
                "mask_mod",
                "mask_mod given q_idx and kv_idx swapped",
                lambda t: replace(t, mask_mod=lambda b, h, q, kv: allowed(b, h, kv, q)),
            )
        )
        if s.num_kv_heads != s.num_heads:
            out.append(
                (
                    "mask_mod",
                    "mask_mod given the KV head index (h // group) instead of the query head h",
                    lambda t: replace(t, mask_mod=lambda b, h, q, kv: allowed(b, h // group, q, kv)),
                )
            )
    return out


def variants(s: Scenario) -> list[Variant]:
    """(bug class, description, how the scenario changes) for each mistake that applies to `s`."""
    out: list[Variant] = _mod_variants(s)
    other: KVHeads = "interleaved" if s.kv_heads == "grouped" else "grouped"
    if s.num_kv_heads not in (1, s.num_heads):
        if other == "interleaved":
            why = (
                "KV heads tiled: query head i reads KV head i % num_kv_heads (`repeat` where `repeat_interleave` "
                'was meant); if that is your convention (x-transformers), pass kv_heads="interleaved"'
            )
        else:
            why = (
                "query head i reads KV head i // group (transformers' repeat_kv, torch's enable_gqa), "
                'not i % num_kv_heads; if that is your convention, pass kv_heads="grouped"'
            )
        out.append(("heads", why, lambda t: replace(t, kv_heads=other)))
    if s.num_heads > 1 and s.query.shape[1] > 1 and s.tensors.get("out_norm") is None:
        heads = s.num_heads

        def unmoved(merged: Tensor) -> Tensor:  # `out.reshape(b, s, -1)` of `out` (b, h, s, d): no transpose
            b, seq, inner = merged.shape
            return merged.view(b, seq, heads, inner // heads).transpose(1, 2).reshape(b, seq, inner)

        out.append(
            (
                "heads",
                "heads merged without the transpose: (batch, num_heads, seq, d_head) reshaped to "
                "(batch, seq, num_heads * d_head), which mixes positions across heads",
                lambda t: replace(t, merge=unmoved),
            )
        )
    if s.num_heads > 1 and s.d_head > 1:
        out.append(
            (
                "heads",
                "heads merged in (d_head num_heads) order: a reshape without the transpose back",
                lambda t: replace(t, weights=_merge_dh(t.weights, t.num_heads, t.d_head)),
            )
        )
    d_model = s.weights.d_model
    if d_model != s.d_head:
        out.append(
            (
                "scaling",
                "scores scaled by 1/sqrt(d_model) instead of 1/sqrt(d_head)",
                lambda t: replace(t, scale=d_model**-0.5),
            )
        )
    if s.d_head > 1:
        out.append(("scaling", "scores not scaled by 1/sqrt(d_head)", lambda t: replace(t, scale=1.0)))
    out.append(
        (
            "k/v",
            "k and v swapped (keys from the value projection and values from the key projection)",
            lambda t: replace(
                t,
                weights=replace(t.weights, w_k=t.weights.w_v, w_v=t.weights.w_k, b_k=t.weights.b_v, b_v=t.weights.b_k),
            ),
        )
    )
    for role in "qkvo":
        if getattr(s.weights, f"b_{role}") is not None:
            out.append(
                (
                    "bias",
                    f"the {role} projection's bias not added",
                    lambda t, role=role: replace(t, weights=replace(t.weights, **{f"b_{role}": None})),
                )
            )
    if s.is_causal and s.attn_mask is None:
        out.append(("mask", "no causal mask: every query sees every key", lambda t: replace(t, is_causal=False)))
        out.append(
            (
                "mask",
                "causal mask shifted by one: each query also sees the next key",
                lambda t: replace(t, is_causal=False, attn_mask=_causal_shifted(t, 1)),
            )
        )
        out.append(
            (
                "mask",
                "causal mask shifted by one: no query sees its own key",
                lambda t: replace(t, is_causal=False, attn_mask=_causal_shifted(t, -1)),
            )
        )
    elif not s.is_causal and s.attn_mask is None:
        out.append(("mask", "a causal mask applied where none was asked for", lambda t: replace(t, is_causal=True)))
    if s.key_padding_mask is not None or s.extra.get("padding"):
        out.append(
            (
                "padding/mask",
                "padding ignored: padded keys are attended to",
                lambda t: replace(t, key_padding_mask=None, extra={**t.extra, "padding": False}),
            )
        )
    if s.config.rotated_width is not None:  # RoPE's mistakes that no option's value makes
        q_at, k_at = _positions(s)
        out.append(
            (
                "RoPE/positions",
                "RoPE turned the wrong way (the sign of sin, or of rotate_half)",
                lambda t: replace(t, positions=-q_at, key_positions=-k_at),
            )
        )
        out.append(
            (
                "RoPE/positions",
                "RoPE positions of the queries off by one against the keys'",
                lambda t: replace(t, positions=q_at + 1, key_positions=k_at),
            )
        )
    return out + _option_variants(s) + _layer_variants(s)


_DEFAULTS = {f.name: f.default for f in fields(AttentionConfig)}


def _what(name: str) -> str:
    """What the option `name` is, in its description's first words (in parentheses), or ""."""
    words = re.split(r"[:;]| \(", option_described(name), maxsplit=1)[0].strip()
    return f" ({words})" if len(words) > 12 else ""


def _default(config: AttentionConfig, name: str) -> AttentionConfig:
    """`config` with the option `name` at its default, and where the config then refuses (RoPE's part without
    RoPE), every option of the same part (`BUILT_FROM`) at its default too."""
    try:
        return replace(config, **{name: _DEFAULTS[name]})
    except ConfigError:
        part = BUILT_FROM.get(name)
        return replace(config, **{other: _DEFAULTS[other] for other, of in BUILT_FROM.items() if of == part})


def _option_variants(s: Scenario) -> list[Variant]:
    """The layer's options, derived from its config: each option that differs from its default, not applied (its
    default instead); each flag at its default of a part the layer has (RoPE's pairs, the QK-norm's kind and
    place: `BUILT_FROM`), set the other way."""
    on = s.config.variants()
    out: list[Variant] = [
        (
            name,
            f"{name}={value!r} not applied{_what(name)}",
            lambda t, name=name: replace(t, config=_default(t.config, name)),
        )
        for name, value in on.items()
    ]
    parts = {BUILT_FROM[name] for name in on if name in BUILT_FROM}
    for name, default in _DEFAULTS.items():
        if default is False and getattr(s.config, name) is False and BUILT_FROM.get(name) in parts:
            try:
                replace(s.config, **{name: True})
            except ConfigError:  # not beside the part's other options (a centred norm after RoPE)
                continue
            out.append((name, f"{name}=True where False was asked{_what(name)}",
                        lambda t, name=name: replace(t, config=replace(t.config, **{name: True}))))  # fmt: skip
    return out


def _layer_variants(s: Scenario) -> list[Variant]:
    """Mistakes in what a layer computes beyond plain attention that no option's default or other value makes."""
    out: list[Variant] = []
    if s.config.window is not None:
        longer = s.config.window + 1
        out.append(("window", "sliding window one key longer",
                    lambda t: replace(t, config=replace(t.config, window=longer))))  # fmt: skip
    slopes = s.tensors.get("alibi_slopes")
    if slopes is not None:
        reversed_slopes = slopes.flip(0)
        out.append(("ALiBi", "ALiBi slopes in the reverse head order",
                    lambda t: replace(t, tensors={**t.tensors, "alibi_slopes": reversed_slopes})))  # fmt: skip
    if s.tensors.get("out_norm") is not None:
        out.append(("output norm", "the merged heads' norm not applied",
                    lambda t: replace(t, tensors={k: v for k, v in t.tensors.items() if k != "out_norm"})))  # fmt: skip
    if s.scale is not None and s.d_head > 1:
        d_head = s.d_head
        out.append(("scaling", "scores scaled by 1/sqrt(d_head), not the config's scale",
                    lambda t: replace(t, scale=d_head**-0.5)))  # fmt: skip
    return out


def name_bug(
    got: Tensor, scenario: Scenario, tolerance: Tolerance, rows: Tensor | None = None
) -> list[tuple[str, str]]:
    """The (bug class, description) of every variant of the reference that `got` matches."""
    found = []
    for kind, description, change in variants(scenario):
        try:
            expected = change(scenario).expected()
        except Exception:  # a variant that does not apply to these sizes
            continue
        if rows is not None:
            expected = expected[rows]
        if tolerance.holds(got, expected):
            found.append((kind, description))
    return found


def describe_matches(matches: list[tuple[str, str]]) -> str:
    """One report line naming the bug class (empty when no variant matched)."""
    if not matches:
        return ""
    kinds = sorted({kind for kind, _ in matches}, key=[kind for kind, _ in matches].index)
    return f"bug class: {' or '.join(kinds)}: the output matches the reference with " + "; or with ".join(
        description for _, description in matches
    )


def locate_heads(
    run: Callable[[AttentionWeights], Tensor],
    scenario: Scenario,
    tolerance: Tolerance,
    rows: Tensor | None = None,
) -> str:
    """Which heads are wrong, found by running the code with W_O restricted to one head at a time."""
    wrong = []
    d_head, num_heads = scenario.d_head, scenario.num_heads
    for head in range(num_heads):
        keep = torch.zeros_like(scenario.weights.w_o)
        columns = slice(head * d_head, (head + 1) * d_head)
        keep[:, columns] = scenario.weights.w_o[:, columns]
        no_bias = None if scenario.weights.b_o is None else torch.zeros_like(scenario.weights.b_o)
        isolated = replace(scenario.weights, w_o=keep, b_o=no_bias)
        try:
            got = run(isolated)
            expected = replace(scenario, weights=isolated).expected()
            if rows is not None:
                expected = expected[rows]
            if not tolerance.holds(got.double(), expected):
                wrong.append(head)
        except Exception:
            wrong.append(head)
    if not wrong:
        return "no single head is wrong on its own: the error is in how heads are combined (merge or W_O)"
    if len(wrong) == num_heads:
        return f"every head ({num_heads}) is wrong"
    return f"wrong heads: {wrong} of {num_heads}"
