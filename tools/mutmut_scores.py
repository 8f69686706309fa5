"""The generated mutation run's score per module, from mutmut's own results (docs/contributors.md).

    OMP_NUM_THREADS=1 mutmut run --max-children 2   # hours on 2 cores: [tool.mutmut] in pyproject.toml
    python -m tools.mutmut_scores [--record]        # the table; --record writes docs/mutmut-scores.json
    python -m tools.mutmut_scores --sample shapesafe_mha/_interop/hf.py --size 300 --seed 28  # names to run

A module too big to run whole here (hf's 3,908 mutants are 11 hours at 6 a minute) is run on a uniform
sample: a seeded shuffle of every mutant mutmut generates for the file, of which a run takes a prefix
(any prefix is itself a uniform sample, so a run stopped early still measures the module).

A survivor is triaged one of two ways: a test that kills it (then it is killed at the next run), or an
entry of `EQUIVALENT` below saying why no test can (the mutant computes what the original computes).
The score counts every mutant mutmut ran, `no tests` included (no test covers that function: a gap too),
equivalent ones excluded: (killed + timeout) / (killed + timeout + survived + no tests).
"""

import argparse
import datetime
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

from tools.mkdocs_hooks import scores_markdown

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "mutmut-scores.json"

# mutant name -> why it computes the same as the original (mutmut's names: `mutmut show NAME`).
_ARANGE = "the pair indices kept int64 (over d_head they become float32 all the same) or made float32: the same values"
_EDGE = (
    "a strict comparison at a band edge made loose (or the reverse): they differ only where 2 pi / inv_freq equals "
    "context / factor exactly in float32, which no (theta, d_head) reaches; transformers compares the same way"
)
_ROTARY = "shapesafe_mha._compute.rotary.x_inverse_frequencies__mutmut_"

