# ruff: noqa: E501  (the mutants are exact lines of code, kept one per entry)
"""A curated mutation suite: realistic bugs planted one at a time, each one the tests must catch.

    python -m tools.mutation            # every mutant; prints the score, the survivors, the stale ones
    python -m tools.mutation --check    # only verify that every mutant still applies (fast)
    python -m tools.mutation -k cache   # the mutants whose file or description contains "cache"
    python -m tools.mutation --jobs 1   # one at a time (default: as many at once as there are cores)

Each mutant is an exact edit of one file with a one-line description of the bug it stands for, and
the tests that should catch it. The runner copies the tracked tree to a temporary folder (one copy per
worker), applies one mutant there, runs those tests (the whole suite if none are named), restores the
file, and goes on: the working tree is never touched. A mutant whose original text is gone (or not unique) is reported
as stale, never skipped in silence. Equivalent mutants (no observable difference) carry the reason
and do not count. Exit status 1 if the score is under 95% or any mutant is stale.
"""

import argparse
import concurrent.futures
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.95


@dataclass(frozen=True)
class Mutant:
    path: str
    old: str
    new: str
    bug: str
    tests: tuple[str, ...] = ()
    equivalent: str | None = None


def M(path: str, old: str, new: str, bug: str, *tests: str, equivalent: str | None = None) -> Mutant:
    return Mutant(f"shapesafe_mha/{path}", old, new, bug, tests, equivalent)


EQ = "tests/test_equivalence.py"
CONTRACT = "tests/test_contract.py"
PINS = "tests/test_pins.py"
ECO = "tests/test_ecosystem.py"
ROPE = "tests/test_rope.py"
ERRORS = "tests/test_errors.py"
CACHE = "tests/test_cache.py"
TOOLKIT = "tests/test_toolkit.py"
PATHS = "tests/test_paths.py"
VARIANTS = "tests/test_variants.py"
VARIANTS_HF = "tests/test_variants_hf.py"
SINKS_HF = "tests/test_variants_hf.py::test_from_hf_variant_equals_the_hugging_face_layer_full_and_decoding[gpt_oss-sinks-full-eager]"
DIFF_HF = "tests/test_differential.py::test_from_hf_of_diffllama_equals_it_and_the_reference_forward_and_decoding[3-2-sdpa]"
SINKS_ADOPTED = "tests/test_hf_replace.py::test_the_model_keeps_its_parameters_and_trains_to_the_same_gradients[gpt_oss (eager: sinks, window 3)]"
LATENT = "tests/test_latent.py"
VERDICTS = "tests/test_verdicts.py"
YARN_TABLES = "tests/test_rope.py::test_yarn_tables_equal_transformers"
YARN_CAUGHT = "tests/test_rope.py::test_a_yarn_module_without_its_attention_factor_is_caught"
YARN_TO_HF = "tests/test_rope.py::test_to_hf_carries_yarn_and_a_factor_left_out_is_the_context_ratio"
YARN_BY_TYPE = "tests/test_rope.py::test_yarn_kept_per_layer_type_is_truncated_as_transformers_reads_it"
YARN_MODULE = "tests/test_rope.py::test_module_with_yarn_equals_the_per_head_reference"
MODS = "tests/test_mods.py"
BY_LENGTH_TABLES = "tests/test_rope_by_length.py::test_tables_by_length_equal_transformers_bit_for_bit"
BY_LENGTH_HF = "tests/test_rope_by_length.py::test_from_hf_equals_the_layer_one_shot_and_decoding_as_its_model_decodes"
BY_LENGTH_PROBE = (
    "tests/test_rope_by_length.py::test_frequencies_that_never_turn_are_refused_by_the_probe_in_its_decoding_step"
)
COHERE_HF = "tests/test_variants_hf.py::test_cohere_qk_norm_equals_the_reference_and_round_trips"
FLEX = "tests/test_flex.py"
SERVING = "tests/test_serving.py"

