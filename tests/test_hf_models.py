"""Whole Hugging Face models checked as they run: `attn_implementation="shapesafe"` equals transformers' own.

Tiny causal LMs built from their configs (random weights, no downloads): logits, left-padded batches,
greedy and beam-search generation, training and torch.compile, each against "sdpa" (or "eager" where
only eager computes the variant: Gemma 2's softcap, gpt-oss's sinks). A layer whose tensors disagree
with its config is named with the field; a keyword argument we do not compute is refused by name.
"""

import copy
from typing import Any

import pytest
import torch
from torch import nn

import shapesafe_mha as ssm

transformers = pytest.importorskip("transformers")
import shapesafe_mha.hf  # noqa: E402

SIZES = {
    "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
    "num_hidden_layers": 2, "vocab_size": 101, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
}  # fmt: skip
# architecture: (config class, extra config, reference implementation, dtype, tolerance)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any], str, torch.dtype, float]] = {
    "llama": ("LlamaConfig", {}, "sdpa", torch.float64, 1e-10),
    "qwen2": ("Qwen2Config", {}, "sdpa", torch.float64, 1e-10),
    "qwen3": ("Qwen3Config", {}, "sdpa", torch.float64, 1e-10),
    "mistral (sliding window 3)": ("MistralConfig", {"sliding_window": 3}, "sdpa", torch.float64, 1e-10),
    "phi3": ("Phi3Config", {}, "sdpa", torch.float64, 1e-10),
    # eager takes the softmax in float32 inside: a float32-rounding tolerance
    "gemma2 (softcap, window 3)": (
        "Gemma2Config", {"sliding_window": 3, "attn_logit_softcapping": 5.0}, "eager", torch.float64, 1e-6
    ),
    # gpt-oss's experts run in float32 only (grouped matrix multiply)
    "gpt_oss (sinks, window 3)": (
        "GptOssConfig", {"sliding_window": 3, "num_local_experts": 4, "num_experts_per_tok": 2}, "eager",
        torch.float32, 1e-5,
    ),
}  # fmt: skip


def _pair(architecture: str) -> tuple[Any, Any]:
    """The reference model and ours, with the same weights (each its own config: from_config sets the
    attention implementation on the config it is given)."""
    config_name, extra, reference, dtype, _ = ARCHITECTURES[architecture]
    config = getattr(transformers, config_name)(**SIZES, **extra)
    shapesafe_mha.hf.register()
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference,
                                                           dtype=dtype).eval()  # fmt: skip
    if hasattr(theirs.model.layers[0].self_attn, "sinks"):
        with torch.no_grad():
            for layer in theirs.model.layers:
                layer.self_attn.sinks.normal_(0, 1)  # sinks that matter
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="shapesafe",
                                                         dtype=dtype).eval()  # fmt: skip
    ours.load_state_dict(theirs.state_dict())
    assert ours.config._attn_implementation == "shapesafe" and theirs.config._attn_implementation == reference
    return theirs, ours


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 101, (2, 9), generator=generator)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_logits_padded_batches_and_generation_equal_transformers_own(architecture: str) -> None:
    theirs, ours = _pair(architecture)
    tolerance = ARCHITECTURES[architecture][4]
    ids, mask = _batch()
    with torch.no_grad():
        assert float((ours(ids).logits - theirs(ids).logits).abs().max()) <= tolerance
        if architecture.startswith("gemma2"):  # transformers' eager Gemma 2 gives NaN for padding in float64
            theirs, ours = theirs.float(), ours.float()
            tolerance = 1e-5
        padded = (ours(ids, attention_mask=mask).logits - theirs(ids, attention_mask=mask).logits)[mask.bool()]
        assert float(padded.abs().max()) <= tolerance
        for options in ({}, {"num_beams": 2}):
            expected = theirs.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **options)
            got = ours.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **options)
            assert torch.equal(got, expected), options


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_training_loss_and_gradients_equal_and_compile_equals_eager(architecture: str) -> None:
    theirs, ours = _pair(architecture)
    tolerance = ARCHITECTURES[architecture][4]
    ids, mask = _batch()
    if architecture.startswith("gemma2"):  # transformers' eager Gemma 2 gives NaN for padding in float64
        mask = None
    losses = []
    for model in (theirs, ours):
        model.train()
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], atol=tolerance, rtol=0)
    for (name, mine), (_, other) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        if other.grad is None:  # a parameter the loss does not reach (gpt-oss's unrouted experts)
            assert mine.grad is None or not mine.grad.any(), name
            continue
        torch.testing.assert_close(mine.grad, other.grad, atol=tolerance, rtol=1e-6, msg=name)
    ours.eval()
    compiled = torch.compile(ours, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits)