_M = "shapesafe_mha._core.messages."
_C = "shapesafe_mha._compute.cache."
_F = "shapesafe_mha._compute.fastpath."
_R = "shapesafe_mha._compute.rotary."
_K = "shapesafe_mha._compute.kernels."
_STRICT = "zip's strictness: the lengths are equal already (the rank was compared, or the value fits that alternative)"
_UNREAD_SOURCE = "the source returned beside None is never read: callers look at the size first, and None means free"
_EVAL_GLOBALS = (
    "eval's globals: the expression is arithmetic over names that are all in its locals (the bound sizes), so no "
    "builtin is ever looked up; jaxtyping evaluates the same text"
)
_UNREAD_TRIAL = (
    "binds a symbolic axis or `_` in the local trial memo, which nothing reads: a symbolic axis is looked up by its "
    "identifier parts, and `_` is answered before any lookup"
)
_WRONG_KIND_ARG = (
    "drops `arg` from the wrong-kind (not an array) message: its readers are explain hooks, which look only at "
    "tensor arguments, and the `at <stage>,` prefix of nested stages, which receive only values their caller made or "
    "checked: a wrong kind reaches only a top-level stage call or a decorated function, neither ever prefixed"
)
_OWN_SESSION = (
    "drops `arg` from KVCache.append's dtype/device refusal: append is always checked in a session of its own (top "
    "level: never prefixed) and its stage has no explain hook, the only readers of `arg`"
)
_OPENED_ANYWAY = (
    "rows opened and zeroed here where torch's CPU kernel zeroes them itself (no dropout), or where no row is empty "
    "(may_empty is False): the same zeros, in values and gradients, for one mask pass more"
)
_MASK_BUILT_ANYWAY = (
    "the explicit mask built where None (torch's own is_causal, or nothing to mask) meant the same keys: the window "
    "hides none (kv_seq <= window, or no window), or the query is a single one, which sees every key"
)
_S = "shapesafe_mha._compute.stages."
_CO = "shapesafe_mha._core.contract."
_MEMBERSHIP_NOTE = (
    "the default note made False: only shapecheck reads a note (exact.get: None, False or True), and it always "
    "passes its own; a stage, a cache, hf's backend and the modules test their memos for membership only"
)
_TUPLE_KEYS = (
    "changes only the branch for an exact key that is not a tuple: every caller's key is one (signature_key, "
    "UNROLLED, a method's key, a cache's, hf's call key, CallKey)"
)
_BOOL_NEVER_REFUSED = (
    "a bool mask's dtype no longer skipped: the checks after it refuse only floating tensors, so a bool one passes "
    "them all the same and reaches its annotation"
)
_PLAIN_NOT_MASK = (
    "drops `arg` from the float dtype refusal of q, k, v, x, weight or bias (a float mask takes the branch above): "
    "these stages are called at top level only (never prefixed), and their explain hook reads `arg` only for k with "
    "dim d_head, v with dim kv_seq, or a mask, never with dim None for k or v"
)
_CACHE_KIND_ARG = (
    "drops or renames `arg` of the wrong-kind kv_cache refusal: a wrong kind is refused by the forward's own precheck "
    "(top level, never prefixed) before any cache stage sees it, and no explain hook looks for kv_cache"
)
_CACHE_DTYPE_ARG = (
    "drops `arg` of the cache dtype refusal: the cache stages that reach it list kv_cache in `public`, so it is "
    "plain either way (tests/test_errors.py pins the line), and no explain hook looks for kv_cache"
)
_K_IS_A_TENSOR = (
    "the fix for a k that is not a tensor: append_to_cache's k is split_key's result, checked as a tensor before, "
    "and unchecked forwards call the raw functions (no precheck)"
)
_SEEN_DETAIL = (
    "drops or renames `arg`/`dim` of the window-masks refusal: window_masks has no explain hook (the only reader of "
    "`dim`) and lists both masks in `public`, so it is never prefixed"
)
_NO_NONE_SUBMODULE = (
    "continue -> break at a None submodule: module_state is given MultiHeadAttention's and LatentAttention's "
    "submodules only, and none of them is ever None"
)
_L = "shapesafe_mha._modules.latent."
_MH = "shapesafe_mha._modules.multihead."
_TOP_LEVEL_DETAIL = (
    "drops or renames `arg`/`dim` of a refusal in LatentAttention.forward's own precheck: it runs at top level "
    "(never prefixed) and the forward has no explain hook, the only readers of them"
)
_BIAS_NONE = "bias=None for False: nn.Linear tests bias for truth, so the projection has no bias alike"
_RECHECKED_SPLIT = (
    "a cache of the module's width split otherwise (or another width) has another kv_lora_rank, and such a cache "
    "fails unchecked (the write does not fit, or the latent it returns is not kv_b_proj's width) and is rechecked: "
    "the same ShapeError, the cache restored (d_rope is keyed apart)"
)
_P = "shapesafe_mha._tools.prove."
_D = "shapesafe_mha.testing._diagnose."
_PA = "shapesafe_mha._modules.parallel."
_ROOM = (
    "the decoding step's cache built with d_model free positions after the cached ones (query.shape[2] for [1]) "
    "instead of the one the step writes: the step writes and reads only the first cached + 1, so every shape and guard "
    "is the same (d_model >= 1)"
)
_HIGHLIGHT = "a failure line printed with rich's highlighting: it adds styles only, and export_text() drops them"
_INNERMOST_FIRST = (
    "min's key made a constant: min then takes the first span that holds the guard, and spans are noted as calls "
    "return, so that is the innermost call (the spans holding one guard nest), the one the shortest-span key picks"
)
_H = "shapesafe_mha._interop.hf."
_PROBE_X = (
    "the probe tensor given to the model's rotary class shaped otherwise ((1, 8), (2, 4, 8), (1, 4, 9) for (1, 4, 8)): "
    "every "
    "text model's rotary class in transformers reads only its device and dtype (the positions give the tables' "
    "shape); the three that read a shape (EfficientLoFTR, EoMT-DINOv3, MusicFlamingo) are vision and audio classes "
    "with no attention layer that from_hf or to_hf takes"
)
_ROPE_SCALING_ALIAS = (
    "rope_parameters looked up under another name, so rope_scaling is read: since transformers 5 rope_scaling is "
    "PretrainedConfig's property returning rope_parameters (the same dict), and older configs have no "
    "rope_parameters (rope_scaling was read either way)"
)
EQUIVALENT: dict[str, str] = {
    **{f"{_ROTARY}{n}": _ARANGE for n in (22, 26, 30)},
    **{f"{_ROTARY}{n}": _EDGE for n in (84, 102, 105)},
    **{f"{_ROTARY.replace('inverse_frequencies', '_yarn')}{n}": _ARANGE for n in (91, 93, 105)},
    f"{_ROTARY.replace('inverse_frequencies', '_yarn')}94": (
        "arange's end d_head / 2 (a float) instead of d_head // 2: d_head is even (validated), so the same range"
    ),
    **{
        f"{_ROTARY.replace('inverse_frequencies', name)}{n}": (
            "required=None / positive=None instead of False: _number reads both for truthiness only"
        )
        for name, numbers in (("_yarn", (19, 31)), ("attention_factor", (11, 29, 30, 42, 43)))
        for n in numbers
    },
    f"{_ROTARY.replace('inverse_frequencies', '_yarn_mscale')}5": (
        "scale < 1 instead of <= 1: at scale 1 the other branch gives 0.1 * mscale * log(1) + 1.0 = 1.0 as well"
    ),
    # --- messages ---
    f"{_M}x__expected__mutmut_5": (
        "`_` compared with another text: it then falls to the plain-name lookup, which finds nothing, since nothing "
        "binds `_` (bind and _misfit skip it): (None, '') either way"
    ),
    **{f"{_M}x__expected__mutmut_{n}": _UNREAD_SOURCE for n in (6, 12, 24)},
    **{f"{_M}x__expected__mutmut_{n}": _EVAL_GLOBALS for n in (33, 34)},
    **{f"{_M}x__misfit__mutmut_{n}": _STRICT for n in (39, 42, 43)},
    **{f"{_M}x_bind__mutmut_{n}": _STRICT for n in (15, 18, 20)},
    **{f"{_M}x_named_shape__mutmut_{n}": _STRICT for n in (20, 23, 24)},
    **{f"{_M}x__misfit__mutmut_{n}": _UNREAD_TRIAL for n in (54, 57)},
    f"{_M}x__misfit__mutmut_72": (
        "every axis mismatch ranked one higher: ranks are only ordered against each other and compared with 0 "
        "(dtype) and 1 (rank), which stay below"
    ),
    f"{_M}x_accepts_none__mutmut_2": (
        "differs only for a hint that is None or NoneType: fits() never explains hint None, a None value is bearable "
        "as NoneType (never explained), and the other use needs a union of two"
    ),
    f"{_M}x_bind__mutmut_3": "the name is used only in the misfit's message, which bind never reads (only `is None`)",
    f"{_M}x_divisors__mutmut_7": (
        "range's end one further: n % (n + 1) == 0 only for n == 0, and divisors is only asked of sizes already "
        "checked positive"
    ),
    **{
        f"{_M}x_kind_of__mutmut_{n}": (
            "the 'any dtype' branch is unreachable: kind_of is called only on array types with a dtype list (the "
            "guard in _misfit), or when every alternative failed on its dtype list"
        )
        for n in (3, 4)
    },
    **{f"{_M}x_explain__mutmut_{n}": _WRONG_KIND_ARG for n in (82, 84)},
    **{
        f"{_M}x_explain__mutmut_{n}": (
            "drops `arg` from a tuple's length refusal: no stage of ours takes a tuple, and a decorated function's "
            "messages have neither an explain hook nor an `at <stage>,` prefix, the only readers of `arg`"
        )
        for n in (24, 26)
    },
    **{f"{_M}x_explain__mutmut_{n}": _STRICT for n in (31, 34, 35)},
    f"{_M}x_explain__mutmut_38": (
        "a tuple's array parts made suspects only where they fail bearable() alone: that check runs in the call's "
        "jaxtyping memo, which holds every size bound so far (arguments, int sizes, shape_scope), so a part that "
        "disagrees with the call fails it too; the arrays_of test only spares that call (tests/test_shapecheck.py "
        "and tests/test_errors.py pass on the mutant)"
    ),
    f"{_M}xǁExplainedErrorǁ__init____mutmut_1": (
        "str() of an ExplainedError is never read: it is internal, and its one catcher (Session.check_arguments) "
        "reads .sentence"
    ),
    # --- cache ---
    **{f"{_C}x__precheck_append__mutmut_{n}": _OWN_SESSION for n in (13, 15, 20, 22)},
    f"{_C}xǁKVCacheǁcheck_append__mutmut_3": "signature_key tests its kwargs for truthiness only: None and {} alike",
    f"{_C}xǁKVCacheǁ_pass_through__mutmut_22": (
        "`window or 1` -> `window or 2`: a chunk passes through only a cache with a window (>= 1), so the fallback "
        "is never taken"
    ),
    # --- fast paths ---
    f"{_F}x_fused_qkv__mutmut_80": (
        "biases[1] for biases[0]: the line above returns unless all three biases are None or none is, so they agree"
    ),
    **{
        f"{_F}x_native_kernel__mutmut_{n}": (
            "need_weights left to its default or True: the kernel's first result, the output, is the same bits "
            "(tests/test_fused.py compares it with nn.MultiheadAttention's); the flag only adds averaged weights"
        )
        for n in (25, 26)
    },
    f"{_F}x_module_state__mutmut_2": (
        "count and newest start at 1: the count is one more in every state (compared only for equality), and the "
        "newest differs only while every hook's handle id is 0 or 1 (the first two hooks of the process)"
    ),
    f"{_F}x_module_state__mutmut_13": _NO_NONE_SUBMODULE,
    **{
        f"{_F}x_project__mutmut_{n}": (
            "the shortcut not taken: the plain nn.Linear is then called through nn.Module's call, which with no hook "
            "anywhere runs Linear.forward, the same F.linear(x, weight, bias) (about 1.5 us slower)"
        )
        for n in (2, 5)
    },
    f"{_F}x_project__mutmut_8": (
        "`weight is None` for `is not None`: a real weight then goes through nn.Module's call (Linear.forward: the "
        "same F.linear), and a None weight to F.linear directly, which fails as Linear.forward's own F.linear does"
    ),
    f"{_F}x_module_state__mutmut_26": (
        "the hooks counted down instead of up: states are only compared for equality, and -n is as distinct as n"
    ),
    # --- rotary ---
    f"{_R}xǁRotaryEmbeddingǁ__init____mutmut_11": (
        "persistent=None for False: torch's register_buffer tests it for truth, so the buffer is non-persistent alike"
    ),
    **{
        f"{_R}x__validate_partial_rotary__mutmut_{n}": (
            "the width refusal's arg dropped or renamed, or its dim: no explain hook reads them (the stage has none), "
            "a top-level call is never prefixed, and a module's nested call never reaches the refusal: the tables' "
            "d_rope is the module's rope_dim (checked where the rotary stage returns), which its constructor checked "
            "even and at most d_head"
        )
        for n in (11, 12, 14, 15, 16, 17, 18, 19)
    },
    # --- kernels ---
    f"{_K}x_rotate_part__mutmut_1": (
        "interleaved's default made True: its one caller, apply_partial_rotary, always passes it"
    ),
    f"{_K}x_open_empty_rows__mutmut_11": (
        "a float row with no key opened with 1.0 instead of 0.0: any constant row gives the same finite softmax "
        "(shift-invariant), and the row is zeroed after, its gradient with it"
    ),
    f"{_K}x_probabilities__mutmut_22": (
        "k.transpose(-1, 2) for (-1, -2): k is always (batch, heads, kv_seq, d_head), where axis 2 is axis -2"
    ),
    **{f"{_K}x_attend__mutmut_{n}": _OPENED_ANYWAY for n in (23, 28)},
    **{f"{_K}x_attend_native__mutmut_{n}": _OPENED_ANYWAY for n in (6, 9)},
    f"{_K}x_combine_masks__mutmut_1": (
        "gqa's default made True: attention_weights passes explicit=True (the shortcut never taken), and "
        "LatentAttention, which omits it, gives its expanded keys as many heads as the queries and decodes absorbed "
        "one query at a time, never causal-masked (seq > 1)"
    ),
    **{f"{_K}x_combine_masks__mutmut_{n}": _MASK_BUILT_ANYWAY for n in (7, 24, 27)},
    f"{_K}x_combine_masks__mutmut_44": (
        "the window applied where window_matters says it hides nothing (kv_seq <= window): tril(kv_seq - seq - window) "
        "is then empty (offset <= -seq), so the mask is unchanged"
    ),
    **{f"{_K}x_window_matters__mutmut_{n}": _MASK_BUILT_ANYWAY for n in (2, 4, 6)},
    f"{_K}x_open_rows__mutmut_1": _OPENED_ANYWAY,
    **{
        f"{_K}x_may_empty_rows__mutmut_{n}": (
            "may_empty made true in more cases (causal and square, or more queries than keys without causality): it "
            "only decides whether rows with no key are opened and zeroed, which does nothing where no row is empty"
        )
        for n in (3, 4)
    },
    f"{_K}x_sdpa_causal__mutmut_1": "gqa's default made True: both callers, combine_masks and native_causal, pass it",
    f"{_K}x_native_causal__mutmut_1": (
        "gqa's default made True: the callers that omit it (the module's MHA shortcut, LatentAttention's expanded "
        "keys) give q and k as many heads, where gqa is not read"
    ),
    f"{_K}x_native_causal__mutmut_5": (
        "seq >= 1 for > 1: differs only for one query against one key (square), which torch's causal mask leaves "
        "seeing that key, as no mask does"
    ),
    f"{_K}x_on_native_device__mutmut_1": (
        "the is_cpu shortcut never taken: device.type in NATIVE_GQA_DEVICES gives the same answer, 0.2 us slower"
    ),
    f"{_K}x_native_decodes__mutmut_4": (
        "< for <=: only a decoding call of exactly NATIVE_DECODE_MAX elements changes kernel, to the fold, which "
        "computes the same attention (both equal a per-head loop, tests/test_native_gqa.py), at a measured tie"
    ),
    f"{_K}x_sdpa_gqa__mutmut_13": (
        "dropout_p dropped from torch's GQA call: sdpa_gqa is reached only where native_gqa holds with fewer KV heads, "
        "which excludes dropout, so dropout_p is 0 there"
    ),
    f"{_K}x_sdpa_heads__mutmut_2": (
        "torch's enable_gqa=True for MHA too: with as many KV heads as query heads it has nothing to repeat, the same "
        "SDPA"
    ),
    f"{_K}x_folded_sinks__mutmut_12": (
        "flatten(1) for flatten(1, 2): the expanded sinks are 3-D (num_kv_heads, group, seq), so axis 2 is the last"
    ),
    f"{_K}x_weighted_values__mutmut_1": (
        "dropout_p >= 0 for > 0: F.dropout with p = 0 keeps every value (x * 1 / (1 - 0)), and its gradient"
    ),
    f"{_R}x_check_rotary_width__mutmut_11": (
        "d_head > 2 for d_head > 1: they differ only at d_head == 2, which is even and never reaches the message"
    ),
    # --- stages ---
    **{f"{_S}x_same_device_and_dtype__mutmut_{n}": _BOOL_NEVER_REFUSED for n in (15, 16)},
    **{f"{_S}x_same_device_and_dtype__mutmut_{n}": _PLAIN_NOT_MASK for n in (31, 33)},
    f"{_S}x_check_variants__mutmut_1": (
        "norm_eps's default 1.0 instead of 0.0: the default is only validated (is it a finite number >= 0), and both "
        "are; every caller that norms passes its own epsilon"
    ),
    f"{_S}x_explain_mask__mutmut_4": (
        "failure.arg or 'XXXX' for or '': both look up an argument no stage has, and get None"
    ),
    f"{_S}x__validate_attention__mutmut_20": (
        "'are q and k swapped?' also where num_kv_heads == num_heads: that many KV heads divide the query heads, so "
        "the message is never reached"
    ),
    **{f"{_S}x_check_cache__mutmut_{n}": _CACHE_KIND_ARG for n in (5, 7, 11, 12)},
    **{f"{_S}x_check_cache__mutmut_{n}": _CACHE_DTYPE_ARG for n in (30, 32)},
    **{f"{_S}x__precheck_cache__mutmut_{n}": _K_IS_A_TENSOR for n in (6, 7)},
    **{f"{_S}x__validate_seen__mutmut_{n}": _SEEN_DETAIL for n in (19, 20, 22, 23, 28, 29)},
    # --- contract ---
    **{
        f"{_CO}xǁ_Offǁ__repr____mutmut_{n}": (
            "the OFF sentinel's repr: nothing prints it (no message, trace or doc); mode is compared to it by identity"
        )
        for n in (1, 2)
    },
    f"{_CO}xǁVerdictsǁremember__mutmut_1": _MEMBERSHIP_NOTE,
    f"{_CO}x__add__mutmut_1": _MEMBERSHIP_NOTE,
    **{f"{_CO}xǁVerdictsǁremember__mutmut_{n}": _TUPLE_KEYS for n in (3, 5)},
    **{
        f"{_CO}xǁStageǁ__init____mutmut_{n}": (
            "include_extras dropped or falsy: it keeps only typing.Annotated metadata, and no stage annotates with "
            "Annotated (jaxtyping's arrays are classes); tests/test_contract.py makes stages at runtime for the rest"
        )
        for n in (3, 5, 6)
    },
    **{
        f"{_CO}xǁStageǁresult_names__mutmut_{n}": "zip's strict=None or left out: the same as strict=False"
        for n in (14, 17)
    },
    **{f"{_CO}xǁSessionǁreport__mutmut_{n}": "zip's strict=None or left out: the same as strict=False" for n in (6, 9)},
    f"{_CO}xǁStageǁresult_names__mutmut_18": (
        "zip strict=True: every stage whose result is reported names each part of it (trace, or one result and its "
        "name), so the lengths agree; the one that does not, KVCache.append's, is only used to check arguments"
    ),
    f"{_CO}xǁSessionǁcheck_arguments__mutmut_22": (
        "a stage's sources looked up by None instead of the argument's name: no stage keys its sources by an argument "
        "(they hold only 'result', which report reads), so the fallback is taken either way"
    ),
    f"{_CO}xǁSessionǁfits__mutmut_22": (
        "bind's label made None: bind uses it only in its misfit's message, which it never reads (only `is None`)"
    ),
    f"{_CO}x_relational__mutmut_11": (
        "a free size numbered -2 - i instead of -1 - i: still distinct negatives, never 0, 1 or a constant, and keys "
        "are only compared for equality"
    ),
    f"{_CO}x_remembered_forward__mutmut_20": (
        "check = None for False where the verdict is known: check is only read for truth (not check, if check)"
    ),
    **{
        f"{_CO}x_remembered_forward__mutmut_{n}": (
            "`state is not None or cache is not None` for `and`: state is None exactly when cache is (state() is a "
            "tuple)"
        )
        for n in (31, 49)
    },
    f"{_CO}xǁCallKeyǁrelations__mutmut_10": (
        "`kv_seq is not None` for `is None`: the flag is negated in every key alike, and keys are only compared for "
        "equality"
    ),
    # --- latent ---
    f"{_L}xǁLatentAttentionǁ_apply__mutmut_5": (
        "super()._apply(fn) without recurse: nn.Module._apply's recurse defaults to True, the value passed"
    ),
    **{f"{_L}xǁLatentAttentionǁ__init____mutmut_{n}": _BIAS_NONE for n in (95, 118, 142)},
    f"{_L}xǁLatentAttentionǁ__init____mutmut_170": (
        "q_lora_rank left out of the constants: no tensor a call passes has an axis checked against it (the "
        "bottleneck is internal), so an equality with it decides no check"
    ),
    f"{_L}xǁLatentAttentionǁ__init____mutmut_171": (
        "`q_lora_rank or 1` for `or 0` without a bottleneck: relational keeps 0 and 1 alike (sizes below 2)"
    ),
    f"{_L}xǁLatentAttentionǁ__init____mutmut_172": (
        "d_nope - d_rope for d_nope + d_rope among the constants: no axis of a call is checked against the query "
        "heads' width (internal), and an extra constant only splits keys (more checks, the same results)"
    ),
    f"{_L}xǁLatentAttentionǁ__init____mutmut_173": _RECHECKED_SPLIT,
    f"{_L}xǁLatentAttentionǁ_key__mutmut_26": _RECHECKED_SPLIT,
    f"{_L}xǁLatentAttentionǁ_key__mutmut_14": (
        "kv_seq keyed as d_model + len(cache) instead of seq + len(cache): a wrong mask passes unchecked only where it "
        "broadcasts (one key column), which a verdict allows only from a call with kv_seq 1, whose keyed value is "
        "d_model (a constant, kept as it is), never reached again with a filled cache; any other is rechecked"
    ),
    **{f"{_L}x__precheck_forward__mutmut_{n}": _TOP_LEVEL_DETAIL for n in (16, 17, 19, 20, 23, 24, 25, 26)},
    **{f"{_L}x__precheck_forward__mutmut_{n}": _TOP_LEVEL_DETAIL for n in (31, 33, 36, 37, 41, 43, 44, 45)},
    f"{_L}xǁLatentAttentionǁforward__mutmut_8": (
        "keyed also where the query is no tensor: computing its key fails (caught: checked) or holds its type, which "
        "no remembered call's key has, so it is checked and refused as before"
    ),
    f"{_L}xǁLatentAttentionǁ_absorbs__mutmut_18": (
        "getattr without a default: plain_linear has just established an nn.Linear, which always has `bias` (None)"
    ),
    # --- multi-head ---
    f"{_MH}x_forward_key__mutmut_3": "key.shape also where key is query: the same tensor, so the same shape",
    f"{_MH}x_forward_key__mutmut_8": (
        "the cache's parts of the key start as '' instead of None: without a cache they stay that constant, as None "
        "did, and with one they are set (kept stays '' without a window, as constant as None)"
    ),
    **{
        f"{_MH}x_forward_key__mutmut_{n}": (
            "the kind of key (of value) keyed also where it is query (key): it is then that tensor's kind, already in "
            "the key, and a call passing its own key (value) is still told apart by its shape's entry (None otherwise)"
        )
        for n in (27, 31)
    },
    **{
        f"{_MH}x_forward_key__mutmut_{n}": (
            "the shape of key (of value) keyed also where it is query (key): it is then that tensor's shape, "
            "already in the key, and a call passing its own key (value) is still told apart by its kind's entry"
        )
        for n in (68, 71)
    },
    f"{_MH}x_forward_key__mutmut_91": (
        "kv_seq keyed also without a mask: a finer key (more calls checked, never fewer), and without a mask no check "
        "reads kv_seq, so the calls it tells apart pass their checks alike"
    ),
    # sampled run of 2026-12-03 (branch mut-mh, seed 28)
    f"{_MH}x_forward_key__mutmut_50": (
        "the empty-rows flag made true also where seq equals kv_len: that equality is in the key already (the "
        "relations number equal sizes alike; with key the query it is constant), and with a cache it then only sets "
        "an empty cache's calls apart, a finer key"
    ),
    f"{_MH}x_forward_key__mutmut_17": (
        "a window cache's kept positions after the write keyed as kept - new for kept + new: no check reads them (the "
        "write's result binds kv_seq itself, masks are checked against seen + new, kv_len in the key, before they are "
        "cut to the kept positions), so the calls the key merges pass their checks alike"
    ),
    f"{_MH}xǁMultiHeadAttentionǁ__init____mutmut_407": (
        "window left out of the constants the relational key keeps literal: no check compares a size with it (the "
        "session's dimensions are the module's sizes and rope_dim; the window is a value the mask reads, and a "
        "cache's window is in the key's structure)"
    ),
    **{
        f"{_MH}x__precheck_forward__mutmut_{n}": (
            "drops or renames arg='key' of the rotary cross-attention refusal: the forward's precheck runs at top "
            "level (never prefixed) and its explain hook adds nothing for that arg with kv_seq, so the same message"
        )
        for n in (37, 44)
    },
    f"{_MH}xǁMultiHeadAttentionǁ__init____mutmut_412": (
        "rope_dim left out of the key's constants (None put in instead, which no size equals): no argument of the "
        "forward has a d_rope axis (it sizes only the tables and the rotated part, made inside), so no check compares "
        "an argument's size with it"
    ),
    f"{_MH}x__precheck_forward__mutmut_65": (
        "drops arg='kv_cache' of the narrower-window cache refusal: the forward's precheck runs at top level (never "
        "prefixed) and its explain hook adds nothing for kv_cache or None, so the same message"
    ),
    f"{_MH}xǁMultiHeadAttentionǁforward__mutmut_18": (
        "jit_tracing not passed to choose_path: without it choose_path asks torch.jit.is_tracing() itself, the answer "
        "the forward got a line before"
    ),
    f"{_MH}xǁMultiHeadAttentionǁ__init____mutmut_405": (
        "num_heads / d_head for num_heads * d_head among the key's constants: no argument's size is checked against "
        "the query projection's width (inputs against d_model, a cache against num_kv_heads and d_head); only the "
        "projections' weights have it, and their shapes are in the key through module_state"
    ),
    # --- prove ---
    f"{_P}xǁ_Decodeǁforward__mutmut_12": _ROOM,
    f"{_P}xǁ_LatentDecodeǁforward__mutmut_17": _ROOM,
    f"{_P}xǁ_Decodeǁforward__mutmut_31": (
        "the step's cache starts at position 1, not 0: only `seen` reads _start, for the values RoPE turns by and the "
        "temperature's (the window masks read it only with cache.window, None here), so every shape is the same"
    ),
    **{f"{_P}xǁShapeProofǁ__str____mutmut_{n}": _HIGHLIGHT for n in (12, 14, 15)},
    **{f"{_P}xǁ_Observerǁguarding_calls__mutmut_{n}": _INNERMOST_FIRST for n in (16, 19)},
    f"{_P}x__only_guards_true_everywhere__mutmut_73": (
        "the guard eval'd in this module's globals instead of empty builtins with min and max: the guard's names were "
        "checked first to be the sizes, min, max, and, or, not, which resolve alike in both"
    ),
    f"{_P}x__check_named__mutmut_35": (
        "zip without strict=True: the lengths of tokens and shape were just found equal (else `continue`)"
    ),
    f"{_P}x__prove_case__mutmut_112": (
        "the query's seq axis misspelt in the sizes by name: prefill adds the first parameter's own axes after it (the "
        "same key where that is `query`), and a decoding step's query has seq 1, a constant no guard names"
    ),
    # --- diagnose ---
    f"{_D}x_variants__mutmut_201": (
        "the padding-ignored variant's scenario given extra=None: a variant's scenario is only asked for expected(), "
        "which never reads extra (variants() reads it of the scenario diagnosed, never of a variant's)"
    ),
    f"{_D}x__layer_variants__mutmut_50": (
        "qk_norm_centred=None for False in the RMSNorm-for-LayerNorm variant: the reference reads it only for truth"
    ),
    f"{_D}x_variants__mutmut_163": (
        "is_causal=None for False in the no-own-key variant: the reference reads is_causal only for truth"
    ),
    f"{_D}x__mod_variants__mutmut_56": (
        "the reversed-heads variant also for one head, where last - h is h: it is the reference itself, which the "
        "output was just found to differ from (same tolerance, same rows), so it never matches"
    ),
    **{
        f"{_D}x_variants__mutmut_{n}": (
            "the (d_head num_heads) merge variant also for one head or d_head 1, where that order is the identity: it "
            "is the reference itself, which the output was just found to differ from, so it never matches"
        )
        for n in (38, 39, 41)
    },
    **{
        f"{_D}x_variants__mutmut_{n}": (
            "the grouped convention misspelt in its variant ('XXgroupedXX', 'GROUPED'): the reference tests kv_heads "
            "only for == 'interleaved', anything else is grouped, so the variant computes the same heads"
        )
        for n in (11, 12)
    },
    f"{_D}xǁToleranceǁholds__mutmut_2": (
        "outputs of other shapes held equal: holds is only asked of outputs of one shape, since judge refuses an "
        "output of another shape before any diagnosis, a variant or an isolated head changes weight values (never "
        "sizes), and `rows` selects from both alike"
    ),
    # --- toolkit ---
    **{
        f"shapesafe_mha.testing._toolkit.x__compare__mutmut_{n}": (
            "_compare's rope_style default misspelt ('XXhalfXX', 'HALF'): it is read only with RoPE on, and the one "
            "caller that passes rope_theta (_check) passes rope_style too; the suite's callers pass no RoPE"
        )
        for n in (3, 4)
    },
    "shapesafe_mha.testing._toolkit.x_judge__mutmut_38": (
        "the bug class found on every failing example, not only where the deviation is under 1e-5: the same "
        "name_bug of the same output, which diagnose would compute for the reported example anyway (slower only: "
        "each failing example of the search pays for it)"
    ),
    "shapesafe_mha.testing._toolkit.x_judge__mutmut_55": (
        "diagnose recomputes name_bug instead of reusing the matches found under 1e-5: the same call on the same "
        "output and scenario, so the same list (computed twice)"
    ),
    "shapesafe_mha.testing._toolkit.x_run_property__mutmut_1": (
        "run_property's cross default made True: it is read only without configs=, and the one caller without "
        "configs= (the CLI suite) passes cross itself; check_attention, check_module and check_hf_attention pass "
        "configs="
    ),
    **{
        f"shapesafe_mha.testing._toolkit.x__check__mutmut_{n}": (
            "_check's rope_style default misspelt ('XXhalfXX', 'HALF'): check_attention always passes its own, and "
            "check_module, which does not, never turns RoPE on (the reference reads rope_style only with rope_theta)"
        )
        for n in (4, 5)
    },
    **{
        f"shapesafe_mha.testing._toolkit.x__check__mutmut_{n}": (
            "the even_d_head constraint dropped (None or False) where rope=True: attention_configs draws an even "
            "d_head whenever rope is on, whatever even_d_head says"
        )
        for n in (62, 64)
    },
    "shapesafe_mha.testing._toolkit.x__check__mutmut_159": (
        "a float mask's hidden keys get -10001 instead of -1e4: the code and the reference receive the same mask, and "
        "either hides its keys (exp underflows to 0 in float64 and float32); tests/test_toolkit.py pins 0 where kept, "
        "at most -1e4 elsewhere"
    ),
    "shapesafe_mha.testing._toolkit.x__check__mutmut_180": (
        "RoPE's fallback theta 10001 instead of 10000: never taken, since rope=True draws its configs from "
        "attention_configs(rope=True), which always draws a theta (10, 1e4 or 5e5), and refuses configs= beside it"
    ),
    "shapesafe_mha.testing._toolkit.x__check__mutmut_257": (
        "run_property given kinds=None: it reads kinds only to draw configs without configs=, and _check always passes "
        "its strategy (configs= or attention_configs built from kinds)"
    ),
    "shapesafe_mha.testing._toolkit.x_check_mod__mutmut_17": (
        "a non-callable mod's count -2 instead of -1: only its membership in (None, 1, arity) is read, which neither "
        "is, and the message names its type from callable(mod), not from the count"
    ),
    # --- parallel ---
    f"{_PA}x__local_share__mutmut_35": (
        "bias=True left to MultiHeadAttention's default, which is True: the shard's projections get biases alike "
        "(those the module lacks are removed after)"
    ),
    f"{_PA}x__local_share__mutmut_63": (
        "rope_dim taken from the module also without RoPE: MultiHeadAttention's rope_dim is None exactly where its "
        "rotary is (both follow rope_theta), so the shard is given None alike"
    ),
    f"{_PA}xǁHeadParallelAttentionǁfrom_module__mutmut_55": (
        "the probe's output bias left in the module's dtype: the probe runs in that dtype (float32, float64), or in "
        "float32 for half precision, where adding the half bias promotes it exactly: the same sum"
    ),
    f"{_PA}xǁHeadParallelAttentionǁgather_gradients__mutmut_33": (
        "continue -> break where a projection has no bias: the bias is the last of (weight, bias), and an nn.Linear "
        "always has a weight, so nothing is left to skip"
    ),
    f"{_PA}xǁHeadParallelAttentionǁgather_gradients__mutmut_50": (
        "a replicated KV head's gradient counted on its second sharer instead of its first: backward summed the "
        "copies with an all-reduce, whose result every sharer holds alike, and a replicated head always has two "
        "sharers or more (plan_heads replicates only where world_size is a multiple of num_kv_heads above it)"
    ),
    # --- hf ---
    f"{_H}x__yarn_as_computed__mutmut_51": (
        "truncate read from a key no config has (so True): the line runs only where the layer's set differs from the "
        "top level of rope_parameters, which happens only where the top level holds sets per layer type (else the "
        "set is the top level itself), and then the top level has no truncate of its own: True either way"
    ),
    f"{_H}x__yarn_as_computed__mutmut_55": (
        "truncate read from a key no config has (so True): the line runs only where the layer's set differs from the "
        "top level of rope_parameters, which happens only where the top level holds sets per layer type (else the "
        "set is the top level itself), and then the top level has no truncate of its own: True either way"
    ),
    **{f"{_H}x_rope_layout_of__mutmut_{n}": _PROBE_X for n in (39, 41, 43)},
    f"{_H}x_qk_norm_names__mutmut_4": (
        "the fallback names garbled (k_norm misspelt): they are returned only for a layer holding none of q_norm, "
        "k_norm, query_layernorm and key_layernorm, where either name finds nothing"
    ),
    f"{_H}x__pairs_in__mutmut_12": "width <= 3 for width <= 2: the width is even at every call, so the same test",
    f"{_H}x_to_hf__mutmut_80": (
        "the GPT-J or CodeGen layer built (to read its RoPE) as layer 1 instead of 0: in_layer_rope reads only "
        "config.rotary_dim and the rotary class beside the layer's class, neither of which depends on its index"
    ),
    f"{_H}x_rope_interleaved__mutmut_52": (
        "the probe's q drawn from the global generator instead of a seeded one: an apply_rotary_pos_emb that turns "
        "adjacent pairs matches the paired rotation on every q, and one that does not differs from it by a nonzero "
        "linear map of q, under 1e-5 only on a null set of draws; the global generator is drawn from by the "
        "module's own init in from_hf anyway"
    ),
    f"{_H}x_latent_from_hf__mutmut_74": (
        "YaRN's mscale applied also at factor 1: (0.1 * mscale_all_dim * log(1) + 1.0) ** 2 is 1.0, the factor the "
        "other branch gives"
    ),
    f"{_H}x__write_blocks__mutmut_36": (
        "flatten(0) instead of flatten(0, 2) of the stacked biases: they are (blocks, 3, rows), three dimensions, so "
        "both flatten all of them"
    ),
    **{f"{_H}x_to_hf__mutmut_{n}": _STRICT for n in (267, 270)},
    f"{_H}x__rope_parameters__mutmut_9": _ROPE_SCALING_ALIAS,
    f"{_H}x__yarn_as_computed__mutmut_19": _ROPE_SCALING_ALIAS,
    f"{_H}x__yarn_as_computed__mutmut_28": (
        "rope_scaling no longer looked up after rope_parameters: transformers >= 5 (the project's floor) gives every "
        "config rope_parameters, and rope_scaling is its alias, so it is only ever reached where it is empty too"
    ),
    **{
        f"{_H}x__hf_outputs__mutmut_{n}": (
            "the probe's masks built without the layer's index (so from the first cache layer of the mask's kind): the "
            "prefill runs on an empty cache, where every layer's sizes are the query's, and the decoding step is one "
            "token, which sees every key its own cache layer keeps (a sliding layer's cache keeps only its window), so "
            "the masks allow the same keys (Gemma 2's layer 2, not its first sliding one, converts the same)"
        )
        for n in (76, 94, 102)
    },
    f"{_H}x_rope_interleaved__mutmut_17": (
        "width > 3 for width > 2: the rotated width is even at every call (tables of pairs), so the same test"
    ),
    f"{_H}x__layer_type__mutmut_13": "layer_idx's default None for 0: read through `or 0`, 0 alike",
    f"{_H}x_model_biases__mutmut_14": (
        "`or` for `and` before building MPT's biases: build_mpt_alibi_tensor is defined by MPT's modeling module "
        "alone, whose attention layer takes position_bias, so both hold together"
    ),
    f"{_H}x_model_biases__mutmut_31": (
        "max_seq_len's fallback None (a TypeError in max) where the config has none: the branch serves MPT's layers "
        "alone, whose config class always holds max_seq_len"
    ),
    f"{_H}x_from_hf__mutmut_1": (
        "from_hf's verify default made False: its callers (MultiHeadAttention.from_hf, and replace through it) always "
        "pass verify explicitly, so the default is never read"
    ),
    f"{_H}x_latent_from_hf__mutmut_1": (
        "latent_from_hf's verify default made False: its caller, LatentAttention.from_hf, always passes verify "
        "explicitly"
    ),
    f"{_H}x__suspects__mutmut_20": "decode=None for False: our_outputs reads it for truth only (`if not decode`)",
    f"{_H}x_sincos_rope__mutmut_49": (
        "width / 2 for width // 2 in the tables' expected shape: width is even at every call (in_layer_rope refuses "
        "an odd rotary_dim, the check draws even ones, the recipe passes 8), and a torch.Size equals a tuple holding "
        "2.0 where it holds 2"
    ),
    f"{_H}x__pairs_in__mutmut_31": (
        "the probe's q drawn from seed 1 instead of 0: GPT-J's apply_rotary_pos_emb and the paired rotation are "
        "compared in float64, where they agree to rounding on every q if the function pairs features and differ by "
        "O(1) on all but a null set of q if it does not"
    ),
    f"{_H}x_to_hf__mutmut_1": (
        "to_hf's verify default made False: its caller, MultiHeadAttention.to_hf, always passes verify explicitly"
    ),
    f"{_H}x__rope_parameters__mutmut_10": _ROPE_SCALING_ALIAS,
    **{
        f"{_H}x__write_blocks__mutmut_{n}": (
            "the biases reshaped otherwise (unflatten without sizes, another stack or flatten) where to_hf writes "
            "CodeGen's qkv_proj biases: it writes into a layer it builds from the config, and CodeGenAttention builds "
            "qkv_proj with "
            "bias=False, so that branch never runs"
        )
        for n in (35, 39, 40, 44, 49)
    },
    f"{_H}x_from_hf__mutmut_129": "layer_idx's default None for 0: read through `or 0`, 0 alike",
    f"{_H}x__split_grouped__mutmut_78": _STRICT,
    f"{_H}x_latent_from_hf__mutmut_208": "load_state_dict's strict=None for False: read for truth only, False alike",
    f"{_H}x_alibi_slopes_of__mutmut_6": (
        "Bloom's biases built in the default dtype (float32) instead of float64 for reading the slopes: Bloom's slopes "
        "are powers of two (for any head count) and the positions 0 and 1, exact in float32; MPT's builder takes no "
        "dtype"
    ),
    f"{_H}x_variant_options__mutmut_383": (
        "attn_temperature_tuning's default None for False: only its truth is read, False alike"
    ),
    f"{_H}x_latent_from_hf__mutmut_131": "attention_bias's default None for False: read through bool(), False alike",
    **{
        f"{_H}x__hf_outputs__mutmut_{n}": (
            "a layer probed through a plain DynamicCache instead of one built from its config: "
            "transformers' chunked and sliding masks are built from the cache they are given (the keys it keeps, "
            "their offset), so both compute the layer's attention alike (Llama 4's chunked layers convert and verify "
            "the same with chunks of 2, 3 and 4)"
        )
        for n in (222, 223, 224, 226, 228)
    },
    f"{_H}x_verify_against_hf__mutmut_84": (
        "the owner dropped from the first verify: its refusal is caught, and the second verify (with the owner and "
        "the suspects) raises the one the caller sees"
    ),
    f"{_H}x_model_biases__mutmut_8": (
        "the device's fallback None for the CPU: taken only by a layer without parameters, and every attention layer "
        "holds its projections'"
    ),
    f"{_H}x__hf_outputs__mutmut_110": (
        "the probe's masks built without position_ids: transformers then takes the positions from the cache, which "
        "are the ones passed (the prefill from 0 on an empty cache, the step at PROMPT after it; a shift turns only "
        "the rotary angles)"
    ),
    f"{_H}x_variant_options__mutmut_216": (
        "a softmax_scale exactly 1e-12 from the default loaded as query_pre_attn_scalar = softmax_scale ** -2 too: "
        "that computes the same scale to within 1e-12, which is all that differs"
    ),
    f"{_H}x__pairs_in__mutmut_26": (
        "the probe's q drawn in float32 instead of float64: both rotations compared are taken with float64 tables "
        "(promoted alike), so they agree to rounding where the function pairs features and differ by O(1) where it "
        "does not"
    ),
    f"{_H}x_model_biases__mutmut_35": (
        "MPT's biases built for kv_len positions instead of max(max_seq_len, kv_len): they are slope x (position - "
        "last), so the last kv_len of a longer build are the same values, and alibi_slopes_of reads a difference "
        "of neighbours"
    ),
    f"{_H}x_verify_against_hf__mutmut_66": (
        "a windowed module probed through its own cache (as long as its window) instead of one keeping every "
        "position: the prefill and the decoding step read only the last `window` keys either way, which both caches "
        "hold, so the outputs are the same"
    ),
    **{
        f"{_H}x__suspects__mutmut_{n}": (
            "the owner named in the second probe's verify: its refusal is caught and only whether it was raised is read"
        )
        for n in (9, 17)
    },
    f"{_H}x__split_per_head__mutmut_57": (
        "flatten(0) for flatten(0, 1) of a bias's rows: they are (heads, d_head), two dimensions, so both flatten all"
    ),
    **{f"{_H}x__split_stacked__mutmut_{n}": _STRICT for n in (54, 55)},
    f"{_H}x__split_chunked__mutmut_48": _STRICT,
    **{f"{_H}x_load_norms__mutmut_{n}": _STRICT for n in (16, 19)},
    f"{_H}x__multi_query__mutmut_13": "multi_query's default None for False: read through bool(), False alike",
    f"{_H}x_variant_options__mutmut_152": (
        "scale_attn_weights' default None for True: only `is False` is asked of it, which neither default is"
    ),
    f"{_H}x__suspects__mutmut_5": (
        "getattr(ours, 'rotary') without a default: `ours` is always the module being verified, a MultiHeadAttention "
        "or a LatentAttention (or a subclass), and both set .rotary in __init__ (None without RoPE)"
    ),
    f"{_H}x_rope_interleaved__mutmut_55": (
        "the probe's q of two heads instead of one: the model's function and the paired rotation turn every head "
        "alike, so the comparison is the one head's twice"
    ),
    f"{_H}x_rope_interleaved__mutmut_47": (
        "the probe's q drawn in float32 instead of float64: both rotations compared are taken with the float64 tables "
        "(promoted alike, or cast inside by the model's function in either case), so they agree to rounding where "
        "the function pairs features and differ by O(1) where it does not, against a tolerance of 1e-5"
    ),
    **{
        f"{_H}x_rope_interleaved__mutmut_{n}": (
            "the tables' row of position 1 or 2 read instead of position 3 (the last): a row holds each angle twice in "
            "a row at every position of a table that repeats them (Cohere's), and a table in halves fails the test at "
            "any of them, its first two angles being 1 and theta ** (-2 / width) (or their scaled values, all at most "
            "1), whose cosines differ at positions 1 to 3 alike (cos is one-to-one on [0, pi])"
        )
        for n in (9, 10)
    },
    f"{_H}x__turning_shift__mutmut_21": (
        "context >= PROMPT for context > PROMPT: at context == PROMPT the shift it returns, context - PROMPT, is the "
        "0 of the other branch"
    ),
    f"{_H}x_alibi_slopes_of__mutmut_20": (
        "the padding mask for Bloom's build_alibi_tensor three keys long instead of two: its biases are slope x "
        "position (the mask's cumsum less 1), so key 1's less key 0's is the slope either way; MPT's "
        "build_mpt_alibi_tensor is not given the mask"
    ),
}