MUTANTS: list[Mutant] = [
    # --- kernels: the computation ---
    M("_compute/cache.py", "if inference and not torch.is_inference_mode_enabled():",
      "if False:", "a cache filled under inference_mode not writable outside it", "tests/test_ecosystem.py"),
    M("_compute/rotary.py", "        self.register_load_state_dict_post_hook(_frequencies_again)\n", "",
      "rotary frequencies left uninitialized after a meta build, to_empty and load", "tests/test_ecosystem.py"),
    M("_compute/rotary.py", "        if inv_freq.dtype in _ROUNDING:", "        if False:",
      "RoPE frequencies rounded by a cast to bfloat16", "tests/test_ecosystem.py"),
    M("_compute/kernels.py", "return x.unflatten(-1, (num_heads, -1)).transpose(1, 2)",
      "return x.reshape(x.shape[0], num_heads, x.shape[1], -1)", "head split by a view without the transpose", EQ),
    M("_compute/kernels.py", "return x.transpose(1, 2).flatten(2)", "return x.flatten(1, 2).reshape(x.shape[0], x.shape[2], -1)",
      "heads merged without transposing back", EQ),
    M("_compute/kernels.py", "return q.view(shape[0], num_kv_heads, shape[1] // num_kv_heads, shape[2], shape[3])",
      "return q.view(shape[0], shape[1] // num_kv_heads, num_kv_heads, shape[2], shape[3]).transpose(1, 2)",
      "query heads grouped as repeat (h % num_kv_heads), not repeat_interleave", EQ),
    M("_compute/kernels.py", "ones.tril(kv_seq - seq) if causal", "ones.tril(kv_seq - seq + 1) if causal",
      "causal mask off by one (sees the next position)", EQ, PINS),
    M("_compute/kernels.py", "ones.tril(kv_seq - seq) if causal", "ones.tril(0) if causal",
      "causal mask aligned top-left, not lower-right (decoding sees the first key only)", EQ, CACHE),
    M("_compute/kernels.py", "causal = is_causal and seq > 1  # a single query", "causal = is_causal and seq > 0  # a single query",
      "causal mask also built for a single query", EQ,
      equivalent="a single lower-right-aligned query may attend to every key: the mask built allows all of them"),
    M("_compute/kernels.py", "keep = ~key_padding_mask[:, None, None, :]", "keep = key_padding_mask[:, None, None, :]",
      "key_padding_mask read as True = keep (the inverse of torch's convention)", EQ),
    M("_compute/kernels.py", "return mask4 if allowed is None else mask4.masked_fill(~allowed, -math.inf)", "return mask4",
      "a float attn_mask drops the causal and padding restrictions", PINS),
    M("_compute/kernels.py", "return mask4 if allowed is None else allowed & mask4", "return mask4",
      "a bool attn_mask drops the causal and padding restrictions", EQ),
    M("_compute/kernels.py", "return q.shape[2] == k.shape[2] and (gqa or q.shape[1] == k.shape[1])", "return gqa or q.shape[1] == k.shape[1]",
      "torch's top-left is_causal used when seq != kv_seq", EQ, CACHE),
    M("_compute/kernels.py", "if torch.compiler.is_compiling() or dropout_p > 0.0 or not on_native_device(q):",
      "if torch.compiler.is_compiling() or not on_native_device(q):",
      "enable_gqa kernel chosen under dropout, where torch's math kernel repeats K and V", "tests/test_native_gqa.py"),
    M("_compute/stages.py", "return lambda q, k, v, **_: K.sdpa_gqa(q, k, v, None, is_causal, scale, dropout_p)",
      "return lambda q, k, v, **_: K.sdpa_gqa(q, k, v, None, False, scale, dropout_p)",
      "a remembered public GQA attention forgets is_causal (the plan binds the wrong flag)", "tests/test_native_gqa.py"),
    M("_compute/stages.py", "return softcap is None and attn_mask is None and window is None and (not is_causal or q_shape[2] == k_shape[2])",
      "return softcap is None and attn_mask is None and window is None",
      "torch's top-left is_causal used by the public attention (and its plan) when seq != kv_seq", "tests/test_native_gqa.py"),
    M("_compute/kernels.py", "return _NATIVE_ON_CPU if t.is_cpu else t.device.type in NATIVE_GQA_DEVICES",
      "return True", "meta and unmeasured devices sent to torch's enable_gqa kernel", "tests/test_native_gqa.py"),
    M("_compute/kernels.py", "    if shape[2] == 1:  # decoding", "    if False:  # decoding",
      "enable_gqa kernel chosen for one decoding query against many keys, where the fold was measured faster",
      "tests/test_native_gqa.py"),
    M("_compute/kernels.py", "    return batch * num_heads * kv_seq * d_head <= NATIVE_DECODE_MAX", "    return False",
      "one decoding query folded against few keys, where torch's kernel was measured faster", "tests/test_native_gqa.py"),
    M("_compute/kernels.py", "return mask | ~rows if mask.dtype == torch.bool else", "return mask if mask.dtype == torch.bool else",
      "rows with nothing to attend to are not opened before softmax (NaN)", EQ, PINS),
    M("_compute/kernels.py", "return x if rows is None else x.masked_fill(~rows, 0.0)", "return x",
      "rows with nothing to attend to are not zeroed after softmax", EQ, PINS),
    M("_compute/kernels.py", "mask.repeat(1, 1, group, 1)", "mask.repeat_interleave(group, dim=2)",
      "mask folded in the wrong order for GQA's folded queries", EQ, PINS),
    M("_compute/kernels.py", "return out.view(shape[0], shape[1], group, shape[2] // group, shape[3]).flatten(1, 2)",
      "return out.unflatten(2, (-1, num_heads // out.shape[1])).transpose(2, 3).flatten(1, 2)",
      "GQA output unfolded as (seq, group) instead of (group, seq)", EQ),
    M("_compute/kernels.py", "scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale",
      "scale = 1.0 / q.shape[-1] if scale is None else scale", "attention weights scaled by 1/d_head, not 1/sqrt", EQ, PINS),
    M("_compute/kernels.py", "return torch.softmax(scores, dim=-1)", "return torch.softmax(scores, dim=-2)",
      "softmax over queries instead of keys (need_weights path)", EQ, PINS),
    M("_compute/kernels.py", "return torch.cat((-second, first), dim=-1)", "return torch.cat((second, -first), dim=-1)",
      "RoPE rotated the wrong way", ROPE),
    # --- stages: what annotations cannot say ---
    M("_compute/stages.py", "    if width % num_heads:\n", "    if False:\n", "split_heads does not check divisibility", ERRORS),
    M("_compute/stages.py", "        if tensor.device != first.device:", "        if False:",
      "stage inputs on different devices are not refused", PINS),
    M("_compute/stages.py", "        if tensor.is_floating_point() and first.is_floating_point():", "        if False:",
      "stage inputs of different float dtypes are not refused", PINS),
    M("_compute/stages.py", 'if dims["num_heads"] % dims["num_kv_heads"] != 0:', "if False:",
      "SDPA accepts num_kv_heads that do not divide num_heads", ERRORS),
    M("_compute/stages.py", "    if not 0.0 <= dropout_p < 1.0:", "    if not 0.0 <= dropout_p <= 1.5:",
      "dropout_p >= 1 accepted", PINS),
    M("_compute/stages.py", "        if mask.ndim == 3:", "        if mask.ndim == 4:", "the 3-D mask message loses its fix", ERRORS),
    M("_compute/stages.py", "q, k, v = qkv.split_with_sizes([q_width, kv_width, kv_width], dim=-1)",
      "q, v, k = qkv.split_with_sizes([q_width, kv_width, kv_width], dim=-1)", "fused QKV split with k and v swapped", EQ, "tests/test_fused.py"),
    M("_compute/kernels.py", "q, k, v = heads.split_with_sizes(", "q, v, k = heads.split_with_sizes(",
      "fused QKV split into heads with k and v swapped", EQ, "tests/test_fused.py"),
    M("_compute/kernels.py", "heads = qkv.view(shape[0], shape[1], heads_total, shape[2] // heads_total).transpose(1, 2)",
      "heads = qkv.view(shape[0], shape[1], shape[2] // heads_total, heads_total).transpose(1, 2)",
      "fused QKV features split into heads the wrong way round (d_head by heads)", EQ, "tests/test_fused.py"),
    M("_compute/stages.py", "isinstance(value, bool) or value <= 0:", "isinstance(value, bool) or value < 0:",
      "a zero head count accepted", PINS, ERRORS),
    M("_compute/stages.py", "        if isinstance(mask, Tensor) and mask.device != q.device:", "        if False:",
      "masks on another device than the module are not refused", PINS),
    M("_compute/stages.py", "held != (computed.dtype, computed.device)", "False",
      "a KV cache of another dtype than the module is not refused", PINS, CACHE),
    # --- the module: composition, verdicts, fast paths, conversions ---
    M("_modules/plan.py", "dropout_p = module.dropout if module.training else 0.0", "dropout_p = module.dropout",
      "dropout applied in eval mode too", PINS),
    M("_modules/contract.py", "        type(is_causal),\n        is_causal,", "        is_causal,",
      "verdict key lets True collide with 1", CONTRACT),
    M("_modules/contract.py", "        query.dtype,\n        device,", "        query.dtype,",
      "verdict key without the device", CONTRACT, VERDICTS),
    M("_core/contract.py", "        if relations is not None and relations() in self.relations:", "        if relations is not None and self.relations:",
      "any remembered verdict covers every call", CONTRACT),
    M("_modules/plan.py", "start = 0 if kv_cache is None else kv_cache._start + kv_cache._length",
      "start = 0 if kv_cache is None else kv_cache._length",
      "rotary positions counted from the positions a window cache keeps, not from all it has seen", CACHE),
    M("_core/contract.py", "COVERED.answer = (OWN, OFF)", "COVERED.answer = (OFF, OFF)",
      "a covering call covers a method (whose body reads self) and a planned stage too", "tests/test_shapecheck.py"),
    M("_core/contract.py", "COVERED.answer = (OWN, OFF)", "COVERED.answer = (None, OFF)",
      "a method called inside a covering call keeps its own verdict but not its own mode: its expectations are covered",
      "tests/test_shapecheck.py::test_a_method_called_inside_a_decorated_call_is_checked_as_it_is_alone"),
    M("_core/contract.py", "return shared is None or route(shared, False) is not OFF",
      "return shared is None or route(shared, True) is not OFF",
      "checks_enabled() reads the dispatcher's coverable column: False inside a covered call (a cache's append unchecked)",
      "tests/test_switch.py::test_checks_enabled_is_false_exactly_inside_unchecked",
      "tests/test_switch.py::test_a_cache_append_inside_a_remembered_call_is_refused_as_alone"),
    M("_core/contract.py", "        if coverable:\n            self.used = True", "        if coverable:\n            pass",
      "a call checked for the first time never covers the stages it calls", "tests/test_shapecheck.py"),
    M("_core/contract.py", "            cache.restore(state)  # a failed call changes nothing", "            pass",
      "a failed call leaves the KV cache appended", CONTRACT, CACHE),
    M("_compute/fastpath.py", 'if key is not query or value is not query or torch.is_grad_enabled() or module.__dict__["_plan"].gated:',
      'if key is not query or value is not query or module.__dict__["_plan"].gated:', "the fused (detached) QKV weight used under autograd", ECO, "tests/test_compile.py"),
    M("_compute/fastpath.py", "        and query.shape[1] <= NATIVE_MAX_SEQ\n", "",
      "torch's native kernel used past the cut-off", PATHS,
      equivalent="the native kernel computes the same values at any length; the cut-off is for speed only"),
    M("_compute/fastpath.py", "and f is s5 and cached.layout == _layout(sources)",
      "and f is s5", "fused view kept after a parameter is re-pointed with .data =", "tests/test_fused.py", ECO),
    M("_compute/fastpath.py", "layout += (p.data_ptr(), p.shape, p.stride())", "layout += (p.data_ptr(), p.shape)",
      "fused view kept after a weight is re-pointed at its transpose (same address, same shape)", "tests/test_fused.py"),
    M("_compute/fastpath.py", "if t.untyped_storage().data_ptr() != storage or t.data_ptr() != end:",
      "if t.untyped_storage().data_ptr() != storage:", "q/k/v viewed as one where they do not lie one after another",
      "tests/test_fused.py"),
    M("_compute/fastpath.py", '            and "forward" not in own', "",
      "a projection whose forward accelerate replaced is bypassed", "tests/test_ecosystem.py"),
    M("_compute/fastpath.py", "    if plain_linear(proj) and not global_hooks():\n        parameters",
      "    if True:\n        parameters", "a hooked projection bypassed by the direct F.linear", "tests/test_ecosystem.py"),
    M("_compute/fastpath.py", "if a is s0 and b is s1 and c is s2 and d is s3 and e is s4 and f is s5 and cached.layout",
      "if cached.layout",
      "fused view kept after a parameter is replaced by another lying where it lay", "tests/test_fused.py", ECO,
      equivalent="the fused weight is a view: a tensor with the same data pointer, shape and strides reads the very "
      "memory it reads (which the view keeps alive), so the identity check only saves the layout's comparison"),
    M("_compute/fastpath.py", '            and not own["_forward_hooks"]\n', "", "fast path taken with forward hooks on a projection", ECO),
    M("_compute/fastpath.py", "        or module._forward_pre_hooks\n        or module._backward_hooks\n", "        or module._backward_hooks\n",
      "a forward pre-hook on the attention module itself skipped by the direct forward call", ECO),
    M("_compute/fastpath.py", "        or module._compiled_call_impl is not None\n", "",
      "module.compile() ignored: the direct forward call runs eager", "tests/test_compile.py"),
    M("_compute/fastpath.py", '        tables += (hooks.get("_global_forward_hooks"), hooks.get("_global_forward_pre_hooks"))',
      "        tables += (None, None)", "a verdict kept after a module-wide hook is added (one torch would not catch)",
      VERDICTS),
    M("_compute/fastpath.py", "if tuple(w.shape[0] for w in weights if w is not None) != rows:", "if False:",
      "projections whose rows moved from one to another fused and split by heads, silently wrong", "tests/test_fused.py"),
    M("_compute/fastpath.py", "        if module is None or module is q or module is k or module is v:",
      "        if module is None or module is q or module is k or module is v or module is not None:",
      "a verdict of the fused path kept after a hook is added to o_proj", VERDICTS, ECO),
    M("_compute/fastpath.py", '        hooks["_global_forward_hooks"]\n        or', "        False\n        or",
      "fast path taken with a global module hook registered", PINS),
    M("_modules/multihead.py", "        if isinstance(value, nn.Module):\n            self._forget()",
      "        if isinstance(value, nn.Module):\n            pass", "fused weight kept when a projection module is replaced (PEFT merge)", ECO,
      equivalent="fused_qkv checks on every call that the projections are plain and their weights the very tensors "
      "it viewed, where they lay (identity, data pointer, shape, strides), and PEFT's peft_config, set on the module, forgets too: "
      "a replaced projection is never computed with the old fused weight (tests/test_ecosystem.py, tests/test_fused.py)"),
    M("_modules/multihead.py", "        super()._apply(fn, recurse)\n        self._forget()", "        super()._apply(fn, recurse)",
      "verdicts kept after module.to(dtype)", CONTRACT, VERDICTS),
    M("_interop/torch_nn.py", "    if not module.batch_first:", "    if False:",
      "from_torch reads a seq-first nn.MultiheadAttention as batch-first", EQ),
    M("_interop/torch_nn.py", "        dropout=module.dropout,\n        device=weight.device,",
      "        dropout=0.0,\n        device=weight.device,", "from_torch drops the dropout", PINS),
    M("_interop/torch_nn.py", '                proj.register_parameter("bias", None)  # some models', "                pass  # some models",
      "from_weights keeps a random bias where the weights have none", PINS),
    M("_modules/plan.py", "positions = default_positions(query, start)", "positions = default_positions(query, 0)",
      "RoPE positions restart at 0 on every decoding step", ROPE),
    M("_modules/contract.py", '    if arguments["positions"] is not None and module.rotary is None:', "    if False:",
      "positions silently ignored by a module without RoPE", ROPE),
    # --- the KV cache ---
    M("_compute/cache.py", "        self._check_room(new, owner)\n", "        self._check_room(new, owner)\n        self._length += new\n",
      "cache length updated before the write (a failed write leaves it longer)", PINS),
    M("_compute/cache.py", "        if self._length + new <= self.capacity or", "        if self._length + new <= self.capacity + 1 or",
      "one position past the capacity accepted", CACHE, PINS),
    M("_compute/cache.py", "        tracked = keys.requires_grad or values.requires_grad or (\n            torch.is_grad_enabled()",
      "        tracked = (\n            False", "in-place cache writes under autograd (backward fails)", ECO),
    M("_compute/cache.py", "        tracked = keys.requires_grad or values.requires_grad or (", "        tracked = (",
      "a no-grad decoding step writes in place into a buffer a prompt's graph saved (its backward fails)", CACHE),
    M("_compute/cache.py", "        if self.keys_buffer.requires_grad or self.values_buffer.requires_grad:", "        if False:",
      "reset() keeps the autograd graph", ECO),
    M("_compute/cache.py", "key = (*signature_key((k, v), {}), self.keys_buffer.shape, self.dtype, self.device)",
      "key = signature_key((k, v), {})", "append verdict kept after the cache changes dtype", PINS),
    # --- the contract machinery ---
    M("_core/contract.py", "_ITSELF = frozenset({int, str, type(None), torch.dtype, torch.device})",
      "_ITSELF = frozenset({int, bool, str, type(None), torch.dtype, torch.device})",
      "a public stage's verdict lets True collide with 1", PINS),
    M("_core/contract.py", "                if type(second) is int:\n                    return (type(first), first.shape, first.dtype, first.device, second)",
      "                if isinstance(second, int):\n                    return (type(first), first.shape, first.dtype, first.device, second)",
      "a two-argument stage call keys True as the head count 1", VERDICTS),
    M("_core/contract.py", "                        type(first), first.shape, first.dtype, first.device,\n                        type(second)",
      "                        type(first), first.shape, first.dtype,\n                        type(second)",
      "a two-argument stage call's key leaves the first tensor's device out (a meta tensor passes for a CPU one)",
      VERDICTS),
    M("_core/contract.py", "                return (type(first), first.shape, first.dtype, first.device)\n",
      "                return (type(first), first.shape, first.dtype)\n",
      "a one-argument stage call's key leaves its device out (a meta tensor passes for a CPU one)", VERDICTS),
    M("_core/contract.py", "                key.append((bool, value))\n", "                key.append(value)\n",
      "a stage's flag passed by keyword keyed as its value: True passes for 1", VERDICTS),
    M("_core/contract.py", "    if kwargs:\n        key.append(KEYWORDS)\n        for name, value in kwargs.items():",
      "    if False:\n        key.append(KEYWORDS)\n        for name, value in kwargs.items():", "verdict key leaves keyword arguments out", PINS),
    # a keyword's name and a text argument in its place share a key (a stage's, and a decorated function's: the same):
    *(M(path, line, "", f"{whose} keyword names keyed as text arguments in their place", VERDICTS) for path, line, whose in (
        ("_core/contract.py", "        key.append(KEYWORDS)\n", "a stage's"),
    )),
    M("_core/contract.py", "            key += (type(value), value.shape, value.dtype, value.device)\n        elif type(value) is int:",
      "            key += (value.shape, value.dtype, value.device)\n        elif type(value) is int:",
      "a stage's verdict for plain tensors covers a subclass of them", VERDICTS),
    # what a module or a method holds, changed after a verdict without a submodule replaced (tests/test_verdicts.py):
    *(M(path, line, mutated, description, VERDICTS) for path, line, mutated, description in (
        ("_compute/fastpath.py", '        if own["_modules"]:  # a wrapper', "        if False:  # a wrapper",
         "a wrapped projection's layer replaced or written after a verdict: in no key"),
        ("_compute/fastpath.py", "            found.append((_Hooks, *hooks, *pre_hooks))", "            pass",
         "a hook added inside a wrapped projection after a verdict: in no key"),
        ("_compute/fastpath.py", "        elif parameters or buffers:", "        elif False:",
         "a leaf's tensors other than a weight parameter (rotary tables, a buffer weight) written: in no key"),
        ("_modules/contract.py", "        None if sinks is None else (sinks.shape, sinks.dtype, sinks.device),\n", "        None,\n",
         "attention sinks written through .data after a verdict: in no key"),
        ("_modules/multihead.py", '        elif not name.startswith("_") and name != "training":', "        elif False:",
         "a module's size or option set after a verdict: checked against the old sizes, or not at all"),
        ("_modules/latent.py", '        if built and (not name.startswith("_") or name == "_scale") and name != "training":',
         "        if False:", "a latent module's size set after construction: checked against the old sizes"),
        ("_interop/hf_backend.py", "            (type(query), type(key), type(value), type(mask)),", "            (),",
         "the HF backend's verdict for plain tensors covers a subclass of them"),
        ("_core/shapecheck.py", "if replay.session is None and now == returned and now is not UNCACHEABLE:",
         "if replay.session is None and now is not UNCACHEABLE:",
         "a decorated method's verdict covers another instance's result, or its own after a parameter changed"),
        ("_core/shapecheck.py",
         "            if index < len(self.expected) and self.expected[index] == signature and signature[1] is not UNCACHEABLE:",
         "            if True:", "a remembered method's expectations skipped though self changed them"),
    )),
    # issue 44: a bad input answered by the library, fresh and warm (tests/test_bad_inputs.py)
    M("_compute/fastpath.py", "            shapes += (weight.shape, None if bias is None else bias.shape)\n",
      "            shapes.append(weight.shape)\n",
      "a bias of one feature set after a verdict: broadcast silently under grad", "tests/test_bad_inputs.py"),
    M("_compute/stages.py", "        if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (weight.shape[0],)):",
      "        if False:", "a projection's bias of another width: torch's error or its silent broadcast",
      "tests/test_bad_inputs.py"),
    M("_core/contract.py", "        if isinstance(value, torch.Tensor) and (value.is_nested or value.layout is not torch.strided):",
      "        if False:", "a nested or sparse tensor into a stage: torch's or jaxtyping's raw error",
      "tests/test_bad_inputs.py"),
    M("_core/contract.py", "                recheck(lambda: self.checked(args, kwargs), failure)", "                raise",
      "a stage's remembered call failing in torch (a sparse tensor of a remembered shape) is not explained",
      "tests/test_bad_inputs.py"),
    M("_core/shapecheck.py", "        held = tuple(_attribute(owner, name) for name in self.key_dims)",
      "        held = tuple(_attribute(owner, name) for name in self.self_dims)",
      "a method's key blind to the sizes on self an expect binds: another instance's verdict admits a wrong tensor",
      "tests/test_shapecheck.py"),
    M("_core/shapecheck.py", "        _seed(session, self.sizes(bound, extra), self.owner)", "        pass",
      "expect ignores the int arguments and self's sizes an annotation would be checked against",
      "tests/test_shapecheck.py"),
    M("_core/shapecheck.py", 'getattr(kind, "__getattr__", _MODULE_GETATTR) is not _MODULE_GETATTR', "False",
      "a method's size forwarded by its class's own __getattr__ is not read", "tests/test_shapecheck.py"),
    M("_core/messages.py", "    if _FLOATING <= names:", "    if _FLOATING & names:",
      "a Float32 annotation's dtype named as any floating point", "tests/test_errors.py"),
    M("_core/contract.py", 'failure = self.fits("the result", value, hint, stage.sources.get("result", stage.name))', "failure = None",
      "a stage's result is not checked against its annotation", CONTRACT),
    M("_core/contract.py", "s if s < 2 or s in constants else", "s if s < 1 or s in constants else",
      "relational verdicts forget that 1 broadcasts", CONTRACT, VERDICTS,
      equivalent="since recheck: a call this lets through that the checks refuse (a mask of batch 3 for a query of "
      "batch 1, heads 3 for 4) fails in torch's broadcasting or our fold and is re-run checked, giving the same "
      "ShapeError; the silent cases tried were right calls (tests/test_verdicts.py pins the broadcast case)"),
    M("_core/contract.py", "s if s < 2 or s in constants else", "s if s < 2 else",
      "relational verdicts forget the module's sizes", CONTRACT, VERDICTS),
    M("_core/contract.py", '_FALSE = ("", "0", "false", "no", "off")', '_FALSE = ("", "0", "no", "off")',
      "SHAPESAFE_MHA_UNCHECKED=false refused", CONTRACT),
    M("_core/contract.py", "SHAPE_FAILURES = (RuntimeError, ValueError, IndexError, TypeError)", "SHAPE_FAILURES = (Exception,)",
      "torch's checkpoint stop rechecked: non-reentrant activation checkpointing breaks", "tests/test_ecosystem.py"),
    M("_core/contract.py", "token = mode.set(OFF)",
      "token = mode.set(None)", "unchecked() does not turn the checks off", "tests/test_switch.py"),
    M("_core/shapecheck.py", "        if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):",
      "        if False:", "an async or generator function decorated: its coroutine blamed as a wrong result", "tests/test_shapecheck.py"),
    M("_core/contract.py", "    return (type(a), a.shape, a.dtype, type(b), b.shape, b.dtype)\n",
      "    return (type(a), a.shape, type(b), b.shape)\n",
      "a decorated function's remembered verdict blind to dtypes", "tests/test_shapecheck.py"),
    M("_core/contract.py", "b.dtype, type(c), c.shape, c.dtype)\n", "b.dtype, c.shape, c.dtype)\n",
      "a decorated function's verdict for plain tensors covers a subclass of them in its third argument", VERDICTS),
    M("_core/contract.py", "return _UNCACHEABLE if _UNCACHEABLE in parts else (kind, parts)", "return (kind, parts)",
      "a tuple's unknown part hidden in its signature: remembered", "tests/test_shapecheck.py"),
    M("_core/messages.py", "            return all(bearable(item, parts[0]) for item in value)\n        if origin is list",
      "            return is_bearable(value, hint)\n        if origin is list",
      "a tuple[X, ...]'s items checked by beartype's one random draw", "tests/test_shapecheck.py"),
    # --- messages ---
    M("_core/messages.py", "        if axis.broadcast and size == 1:\n            continue", "        if size == 1:\n            continue",
      "the explainer lets any size-1 axis pass", ERRORS),
    M("_core/messages.py", "f\"{name} has {axis.name}={size} (axis {index}), but {source} set", "f\"{name} has {axis.name}={size}, but {source} set",
      "messages lose the axis", ERRORS),
    M("_core/messages.py", "                if not (axis.broadcast and size == 1):\n                    memo[axis.name]",
      "                if True:\n                    memo[axis.name]", "a broadcast 1 recorded as who set a dimension", ERRORS, CONTRACT,
      equivalent="in every annotation a broadcastable axis (#batch, #num_heads, #seq) follows an argument that binds the same name (the query, the module), so a 1 is never the first binding"),
    # --- the reference ---
    M("_compute/reference.py", 'kv_head = head % num_kv_heads if kv_heads == "interleaved" else head // group',
      'kv_head = head % num_kv_heads if kv_heads == "interleaved" else head % num_kv_heads',
      "the reference maps query heads to KV heads as repeat", EQ),
    M("_compute/reference.py", "            blocked[:, i, max(position + 1, 0) :] = True", "            blocked[:, i, position + 1 :] = True",
      "the reference's causal mask slices from a negative index", PINS),
    M("_compute/reference.py", "first * cos - second * sin, second * cos + first * sin", "first * cos + second * sin, second * cos - first * sin",
      "the reference rotates the wrong way", ROPE),
    M("_compute/reference.py", "scores = _softcap(_score_mod(scaled, score_mod, head), logit_softcap)",
      "scores = _softcap(_score_mod(scaled, score_mod, kv_head), logit_softcap)",
      "the reference gives score_mod the KV head, not the query head", MODS),
    M("_compute/reference.py", "blocked |= ~mask_mod(", "blocked |= mask_mod(", "the reference takes mask_mod's True as masked out", MODS),
    # --- FlexAttention ---
    M("_compute/flex.py", "head, q_idx = h * group + i // seq, i % seq", "head, q_idx = h + i // seq, i % seq",
      "the eager GQA fold gives the mods the wrong query head", FLEX),
    M("_compute/flex.py", "        if built != dims[name]:", "        if built < dims[name]:",
      "a BlockMask built for more positions than used passes to torch's ValueError", FLEX),
    M("_compute/flex.py", "    if q.shape[1] == k.shape[1] or torch.compiler.is_compiling():", "    if True:",
      "eager GQA left to torch, which repeats K and V to num_heads heads", FLEX),
    M("_core/trace.py", "    supports_higher_order_operators = True", "    supports_higher_order_operators = False",
      "the allocation recorder cannot look inside FlexAttention", FLEX),
    M("testing/_diagnose.py", "lambda t: replace(t, score_mod=_score_mod_heads(mod, lambda h: h // group)),",
      "lambda t: replace(t, score_mod=_score_mod_heads(mod, lambda h: h % group)),",
      "a temperature per KV head is not named as such", MODS),
    # --- the testing toolkit ---
    M("testing/_toolkit.py", "    torch.float64: 1e-8,", "    torch.float64: 1e-3,", "float64 tolerance loosened to 1e-3", PINS),
    M("testing/_toolkit.py", "    if excess.max().item() <= 0:", "    if not excess.max().item() > 0:", "a NaN output passes", PINS),
    M("testing/_strategies.py", 'ALL_KINDS: tuple[Kind, ...] = ("mha", "gqa", "mqa")', 'ALL_KINDS: tuple[Kind, ...] = ("mha", "gqa")',
      "MQA dropped from the default kinds", PINS),
    M("testing/_toolkit.py", "max_examples=base.max_examples if max_examples is None else max_examples,",
      "max_examples=10 if max_examples is None else max_examples,",
      "the default budget cut to 10 examples, whatever the profile", PINS),
    M("testing/_diagnose.py", "            if not tolerance.holds(got.double(), expected):\n                wrong.append(head)",
      "            if False:\n                wrong.append(head)", "the report never names the wrong heads", TOOLKIT),
    M("testing/_verify.py", "return allocation.op in COPYING and 0 < 2 * allocation.read <= elements", "return True",
      "K/V expansion decided by size alone (queries of the same size flagged)", "tests/test_allocations.py"),
    M("testing/_diagnose.py", "kv_heads=other)))", "kv_heads=t.kv_heads)))",
      "the report never names tiled KV heads", TOOLKIT),
    M("testing/_diagnose.py", "        return replace(config, **{name: _DEFAULTS[name]})", "        return config",
      "an option of the layer left on where the report names it not applied",
      "tests/test_toolkit.py::test_an_option_not_applied_is_named_with_the_words_of_its_description"),
    M("testing/_diagnose.py", "lambda t, name=name: replace(t, config=_default(t.config, name)),",
      "lambda t, name=name: replace(t, config=replace(t.config, **{name: _DEFAULTS[name]})),",
      "an option's fault set to its default alone, which the config refuses beside its part's options (RoPE with partial rotary, a QK-norm after RoPE): skipped in silence, never named",
      "tests/test_toolkit.py::test_each_option_of_the_layer_derives_a_not_applied_fault_that_computes"),
    M("_compute/reference.py", "        window, logit_softcap = config.window, config.logit_softcap",
      "        window, logit_softcap = None, config.logit_softcap",
      "the reference given a config leaves its window out",
      "tests/test_variants.py::test_each_variant_equals_the_per_head_reference"),
    M("testing/_hf_check.py", "positions = torch.arange(done, done + size, device=x.device)[None]",
      "positions = torch.arange(0, size, device=x.device)[None]",
      "decoding in the HF check restarts positions at 0 (a harness bug: correct classes would fail)",
      "tests/test_hf_attention.py"),
    M("testing/_strategies.py", "    return st.one_of(small, small, edges, anywhere)", "    return st.one_of(small, small)",
      "sequence lengths never past 8", PATHS),
    M("testing/_strategies.py", "    for edge in (*_POWERS_OF_TWO, *thresholds):", "    for edge in _POWERS_OF_TWO:",
      "user thresholds ignored", PATHS),
    # --- observation ---
    M("_core/trace.py", "if s == sid and _covers(_span(other), start, end)", "if _covers(_span(other), start, end)",
      "the trace calls anything in range a view, whatever its storage", "tests/test_aliasing.py"),
    M("_core/trace.py", "            if isinstance(t, torch.Tensor) and storage_id(t) not in inputs:", "            if False:",
      "the allocation recorder records nothing", "tests/test_allocations.py"),
    # --- ALiBi (Bloom, MPT) ---
    M("_compute/kernels.py", "    distance = (keys - queries[:, None]).to(slopes.dtype)",
      "    distance = (queries[:, None] - keys).to(slopes.dtype)", "ALiBi's distance the wrong way (far keys favoured)",
      "tests/test_variants.py::test_alibi_weights_a_key_d_positions_back_by_minus_d_times_its_heads_slope",
      "tests/test_variants_hf.py::test_bloom_and_mpt_alibi_from_hf_equal_the_layer_full_and_decoding"),
    # --- differential attention (DiffLlama) ---
    M("_compute/kernels.py", "    return first.repeat(1, 2, 1, 1), second.repeat(1, 2, 1, 1)",
      "    return second.repeat(1, 2, 1, 1), first.repeat(1, 2, 1, 1)", "the halves of the values swapped", DIFF_HF),
    M("_compute/kernels.py", "F.rms_norm(mine - lam * paired,", "F.rms_norm(mine + lam * paired,",
      "the pair's second map added instead of subtracted", DIFF_HF),
    M("_interop/hf_replace.py", "        setattr(ours, name, getattr(theirs, name))", "        pass",
      "replace_attention trains lambdas of its own, not the model's",
      "tests/test_hf_replace.py::test_the_model_keeps_its_parameters_and_trains_to_the_same_gradients"
      "[diffllama (differential attention)]"),
    M("_modules/contract.py",
      '        None if _FIRST_LAMBDA not in parameters else _lambdas(parameters),',
      "        None,", "lambdas written through .data after a verdict: in no key",
      "tests/test_differential.py::test_a_lambda_written_through_data_after_a_verdict_is_checked_again"),
    # --- attention sinks (gpt-oss) ---
    M("_compute/kernels.py", "        return torch.softmax(with_sinks, dim=-1)[..., :-1]", "        return torch.softmax(with_sinks, dim=-1)[..., 1:]",
      "the first key's weight dropped after the softmax instead of the sink's", SINKS_HF),
    M("_compute/kernels.py", "    per_group = sinks.unflatten(0, (num_kv_heads, -1))", "    per_group = sinks.flip(0).unflatten(0, (num_kv_heads, -1))",
      "each query head given another head's sink", SINKS_HF),
    M("_interop/hf_replace.py", "        ours.sinks = theirs.sinks  #", "        pass  #",
      "replace_attention trains sinks of its own, not the model's", SINKS_ADOPTED),
    M("_compute/stages.py", "    return q.clamp(-bound, bound), k.clamp(-bound, bound), v.clamp(-bound, bound)",
      "    return q.clamp(-bound, bound), k.clamp(-bound, bound), v", "clip_qkv leaves the values unclipped",
      "tests/test_variants_hf.py::test_from_hf_variant_equals_the_hugging_face_layer_full_and_decoding[olmo-clip-qkv-sdpa]"),
    M("_modules/plan.py", "return s.tune_query_temperature(q, at, *scales), k",
      "return s.tune_query_temperature(q, 0, *scales), k",
      "Llama 4's temperature tuning counts each decoding step's query from position 0",
      "tests/test_variants_hf.py::test_llama4_loads_its_complex_rope_and_weightless_qk_norm_after_it_and_its_nope_layer[3-True-sdpa]"),
    M("_compute/kernels.py", "        left = ((~key_padding_mask).cumsum(-1) == 0).sum(-1)[:, None, None]",
      "        left = torch.zeros_like(key_padding_mask[:, :1, None], dtype=torch.long)",
      "Llama 4's chunks counted from cache index 0 in a left-padded batch, not from each sequence's first token",
      "tests/test_variants_hf.py::test_llama4_chunked_layers_load_their_chunks_forward_decoding_and_left_padded[sdpa]"),
    M("_compute/kernels.py", "    factor = torch.log1p(torch.floor((positions + 1.0) / floor_scale)) * attn_scale + 1.0",
      "    factor = torch.log1p(torch.floor(positions / floor_scale)) * attn_scale + 1.0",
      "Llama 4's temperature tuning steps one position late",
      "tests/test_variants.py::test_each_variant_equals_the_per_head_reference"),
    M("_modules/plan.py", "    if config.qk_norm and not every and not config.qk_norm_after_rope:", "    if config.qk_norm and not every:",
      "a QK-norm after RoPE applied before it too",
      "tests/test_variants_hf.py::test_from_hf_variant_equals_the_hugging_face_layer_full_and_decoding[hunyuan-qk-norm-after-rope-sdpa]"),
    M("_compute/stages.py", "    return both[..., 0, :].transpose(1, 2), both[..., 1, :]", "    return both[..., 1, :].transpose(1, 2), both[..., 0, :]",
      "the output gate's rows read as the queries and the queries' as the gate",
      "tests/test_variants_hf.py::test_from_hf_variant_equals_the_hugging_face_layer_full_and_decoding[qwen3_next-output-gate-sdpa]"),
    M("_modules/latent.py", '        self.rotary = RotaryEmbedding(c.d_rope, c.rope_theta, c.rope_scaling).to(device=factory["device"])',
      '        self.rotary = RotaryEmbedding(c.d_rope, c.rope_theta).to(device=factory["device"])',
      "latent attention's YaRN tables left unscaled",
      "tests/test_latent.py::test_from_hf_equals_deepseek_v3_attention_full_and_decoding[yarn-mscale-only-True-12-sdpa]"),
    M("_interop/hf.py", "        return [rows[:, :group].flatten(0, 2), rows[:, group].flatten(0, 1), rows[:, group + 1].flatten(0, 1)]",
      "        return [rows[:, :group].flatten(0, 2), rows[:, group + 1].flatten(0, 1), rows[:, group].flatten(0, 1)]",
      "Falcon-40B's grouped query_key_value read with each group's key and value swapped",
      "tests/test_variants_hf.py::test_from_hf_variant_equals_the_hugging_face_layer_full_and_decoding[falcon-grouped-sdpa]"),
    M("_interop/hf.py", "    widths = [config.num_attention_heads * head_dim, kv, kv]",
      "    widths = [kv, config.num_attention_heads * head_dim, kv]",
      "a multi-query [q; k; v] read with the key first",
      "tests/test_variants_hf.py::test_from_hf_variant_equals_the_hugging_face_layer_full_and_decoding[gpt_bigcode-multi-query-sdpa]"),
    M("testing/_hf_recipe.py", "        return torch.stack((q.unflatten(0, (heads, -1)), g.unflatten(0, (heads, -1))), 1).flatten(0, 2)",
      "        return torch.stack((g.unflatten(0, (heads, -1)), q.unflatten(0, (heads, -1))), 1).flatten(0, 2)",
      "check_hf_attention loads the output gate's rows where each head's queries are",
      "tests/test_hf_variants_check.py::test_a_variant_class_passes_in_float64_full_forward_and_decoding"),
    # --- head-parallel ---
    M("_modules/parallel.py", "        parallel._sync_shared_norm_gradients()\n", "",
      "head-parallel QK-norm weights step on each rank's share of their gradient",
      "tests/test_parallel.py::test_sharded_equals_unsharded_on_every_rank[2]"),
    M("_modules/parallel.py", '    local.o_proj.register_parameter("bias", None)  # the output bias is added once, after the sum\n', "",
      "head-parallel adds the output bias on every rank", "tests/test_parallel.py"),
    # --- RoPE and Hugging Face ---
    M("_compute/rotary.py", "    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)", "    scaled = inv_freq",
      "llama3 RoPE scaling ignored", ROPE),
    # --- YaRN RoPE scaling ---
    M("_compute/rotary.py", "        if self.attention_factor != 1.0:", "        if False:",
      "YaRN cos/sin tables not multiplied by the attention factor", YARN_TABLES, YARN_CAUGHT),
    M("_compute/rotary.py", "    if mscale and mscale_all_dim:", "    if False:",
      "YaRN attention factor ignores DeepSeek's mscale and mscale_all_dim", YARN_TABLES),
    M("_compute/rotary.py", "    if given is not None:\n        return given\n    factor = _number(scaling, \"factor\")",
      "    if False:\n        return given\n    factor = _number(scaling, \"factor\")",
      "YaRN attention factor given in the config ignored", YARN_TABLES),
    M("_compute/rotary.py", "    if truncate:\n", "    if True:\n", "YaRN ramp ends rounded even with truncate=False", YARN_TABLES),
    M("_compute/rotary.py", "    kept = 1 - ramp", "    kept = ramp", "YaRN slows the fast frequencies and keeps the slow ones", YARN_TABLES),
    M("_compute/rotary.py", "    beta_fast = _number(scaling, \"beta_fast\", required=False) or 32",
      "    beta_fast = _number(scaling, \"beta_fast\", required=False) or 16", "YaRN beta_fast defaults to 16, not 32", YARN_TABLES),
    M("_compute/rotary.py", "    if kind == \"yarn\":\n        return _yarn(d_head, theta, scaling)\n", "",
      "YaRN frequencies computed as llama3's", YARN_TABLES),
    M("_interop/hf.py", "        scaling.update(_yarn_as_computed(config, scaling))\n", "",
      "from_hf leaves a YaRN factor of None (DeepSeek-V3) instead of the context ratio", YARN_TO_HF),
    M("_interop/hf.py", "        found[\"truncate\"] = top.get(\"truncate\", True)\n", "",
      "from_hf takes YaRN's truncate from a layer type's set (transformers reads the top level)", YARN_BY_TYPE),
    M("_interop/torch_nn.py", "            options[\"rope_frequencies\"] = (frequencies, rotary.attention_factor)",
      "            options[\"rope_frequencies\"] = (frequencies, 1.0)",
      "from_weights verifies a YaRN module against unscaled tables (and refuses it)", YARN_MODULE),
    M("_compute/rotary.py", '    if dims["d_head"] % 2:', "    if False:", "apply_rotary accepts an odd head width", PINS),
    M("_interop/hf.py", "    if window is not None:\n", "    if False:\n", "from_hf loads a sliding-window layer as full attention", VARIANTS_HF),
    # --- partial rotary and interleaved RoPE ---
    M("_compute/kernels.py", "return torch.cat((rotate(x[..., :width], cos, sin, interleaved), x[..., width:]), dim=-1)",
      "return torch.cat((x[..., : x.shape[-1] - width], rotate(x[..., x.shape[-1] - width :], cos, sin, interleaved)), dim=-1)",
      "partial rotary turns a head's last rope_dim features, not its first", VARIANTS, VARIANTS_HF, ROPE),
    M("_compute/kernels.py", "return x * cos + (rotate_pairs(x) if interleaved else rotate_half(x)) * sin",
      "return x * cos + rotate_half(x) * sin", "interleaved RoPE turned as halves (rotate_half)", VARIANTS, VARIANTS_HF),
    M("_compute/kernels.py", "return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)",
      "return torch.stack((x[..., 1::2], -x[..., 0::2]), dim=-1).flatten(-2)",
      "interleaved RoPE turns each pair the wrong way", VARIANTS, VARIANTS_HF),
    M("_compute/rotary.py", "            angles = angles.repeat_interleave(2, dim=-1)", "            angles = torch.cat((angles, angles), dim=-1)",
      "interleaved RoPE's tables laid out in halves", ROPE, VARIANTS),
    M("_compute/rotary.py", "    if width % 2 or width > d_head:", "    if False:",
      "apply_partial_rotary takes an odd or wider-than-a-head table", ROPE),
    M("_modules/config.py", "        if rope_dim is None:\n            return d_head\n", "        if True:\n            return d_head\n",
      "rope_dim ignored: every feature rotated", VARIANTS, VARIANTS_HF),
    M("_interop/hf.py", """            ("rope_parameters['partial_rotary_factor']", parameters.get("partial_rotary_factor")),\n""", "",
      "from_hf reads partial_rotary_factor from the config field only (transformers 4's place)", VARIANTS_HF),
    M("_interop/hf.py", "    return turned.shape == q.shape and bool(torch.allclose(turned.double(), paired, atol=1e-5))",
      "    return False", "from_hf and the check miss the pairs apply_rotary_pos_emb interleaves (GLM, ERNIE, Helium)",
      VARIANTS_HF, "tests/test_hf_variants_check.py"),
    M("_interop/hf.py", "    if cos.shape[-1] == width and width > 2 and torch.equal(row[0::2], row[1::2]):\n        return True",
      "    if False:\n        return True", "from_hf and the check miss Cohere's interleaved tables", VARIANTS_HF,
      "tests/test_hf_variants_check.py"),
    M("_interop/hf.py", """        options["rope_interleaved"] = pairs or None\n""", "",
      "to_hf writes an interleaved module into a layer of halves without naming it", VARIANTS_HF),
    # --- GPT-J's and CodeGen's RoPE of rotary_dim features, CodeGen's qkv_proj in blocks ---
    M("_interop/hf.py", 'BLOCK_ORDER = ("q_proj", "v_proj", "k_proj")', 'BLOCK_ORDER = ("q_proj", "k_proj", "v_proj")',
      "from_hf reads each block of CodeGen's qkv_proj as [q; k; v]", VARIANTS_HF),
    M("_interop/hf.py", "    return theta, (None if width == head_dim else width), interleaved",
      "    return theta, (None if width == head_dim else width), False",
      "from_hf loads GPT-J's adjacent pairs as halves", VARIANTS_HF),
    M("_interop/hf.py", "        theta = rounded if exact else estimate", "        theta = estimate",
      "from_hf keeps theta as read from a float32 table (10000 to 7 digits, 1e-8 off in float64)", VARIANTS_HF),
    M("testing/_hf_recipe.py", "for n in BLOCK_ORDER], 1).flatten(0, 2)", "for n in sorted(BLOCK_ORDER)], 1).flatten(0, 2)",
      "the check loads CodeGen's blocks as [k; q; v]: a false alarm on correct code",
      "tests/test_hf_variants_check.py"),
    M("testing/_hf_check.py", "            rotary_dim = data.draw(st.sampled_from(range(2, c.d_head + 1, 2)), label=\"rotary_dim\")",
      "            rotary_dim = c.d_head",
      "the check never draws a partial rotary_dim, so a bug in which part is rotated passes",
      "tests/test_hf_variants_check.py"),
    M("_interop/hf.py", "    weight = fused.weight.detach().unflatten(0, (heads, 3, head_dim))",
      "    weight = fused.weight.detach().unflatten(0, (3, heads, head_dim)).transpose(0, 1)",
      "from_hf reads GPT-NeoX's per-head fused query_key_value as [q; k; v]", VARIANTS_HF),
    M("_interop/hf.py", "    fused.weight.copy_(torch.stack([p.weight.unflatten(0, (heads, d_head)) for p in projections], 1).flatten(0, 2))",
      "    fused.weight.copy_(torch.cat([p.weight for p in projections]))",
      "to_hf writes GPT-NeoX's query_key_value as [q; k; v], not head by head", VARIANTS_HF),
    M("_interop/hf.py", '_CACHE_WORDS = ("cache", "past_key_values", "past_key_value", "layer_past")',
      '_CACHE_WORDS = ("cache", "past_key_values", "past_key_value")',
      "the probe decodes GPT-NeoX without its cache (its layer_past never given)", VARIANTS_HF),
    # --- QK-norm over every head (OLMo-2) ---
    M("_compute/stages.py", "    features, the keys over `num_kv_heads * d_head`, before the head split (so before RoPE).\"\"\"\n    return q_norm(q), k_norm(k)",
      "    features, the keys over `num_kv_heads * d_head`, before the head split (so before RoPE).\"\"\"\n    return q_norm(q), k",
      "QK-norm over every head applied to the queries only", VARIANTS, VARIANTS_HF),
    M("_modules/plan.py", "        before.append(_normalize_all)\n", "        pass\n",
      "QK-norm over every head never applied", VARIANTS, VARIANTS_HF),
    M("_interop/hf.py", '    return "all" if width not in (None, head_dim) and width == config.num_attention_heads * head_dim else "head"',
      '    return "head"', "from_hf takes OLMo-2's norm over every head for a per-head one", VARIANTS_HF),
    M("_interop/hf.py", "    theta, scaling = rope_of(config, _layer_type(attention, config))", "    theta, scaling = rope_of(config)",
      "from_hf ignores rope_parameters kept per layer type (OLMo 3: no RoPE at all)", VARIANTS_HF),
    # --- Gemma 3's QK-norm, 1 + weight ---
    M("_compute/norms.py", "        return F.rms_norm(x, (x.shape[-1],), None, self.eps) * (self.offset + self.weight)",
      "        return F.rms_norm(x, (x.shape[-1],), None, self.eps) * self.weight",
      "Gemma's QK-norm scales by weight, not offset + weight", VARIANTS, VARIANTS_HF),
    M("_modules/plan.py", "    if offset:\n        return OffsetRMSNorm", "    if False:\n        return OffsetRMSNorm", "qk_norm_offset ignored: a plain RMSNorm", VARIANTS),
    # --- RoPE scaled by length (dynamic, LongRoPE) and Cohere's QK-norm of each head ---
    M("_compute/rotary.py", "        if self.by_length and self._scaling is not None and positions.numel():",
      "        if False:", "RoPE scaled by length never turns (dynamic unscaled, LongRoPE's short factors, at every length)",
      BY_LENGTH_TABLES),
    M("_compute/rotary.py", "            length = positions.max() + 1\n", "            length = torch.tensor(positions.shape[-1])\n",
      "a call's length read as its number of new positions, not max(positions) + 1 (decoding never turns)",
      BY_LENGTH_HF),
    M("_compute/rotary.py", "    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(context))",
      "    return 1.0", "LongRoPE's attention factor left out", BY_LENGTH_TABLES),
    M("_interop/hf.py", "    return context - probe.PROMPT if isinstance(context, int) and context > probe.PROMPT else 0",
      "    return 0", "from_hf's probe never passes the length where a RoPE scaled by length turns", BY_LENGTH_PROBE),
    M("_compute/norms.py", "            x = x - x.mean(dim=-1, keepdim=True)\n", "",
      "Cohere's QK-norm an RMSNorm: each head's mean not subtracted", COHERE_HF),
    M("_modules/parallel.py", "        for proj in (self.local.k_proj, self.local.v_proj, *([k_norm] if k_norm is not None else [])):",
      "        for proj in (self.local.k_proj, self.local.v_proj):",
      "head-parallel: a replicated KV head's per-head QK-norm rows step on each rank's share of their gradient",
      "tests/test_parallel.py::test_sharded_equals_unsharded_on_every_rank[4]"),
    M("_compute/norms.py", "else self.weight[:, None, :]", "else self.weight[:1, None, :]",
      "a QK-norm with weights of each head normalises every head with head 0's", COHERE_HF),
    M("_interop/hf.py", "        for offset in (0.0, 1.0):\n", "        for offset in (0.0,):\n",
      "from_hf does not know Gemma 3's 1 + weight norm", VARIANTS_HF),
    M("_interop/hf.py", "        layer_cls = named or getattr(modeling, f\"{kind.removesuffix('Text')}Attention\")",
      "        layer_cls = named or getattr(modeling, f\"{kind}Attention\")",
      "to_hf finds no attention class for Gemma3TextConfig", VARIANTS_HF),
    M("_interop/hf.py", "            if theirs.bias is None:\n                ours.register_parameter", "            if False:\n                ours.register_parameter",
      "from_hf gives Qwen2 an output bias it does not have", ROPE),
    # --- attention variants ---
    M("_compute/kernels.py", "allowed & ~ones.tril(kv_seq - seq - window)", "allowed & ~ones.tril(kv_seq - seq - window + 1)",
      "sliding window one key short (sees window - 1 keys)", VARIANTS, VARIANTS_HF),
    M("_compute/kernels.py", "if torch.compiler.is_compiling() or kv_seq > window:", "if torch.compiler.is_compiling() or kv_seq > window + 1:",
      "window thought not to matter when the sequence is one longer than it", VARIANTS),
    M("_compute/cache.py", "kept = min(self._window - 1, self._length)", "kept = min(self._window - 2, self._length)",
      "sliding cache drops a position the window still sees", VARIANTS),
    M("_compute/stages.py", "None if key_padding_mask is None else key_padding_mask[:, seen - kept :],",
      "None if key_padding_mask is None else key_padding_mask[:, :kept],",
      "padding mask over every position seen cut from the wrong end", VARIANTS),
    M("_compute/kernels.py", "scores = torch.tanh(scores / softcap) * softcap", "scores = torch.tanh(scores) * softcap",
      "softcap without dividing by the cap first", VARIANTS, VARIANTS_HF),
    M("_compute/stages.py", "    (HunYuan: after it).\"\"\"\n    return q_norm(q), k_norm(k)",
      "    (HunYuan: after it).\"\"\"\n    return q_norm(q), k",
      "QK-norm applied to the queries only", VARIANTS, VARIANTS_HF),
    M("_modules/config.py", "float(self.query_pre_attn_scalar) ** -0.5", "float(self.query_pre_attn_scalar) ** -1.0",
      "query_pre_attn_scalar used as 1/s, not 1/sqrt(s)", VARIANTS, VARIANTS_HF),
    M("_modules/latent.py", "(self.d_nope + self.d_rope) ** -0.5 if given is None", "self.d_nope**-0.5 if given is None",
      "latent attention scaled by the non-rotary width only", LATENT),
    M("_modules/latent.py", "    if interleaved:\n        q, k = K.deinterleave(q), K.deinterleave(k)\n", "",
      "interleaved RoPE rotated as rotate-half pairs", LATENT),
    M("_modules/latent.py", "return kv_a_norm(compressed[..., :kv_lora_rank]), compressed[:, None, :, kv_lora_rank:]",
      "return compressed[..., :kv_lora_rank], compressed[:, None, :, kv_lora_rank:]",
      "latent cached before its RMSNorm", LATENT),
    M("_modules/latent.py", "return heads[..., :d_nope], heads[..., d_nope:]\n\n\n@stage(name=\"kv_a_proj\"",
      "return heads[..., -d_nope:], heads[..., :-d_nope]\n\n\n@stage(name=\"kv_a_proj\"",
      "query heads split rotary part first", LATENT),
    M("_modules/latent.py", "self.buffer[:, start:end, self.kv_lora_rank :] = k_rope[:, 0]",
      "self.buffer[:, start:end, self.kv_lora_rank :] = k_rope[:, 0].flip(1)",
      "rotary keys cached in the wrong order", LATENT),
    M("_modules/latent.py", "up_keys = kv_b_weight.unflatten(0, (num_heads, -1))[:, : q_nope.shape[-1]]",
      "up_keys = kv_b_weight.unflatten(0, (-1, num_heads))[:, : q_nope.shape[-1]]",
      "absorbed query reads kv_b_proj's rows head-minor", LATENT),
    M("_modules/latent.py", "return plain_linear(kv_b) and getattr(kv_b, \"bias\", None) is None and not global_hooks()",
      "return getattr(kv_b, \"bias\", None) is None and not global_hooks()",
      "absorption bypasses a hooked or adapted kv_b_proj", LATENT),
    M("_modules/contract.py", "return kept is None or (needed is not None and kept >= needed)", "return True",
      "a cache with a narrower window than the module's accepted (it drops keys the module needs)", VARIANTS),
    # --- serving: a paged cache's decoding steps ---
    M("_compute/paged.py", "            paged._lengths = dict(lengths)\n", "            pass\n",
      "a remembered decoding step that fails is rerun with checks on the lengths its failed run advanced",
      f"{SERVING}::test_a_remembered_decoding_step_that_fails_is_rerun_on_the_cache_it_found"),
    M("_compute/paged.py", "        if paged.window is not None:\n            paged.restore(state)\n",
      "        if paged.window is not None:\n            pass\n",
      "a remembered windowed decoding step that fails is rerun with checks on the tables and lengths it changed",
      f"{SERVING}::test_a_remembered_decoding_step_that_fails_is_rerun_on_the_cache_it_found"),
    M("_compute/paged.py", "        for seq, block in reversed(handed):\n            self._tables[seq].pop()\n"
      "            self._release(block)\n", "",
      "a failed decoding step keeps the blocks it took for sequences at their blocks' ends",
      f"{SERVING}::test_a_failed_decoding_step_gives_back_the_blocks_it_took"),
    M("_compute/paged.py", "        for seq, block in reversed(handed):\n", "        for seq, block in handed:\n",
      "a failed decoding step gives its blocks back in the order it took them (the free list reordered)",
      f"{SERVING}::test_a_failed_decoding_step_gives_back_the_blocks_it_took"),
    M("_compute/paged.py", "if step < 0 or step >= state.room or now", "if step < 0 or step > state.room or now",
      "a decoding step one past the buffers' room slices no position (RoPE's decoding fails after 64 steps)",
      f"{SERVING}::test_any_number_of_decoding_steps_equals_a_kv_cache_per_sequence"),
    M("_modules/paged_latent.py", "self.decode.positions, self.decode.padding\n",
      "self.decode.positions, self.decode.padding & False\n",
      "latent attention's batched paged decoding attends to the shorter sequences' left padding",
      f"{SERVING}::test_latent_attention_packed_and_paged"),
    M("_modules/paged_latent.py", "self.decode.positions, self.decode.padding\n",
      "self.decode.positions + 1, self.decode.padding\n",
      "latent attention's batched paged decoding rotates the new tokens one position on",
      f"{SERVING}::test_latent_attention_packed_and_paged"),
    M("_modules/paged_latent.py", "        self.decode.restore(state)\n", "        pass\n",
      "latent attention's remembered batched decoding step that fails is rerun on the lengths it advanced",
      f"{SERVING}::test_a_remembered_decoding_step_that_fails_is_rerun_on_the_cache_it_found"),
    # --- derived state: followed or refused (red team, 2026-12-06, fourth) ---
    M("_compute/rotary.py", '        if name in _SOURCES and "inv_freq" in self.__dict__.get("_buffers", {}) and value != getattr(',
      "        if False and (",
      "a RotaryEmbedding takes theta set after construction, its frequencies left those of the old one", ROPE),
    M("_compute/cache.py", '        if "_verdicts" in self.__dict__ and value != self._window:\n            raise ConfigError(',
      '        if False:\n            raise ConfigError(',
      "a KVCache takes a window set after it slid (the positions it dropped were chosen by the old one)", CACHE),
    M("_modules/config.py", '    "clip_qkv": "caches\' keys and values",', "",
      "clip_qkv set on a built module is followed, a cache filled before holding unclipped keys",
      "tests/test_config.py::test_an_option_followed_on_a_built_module_keeps_a_cache_filled_before_it_right"),
    M("_modules/latent.py", '        derived["scale"] = (self.d_nope + self.d_rope) ** -0.5 if given is None else float(given)',
      '        derived["scale"] = derived.get("scale") or (self.d_nope + self.d_rope) ** -0.5',
      "LatentAttention keeps the default scale of its old sizes after one is set",
      "tests/test_config.py::test_a_latent_size_set_on_a_built_module_derives_the_default_scale_again"),
    M("_modules/multihead.py", "        if built and name in PARTS and (why := part_misfit(", "        if False and (why := part_misfit(",
      "a rotary or QK-norm of other values replaced on a built module is taken, its config misdescribing it",
      "tests/test_config.py::test_a_part_replaced_on_a_built_module_fits_its_config_or_is_refused"),
    M("_compute/packed.py", '    return bool(getattr(getattr(module, "_plan", None), "one_start", False))',
      "    return False",
      "a temperature-tuned layer (one cache index for the batch) decodes sequences at different indices as one batch",
      f"{SERVING}::test_paged_equals_a_kv_cache_per_sequence"),
    # --- prove, and what it is told of each stage ---
    M("_tools/prove.py", "            if _only_guards_true_everywhere(error, sources):", "            if False:",
      "prove refuses guards torch cannot decide though they hold at every size (false alarms)",
      "tests/test_prove.py::test_a_guard_torch_cannot_decide_is_tried_at_every_size_and_the_module_proven"),
    M("_core/messages.py", "        if len(array.dims) == value.ndim and (", "        if (",
      "a union-annotated stage reported under its first alternative of the dtype, not of the rank (4-D chunk mask)",
      "tests/test_prove.py::test_a_chunked_module_with_a_padding_mask_is_proven_with_its_4d_chunk_mask"),
    M("testing/_toolkit.py", "    matches = name_bug(got, scenario, tol, rows) if float32_inside else None",
      "    matches = None", "a wrong formula off by under 1e-5 reported as float32 rounding (MQA ALiBi per KV head)",
      MODS),
    # --- the routes around the refusals (nn.Module's own, the parts' attributes) ---
    M("_modules/plan.py", "            setattr(self, name, module)  # the same checks, and what follows a part replaced",
      "            super().add_module(name, module)",
      "add_module of a part on a built module skips __setattr__'s checks (a rotary of another theta taken)",
      "tests/test_config.py::test_a_part_replaced_or_removed_around_setattr_is_refused_as_setting_it_is"),
    M("_modules/config.py", "    if len(set(found.values())) > 1:", "    if len(set(found.values())) > 2:",
      "QK-norms of different eps read back as one norm_eps (the first's)",
      "tests/test_config.py::test_a_norms_eps_set_on_the_part_is_followed_by_the_config_or_the_config_refuses"),
    M("_modules/config.py", "    parts = {name: part for name in names if isinstance(part := module._modules.get(name), kinds)}",
      "    parts = {name: part for name in names if (part := module._modules.get(name)) is not None}",
      "a norm of the user's own kind read as the config's norm_eps (replacing both QK-norms refused)",
      "tests/test_config.py::test_norms_of_the_users_own_kind_keep_their_eps_and_the_config_its_norm_eps"),
    M("_compute/rotary.py", '        if name in _DERIVED and "attention_factor" in self.__dict__:', "        if False:",
      "the frequencies deleted from a built rotary (register_parametrization) and replaced, half applied",
      f"{ROPE}::test_what_else_a_rotary_derives_is_refused_and_its_frequencies_may_be_cast"),
    M("_compute/rotary.py", "        return copy.deepcopy(self._scaling)", "        return self._scaling",
      "a rotary's scaling edited in place: the config reads it, the frequencies were built from the old one",
      f"{ROPE}::test_a_rotarys_scaling_read_back_is_a_copy_editing_it_edits_nothing"),
    M("_compute/stages.py", "        if tuple(weight.shape) != wanted:", "        if False:",
      "a QK-norm built for other head counts meets torch's broadcast error, not a ShapeError naming it",
      "tests/test_config.py::test_heads_pruned_part_by_part_sizes_then_parts_equal_a_module_of_the_pruned_sizes"),
    M("_compute/stages.py", "    if shape != tuple(weight.shape):", "    if False:",
      "a torch norm's normalized_shape set alone meets torch's RuntimeError, not a ShapeError naming it",
      "tests/test_config.py::test_a_torch_norms_normalized_shape_set_alone_is_a_shape_error_naming_it"),
    M("_compute/rotary.py", """        if not compiling():
            self._check_written()""", """        pass""",
      "a rotary's frequencies written in place (mul_, .data =, copy_) used silently: the config says otherwise",
      f"{ROPE}::test_frequencies_written_in_place_are_refused_until_reset_and_their_own_values_are_not"),
    M("_compute/rotary.py", """                with torch.no_grad():  # a round trip through bfloat16 or float16 (`.bfloat16().float()`): made again
                    buffer.copy_(built)
                continue""", """                continue""",
      "frequencies rounded by a bfloat16 round trip kept: 5.8e-4 off a rebuilt module at 512 positions",
      f"{ROPE}::test_frequencies_written_in_place_are_refused_until_reset_and_their_own_values_are_not"),
    # a helper's six serving bugs (2026-12-06): the four the suite missed, each killed by the test written for it,
    # and one only MLA's test caught (decoding buffers reused after chunks of unequal sizes)
    M("_compute/paged.py", "        if step < 0 or step >= state.room or now != [n + step for n in state.base]:",
      "        if step < 0 or step >= state.room:",
      "decoding buffers reused after chunks of unequal sizes: stale positions and padding",
      f"{SERVING}::test_paged_equals_a_kv_cache_per_sequence"),
    M("_compute/paged.py", "        self._owner_of, self._free = dict(owner_of), list(free)",
      "        self._free = list(free)",
      "a failed call's blocks back on the free list but still owned: a bad table may then read a free block",
      f"{SERVING}::test_a_forward_hook_that_raises_leaves_a_paged_cache_as_it_was"),
    M("_compute/packed.py",
      "        module.forward(query[:, a:b], is_causal=is_causal, positions=None if positions is None else positions[:, a:b])",
      "        module.forward(query[:, a:b], is_causal=is_causal)",
      "a packed batch's given positions dropped: each sequence rotated by 0..n-1 instead",
      f"{SERVING}::test_packed_equals_each_sequence_alone"),
    M("_compute/paged.py", """            shared = self.values_pool is self.keys_pool
            self.keys_pool = self.keys_pool.view(flat).index_copy(0, slots, k).view(self.keys_pool.shape)""",
      """            self.keys_pool = self.keys_pool.view(flat).index_copy(0, slots, k).view(self.keys_pool.shape)
            shared = self.values_pool is self.keys_pool""",
      "a latent cache's one pool split in two by a write under grad (twice the memory, values written apart)",
      f"{SERVING}::test_latent_attention_packed_and_paged"),
    M("_interop/hf_paged.py", """            if not all(same):""",
      """            if not same[0]:""",
      "transformers' paged cache giving back other values than were written: only the keys compared",
      "tests/test_hf_serving.py::test_a_paged_cache_giving_back_other_values_is_caught_and_named"),
]  # fmt: skip