def test_set_attn_implementation_switches_a_built_model() -> None:
    theirs, _ = _pair("llama")
    ids, _mask = _batch()
    with torch.no_grad():
        expected = theirs(ids).logits
        theirs.set_attn_implementation(shapesafe_mha.hf.register())
        assert theirs.config._attn_implementation == "shapesafe"
        torch.testing.assert_close(theirs(ids).logits, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "bug, heads",
    [("layer 1 built with 3 KV heads", 3), ("layer 1's key projection truncated to one head", 1)],
)
def test_a_layer_that_disagrees_with_its_config_is_named_with_the_field(bug: str, heads: int) -> None:
    """Tensors alone would be valid GQA/MQA; the config's num_key_value_heads=2 says otherwise. The layer is
    named by its path in the model (found from the model's frames on the stack) and its index."""
    _, ours = _pair("llama")
    attention = ours.model.layers[1].self_attn
    attention.k_proj = nn.Linear(32, heads * 8, bias=False, dtype=torch.float64)
    if heads == 3:
        attention.v_proj = nn.Linear(32, heads * 8, bias=False, dtype=torch.float64)
    ids, _mask = _batch()
    with pytest.raises(ssm.ShapeError) as caught:
        ours(ids)
    assert str(caught.value).splitlines()[0] == (
        f"model.layers.1.self_attn (LlamaAttention, layer_idx=1): k has num_kv_heads={heads} (axis 1), but the config "
        "(num_key_value_heads=2) set num_kv_heads=2."
    )


def test_decoding_is_checked_once_and_a_later_call_that_disagrees_is_still_caught(monkeypatch: Any) -> None:
    """Verdicts are remembered by how sizes relate, so a growing KV cache is one verdict (not one per step);
    heads and d_head stay exact, so a later call with other KV heads is checked, and fails."""
    from shapesafe_mha._interop import hf_backend as _hf_backend

    _, ours = _pair("llama")
    _hf_backend._verdicts.forget()
    checked: list[Any] = []
    original = _hf_backend._checked
    monkeypatch.setattr(_hf_backend, "_checked", lambda *args: checked.append(args[0]) or original(*args))
    ids, _mask = _batch()
    with torch.no_grad():
        ours.generate(ids, max_new_tokens=12, do_sample=False)
    assert len(checked) == 2  # the prefill and the first decoding step, for both layers and every later step
    attention = ours.model.layers[0].self_attn
    q, scaling = torch.randn(2, 4, 1, 8, dtype=torch.float64), attention.scaling
    shapesafe_mha.hf.attention(attention, q, *[torch.randn(2, 2, 30, 8, dtype=torch.float64)] * 2, scaling=scaling)
    assert len(checked) == 2
    with pytest.raises(ssm.ShapeError, match=r"k has num_kv_heads=1 \(axis 1\), but the config"):
        shapesafe_mha.hf.attention(attention, q, *[torch.randn(2, 1, 30, 8, dtype=torch.float64)] * 2, scaling=scaling)


def test_a_result_changing_keyword_we_do_not_compute_is_refused_by_name() -> None:
    _, ours = _pair("llama")
    attention = ours.model.layers[0].self_attn
    q, k = torch.randn(1, 4, 3, 8, dtype=torch.float64), torch.randn(1, 2, 3, 8, dtype=torch.float64)
    with pytest.raises(ssm.ConfigError, match=r"^LlamaAttention\(layer_idx=0\): transformers passed position_bias="):
        shapesafe_mha.hf.attention(attention, q, k, k, None, position_bias=torch.zeros(1, 4, 3, 3))
    out, weights = shapesafe_mha.hf.attention(attention, q, k, k, None, position_ids=torch.arange(3)[None])
    assert out.shape == (1, 3, 4, 8) and weights is None  # (batch, seq, heads, d_head), as transformers' own


def test_register_is_idempotent_and_importing_hf_does_not_import_transformers() -> None:
    import subprocess
    import sys

    assert shapesafe_mha.hf.register() == shapesafe_mha.hf.register() == "shapesafe"
    code = "import sys, shapesafe_mha.hf; print('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == (
        "False"
    )


def test_every_architecture_equals_its_reference_or_is_named_and_the_page_is_current() -> None:
    """The sweep over every causal LM of the installed transformers: none differs or fails; the docs page
    shows this sweep's verdicts (checked against the transformers version it was made with)."""
    import re
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from tools.hf_sweep import BAD, PAGE, sweep

    rows = sweep()
    bad = [row for row in rows if row.verdict in BAD]
    assert not bad, bad
    assert sum(row.verdict == "equal" for row in rows) >= 40
    page = PAGE.read_text()
    made_with = re.search(r"transformers (\S+), built tiny", page)
    if made_with is not None and made_with.group(1) == transformers.__version__:
        listed = dict(re.findall(r"^\| `([^`]+)` \| ([^|]+?) \|", page, re.MULTILINE))
        assert listed == {row.model_type: row.verdict for row in rows}, "docs/hf-architectures.md is stale"
