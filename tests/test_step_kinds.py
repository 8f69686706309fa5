"""Variants on every step kind: each variant of `AttentionConfig` computes one function, however the sequence is fed.

For each variant (QK-norm in each form, RoPE full, partial and interleaved, a window, chunks, a softcap, sinks,
ALiBi, an output gate, clip_qkv, temperature tuning, a query scalar) and each of MHA, GQA and MQA, a drawn
sequence is fed four ways: in one prefill; a token at a time through a cache; in chunks of several tokens; and as
a left-padded batch (a key_padding_mask, each sequence's own positions), in one prefill and in chunks. Every way
equals the per-head reference of the whole sequence (causal: a call's queries see no later key, so their rows are
the whole sequence's), and the decoding ways equal the one-shot prefill of the whole sequence. Each example runs
with or without autograd (separate or fused projections) and with GQA on torch's kernel or folded
(`kernels.native_gqa` forced no: the route of the devices not measured, CUDA's), so a variant is checked on each
scorer.
"""

import contextlib
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_variants import _module, _reference  # the variants' module and reference, as test_variants builds them

from shapesafe_mha._compute import kernels as _kernels
from shapesafe_mha.testing import attention_configs, attention_inputs

F64: dict[str, Any] = {"atol": 1e-10, "rtol": 1e-8}
OFF: dict[str, Any] = {
    "qk_norm": False, "qk_norm_over": "head", "qk_norm_centred": False, "qk_norm_offset": 0.0,
    "qk_norm_after_rope": False, "window": None, "logit_softcap": None, "query_pre_attn_scalar": None,
    "attention_sinks": False, "alibi": False, "output_gate": False, "clip_qkv": None, "temperature_tuning": None,
    "chunk_size": None, "rope_share": None, "rope_interleaved": False,
}  # fmt: skip
# Each variant: its options, and whether it needs RoPE (None: drawn with or without).
VARIANTS: dict[str, tuple[dict[str, Any], bool | None]] = {
    "qk_norm": ({"qk_norm": True}, None),
    "qk_norm over all heads": ({"qk_norm": True, "qk_norm_over": "all"}, None),
    "qk_norm per head, centred": ({"qk_norm": True, "qk_norm_over": "per_head", "qk_norm_centred": True}, None),
    "qk_norm with an offset": ({"qk_norm": True, "qk_norm_offset": 1.0}, None),
    "qk_norm after rope": ({"qk_norm": True, "qk_norm_after_rope": True}, True),
    "rotary": ({}, True),
    "partial rotary": ({"rope_share": 0.5}, True),
    "interleaved rotary": ({"rope_interleaved": True}, True),
    "window": ({"window": 3}, None),
    "chunk_size": ({"chunk_size": 3}, None),
    "logit_softcap": ({"logit_softcap": 0.5}, None),
    "sinks": ({"attention_sinks": True}, None),
    "alibi": ({"alibi": True}, None),
    "output_gate": ({"output_gate": True}, None),
    "clip_qkv": ({"clip_qkv": 0.3}, None),
    "temperature_tuning": ({"temperature_tuning": (2, 0.5)}, None),
    "query_pre_attn_scalar": ({"query_pre_attn_scalar": 3.0}, None),
}
KINDS = ("mha", "gqa", "mqa")


def _fed(module: Any, x: torch.Tensor, ends: list[int], padding: Any, positions: Any) -> torch.Tensor:
    """The sequence fed through a cache in calls ending at `ends` (causal), each call's mask and positions cut."""
    cache = module.new_cache(x.shape[0], max(x.shape[1], module.window or 0))
    outs, start = [], 0
    for end in ends:
        kwargs: dict[str, Any] = {"is_causal": True, "kv_cache": cache}
        if padding is not None:
            kwargs["key_padding_mask"] = padding[:, :end]
        if positions is not None:
            kwargs["positions"] = positions[:, start:end]
        outs.append(module(x[:, start:end], **kwargs))
        start = end
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_variant_equals_the_reference_and_its_prefill_on_every_step_kind(variant: str) -> None:
    changed, rope = VARIANTS[variant]
    options = {**OFF, **changed}

    @settings(max_examples=max(3, settings().max_examples // 12), database=None)
    @given(data=st.data())
    def feed(data: st.DataObject) -> None:
        grad = data.draw(st.booleans(), label="grad")
        folded = data.draw(st.booleans(), label="GQA folded")
        with_rope = data.draw(st.booleans(), label="rope") if rope is None else rope
        for kind in KINDS:
            config = data.draw(
                attention_configs((kind,), cross=False, max_seq=8, max_heads=4, rope=with_rope), label=kind
            )
            module = _module(config, options, data)
            x = data.draw(attention_inputs(config)).query
            seq = config.seq
            step = data.draw(st.integers(2, 4), label="chunk")
            lengths = data.draw(st.lists(st.integers(1, seq), min_size=config.batch, max_size=config.batch))
            padding = torch.arange(seq)[None, :] < torch.tensor([seq - n for n in lengths])[:, None]  # left pad
            positions = (~padding).long().cumsum(1).sub(1).clamp(min=0)  # each sequence's own, from 0
            positions = positions if with_rope else None  # (only RoPE reads them; a module without refuses them)
            ways = {  # name: (the calls' ends, key_padding_mask, positions)
                "prefill": ([seq], None, None),
                "a token at a time": (list(range(1, seq + 1)), None, None),
                "chunks": (sorted({*range(step, seq, step), seq}), None, None),
                "left-padded, prefill": ([seq], padding, positions),
                "left-padded, chunks": (sorted({*range(step, seq, step), seq}), padding, positions),
            }
            patch = pytest.MonkeyPatch.context() if folded else contextlib.nullcontext()
            with patch as patching, torch.set_grad_enabled(grad):
                if patching is not None:
                    patching.setattr(_kernels, "native_gqa", lambda *args: False)
                got = {way: _fed(module, x, ends, mask, where) for way, (ends, mask, where) in ways.items()}
            # causal: a call's queries see no key after their own, so its reference is the whole sequence's rows
            expected = {
                False: _reference(module, x, options, is_causal=True),
                True: _reference(module, x, options, is_causal=True, key_padding_mask=padding, positions=positions),
            }
            for way, (_, mask, _) in ways.items():
                padded = mask is not None
                where = f"{kind}, {way}"
                torch.testing.assert_close(
                    got[way], expected[padded], **F64, msg=lambda m, w=where: f"{w} vs the reference: {m}"
                )
                one_shot = got["left-padded, prefill" if padded else "prefill"]
                torch.testing.assert_close(got[way], one_shot, **F64, msg=lambda m, w=where: f"{w} vs the prefill: {m}")

    feed()