KILLED, TIMEOUT, SURVIVED, NO_TESTS = "killed", "timeout", "survived", "no tests"


def results(cwd: Path) -> dict[str, str]:
    """mutant name -> status, as `mutmut results --all true` prints them."""
    command = [sys.executable, "-m", "mutmut", "results", "--all", "true"]
    out = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            found[name] = status
    return found


def generated(path: Path) -> list[str]:
    """Every mutant mutmut generates for one source file (by mutmut's own generator), sorted by name."""
    # the `mutation` extra: CI, which never generates mutants, type-checks this without it installed
    from mutmut.mutation.file_mutation import mutate_file_contents  # pyright: ignore[reportMissingImports]

    module = path.with_suffix("").as_posix().replace("/", ".")
    mutated = mutate_file_contents(str(path), path.read_text())
    return sorted(f"{module}.{name}" for name in mutated.mutant_names)


def sample(names: list[str], size: int, seed: int) -> list[str]:
    """A uniform sample of `names`: the first `size` of a shuffle seeded by `seed` (a smaller size, a prefix)."""
    shuffled = sorted(names)
    random.Random(seed).shuffle(shuffled)
    return shuffled[:size]


def module_of(mutant: str) -> str:
    """`shapesafe_mha._compute.cache.xǁKVCacheǁappend__mutmut_3` -> `shapesafe_mha._compute.cache`."""
    parts = mutant.split(".")
    return ".".join(parts[: next(i for i, p in enumerate(parts) if p.startswith("x"))])