def _tracked_copy(destination: Path) -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    untracked = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in files + untracked:
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def _stale(mutant: Mutant, tree: Path) -> str | None:
    count = (tree / mutant.path).read_text().count(mutant.old)
    return None if count == 1 else f"found {count} times"


def _kill(mutant: Mutant, tree: Path, timeout: int, jobs: int) -> bool:
    """Apply `mutant` to `tree`, run its tests there, restore the file: whether the tests failed."""
    env = os.environ | {"PYTHONPATH": str(tree), "HYPOTHESIS_PROFILE": "mutation", "PYTHONDONTWRITEBYTECODE": "1"}
    if jobs > 1:
        env |= {"OMP_NUM_THREADS": "1"}  # the workers share the cores: one thread each, no oversubscription
    target = tree / mutant.path
    original = target.read_text()
    target.write_text(original.replace(mutant.old, mutant.new))
    try:
        tests = list(mutant.tests) or ["tests"]
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
        try:
            run = subprocess.run(command, cwd=tree, env=env, capture_output=True, timeout=timeout)
            return run.returncode not in (0, 5)
        except subprocess.TimeoutExpired:
            return True  # a hang is a failure the suite reports
    finally:
        target.write_text(original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that every mutant applies")
    parser.add_argument("-k", default="", help="only mutants whose file or description contains this")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per mutant's tests")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants run at once (default: cores)")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if args.k in m.path or args.k in m.bug]
    stale = [(m, why) for m in chosen if (why := _stale(m, ROOT))]
    for m, why in stale:
        print(f"STALE  {m.path}: {m.bug} ({why})")
    if args.check:
        print(f"{len(chosen)} mutants, {len(stale)} stale, {sum(m.equivalent is not None for m in chosen)} equivalent")
        sys.exit(1 if stale else 0)
    live = [m for m in chosen if m.equivalent is None and not _stale(m, ROOT)]
    survivors: list[Mutant] = []
    started = time.perf_counter()
    jobs = max(1, min(args.jobs, len(live)))
    with tempfile.TemporaryDirectory() as tmp:
        # One copy of the tree per worker: a mutant is applied to its worker's copy, never to another's.
        trees: queue.Queue[Path] = queue.Queue()
        for worker in range(jobs):
            tree = Path(tmp) / str(worker)
            _tracked_copy(tree)
            trees.put(tree)
        done = iter(range(1, len(live) + 1))
        lock = threading.Lock()

        def run(mutant: Mutant) -> None:
            tree = trees.get()
            try:
                killed = _kill(mutant, tree, args.timeout, jobs)
            finally:
                trees.put(tree)
            with lock:
                print(
                    f"[{next(done):2}/{len(live)}] {'killed  ' if killed else 'SURVIVED'} {mutant.path}: {mutant.bug}",
                    flush=True,
                )
                if not killed:
                    survivors.append(mutant)

        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            list(pool.map(run, live))
    killed_count = len(live) - len(survivors)
    score = killed_count / len(live) if live else 1.0
    minutes = (time.perf_counter() - started) / 60
    print(
        f"\nscore: {killed_count}/{len(live)} non-equivalent mutants killed ({score:.1%}); "
        f"{len(survivors)} survived; {len(stale)} stale; {sum(m.equivalent is not None for m in chosen)} equivalent "
        f"(not run); {minutes:.1f} min"
    )
    for m in chosen:
        if m.equivalent:
            print(f"  equivalent: {m.path}: {m.bug}: {m.equivalent}")
    for m in survivors:
        print(f"  survivor: {m.path}: {m.bug}")
    sys.exit(1 if stale or score < GOAL else 0)


if __name__ == "__main__":
    main()
