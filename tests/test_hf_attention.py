"""check_hf_attention passes the real transformers classes as written and names the property a planted bug breaks."""

import inspect
import re

import pytest
import torch
from hf_bugs import BUGS, REAL, Bug
from torch import nn

from shapesafe_mha import ConfigError
from shapesafe_mha.testing.hf import check_hf_attention


@pytest.mark.parametrize(("attention_cls", "config_cls"), REAL, ids=[cls.__name__ for cls, _ in REAL])
def test_the_real_classes_pass_as_written(attention_cls: type[nn.Module], config_cls: type) -> None:
    """Llama, Qwen2 (q/k/v bias, no o bias), Mistral (no bias), GPT-2 (Conv1D c_attn), Phi-3 (qkv_proj) pass."""
    check_hf_attention(attention_cls, config_cls, max_examples=25)


def _wrapped_constructor(cls: type[nn.Module]) -> type[nn.Module]:
    """A class decorator as transformers 5.25's `use_kernelized_func`: `__init__` replaced, no functools.wraps."""
    init = cls.__init__

    def new_init(self: nn.Module, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)

    cls.__init__ = new_init  # type: ignore[method-assign]
    return cls


def test_a_constructor_wrapped_without_its_signature_is_checked_as_its_model_builds_it() -> None:
    """What a layer is built from is observed by building it, not read from a signature a decorator hides."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    @_wrapped_constructor
    class Wrapped(LlamaAttention):
        pass

    @_wrapped_constructor
    class TakesOther(LlamaAttention):
        def __init__(self, config: LlamaConfig, dropout_rate: float) -> None:
            super().__init__(config, 0)

    for cls in (Wrapped, TakesOther):  # beside Llama's rotary class, where its model module holds them
        cls.__module__ = LlamaAttention.__module__

    for cls in (Wrapped, TakesOther):
        assert list(inspect.signature(cls.__init__).parameters) == ["self", "args", "kwargs"]
    check_hf_attention(Wrapped, LlamaConfig, max_examples=5)
    with pytest.raises(ConfigError, match=r"TakesOther: a layer built as TakesOther\(args, kwargs\), not from"):
        check_hf_attention(TakesOther, LlamaConfig, max_examples=5)


@pytest.mark.parametrize(
    ("implementation", "dtype"),
    [("sdpa", torch.float32), ("eager", torch.float64), ("sdpa", torch.float64)],
)
def test_llama_passes_in_every_implementation_and_dtype(implementation: str, dtype: torch.dtype) -> None:
    """Eager Llama takes its softmax in float32: in float64 that rounding is accepted, not called a bug."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    check_hf_attention(LlamaAttention, LlamaConfig, attn_implementation=implementation, dtype=dtype, max_examples=25)


def test_float32_rounding_fails_a_strict_float64_tolerance() -> None:
    """With an explicit atol the float32 softmax of eager Llama is a deviation (what the default forgives)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    with pytest.raises(AssertionError, match=r"differs from the per-head reference by \S+ \(tolerance 1e-12\)"):
        check_hf_attention(LlamaAttention, LlamaConfig, dtype=torch.float64, atol=1e-12, max_examples=20)


@pytest.mark.parametrize("bug", BUGS, ids=[bug.name for bug in BUGS])
def test_a_planted_bug_is_caught_and_its_property_named(bug: Bug) -> None:
    """The report's first line names the property that broke; where a variant of the reference matches, its class."""
    with pytest.raises(AssertionError) as caught, bug.patch():
        check_hf_attention(bug.attention_cls, bug.config_cls)
    report = str(caught.value)
    first = report.splitlines()[0]
    assert first.startswith(f"[{bug.prop}] {bug.attention_cls.__name__} (eager, float32)"), report
    assert re.search(r"smallest failing config: seq=\d+, batch=\d+, hidden_size=\d+, num_heads=\d+", report), report
    assert "tensor(" not in report and "_toolkit.py" not in report and "Falsifying" not in report, report
    if bug.named is not None:
        assert "bug class:" in report and bug.named in report, report


def test_what_the_reference_does_not_compute_is_refused_by_name() -> None:
    """gpt-oss's sinks under sdpa (which drops them), Bloom under sdpa (its layer computes attention itself, with no
    sdpa path) and a layer without an output projection: a ConfigError whose first line names the class and the
    variant or layout, not a failed check."""
    from transformers import BertConfig, BloomConfig, GptOssConfig
    from transformers.models.bert.modeling_bert import BertSelfAttention
    from transformers.models.bloom.modeling_bloom import BloomAttention
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention

    import shapesafe_mha as ssm

    refusals = [
        (GptOssAttention, GptOssConfig, "sdpa", r"GptOssAttention: attention sinks under sdpa"),
        (BloomAttention, BloomConfig, "sdpa", r"BloomAttention: attention computed by the layer itself under sdpa"),
        (BertSelfAttention, BertConfig, "eager", r"BertSelfAttention: a layer without an output projection"),
    ]
    for attention_cls, config_cls, implementation, reason in refusals:
        with pytest.raises(ssm.ConfigError, match=r"^check_hf_attention\(\): " + reason):
            check_hf_attention(attention_cls, config_cls, attn_implementation=implementation)


def test_a_padded_report_names_no_position_and_ends_each_line_where_it_should() -> None:
    """Where padded queries are left out of the comparison (the padding property), the outputs compared are rows of
    a selection, so the report names no batch or query position: the property line ends with the property and the
    bug class follows it."""
    bug = next(bug for bug in BUGS if bug.prop == "padding/mask")
    with pytest.raises(AssertionError) as caught, bug.patch():
        check_hf_attention(bug.attention_cls, bug.config_cls)
    report = str(caught.value)
    assert "largest deviation" not in report, report
    assert re.search(
        r"\n  property: a left-padded batch \(lengths \[[\d, ]+\]\), the 2D attention_mask through create_causal_mask"
        r"\n  bug class: ",
        report,
    ), report