def scores(statuses: dict[str, str]) -> dict[str, dict[str, float | int]]:
    table: dict[str, Counter[str]] = {}
    for name, status in statuses.items():
        counts = table.setdefault(module_of(name), Counter())
        counts["equivalent" if name in EQUIVALENT and status == SURVIVED else status] += 1
    rows = {}
    for module, counts in sorted(table.items()):
        caught = counts[KILLED] + counts[TIMEOUT]
        ran = caught + counts[SURVIVED] + counts[NO_TESTS]
        if ran == 0:
            continue  # not run yet (mutmut lists every generated mutant)
        rows[module] = {
            KILLED: counts[KILLED],
            TIMEOUT: counts[TIMEOUT],
            SURVIVED: counts[SURVIVED],
            NO_TESTS: counts[NO_TESTS],
            "equivalent": counts["equivalent"],
            "score": round(caught / ran, 3),
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cwd", type=Path, default=ROOT, help="where mutmut ran (its mutants/ folder)")
    parser.add_argument("--record", action="store_true", help="write docs/mutmut-scores.json")
    parser.add_argument("--note", default="", help="what the run covered, for the record")
    parser.add_argument("--sample", type=Path, help="print a seeded sample of this source file's mutant names")
    parser.add_argument("--size", type=int, default=300, help="how many names --sample prints")
    parser.add_argument("--seed", type=int, default=28, help="the shuffle's seed for --sample")
    args = parser.parse_args()
    if args.sample is not None:
        print("\n".join(sample(generated(args.sample), args.size, args.seed)))
        return
    import torch

    statuses = results(args.cwd)
    record = {
        "modules": scores(statuses),
        "run": {
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "where": "2-core CPU machine, mutmut --max-children 1-2",
            "note": args.note,
        },
        "survivors": sorted(n for n, s in statuses.items() if s == SURVIVED and n not in EQUIVALENT),
    }
    print(scores_markdown(record))
    if args.record:
        RECORD.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
