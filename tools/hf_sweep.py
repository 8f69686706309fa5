"""Every causal LM architecture of the installed transformers, built tiny, under `attn_implementation="shapesafe"`.

    python -m tools.hf_sweep                 # print the table
    python -m tools.hf_sweep --write         # rewrite docs/hf-architectures.md from it
    python -m tools.hf_sweep -k llama        # only model types containing "llama"

For each model type in transformers' causal-LM mapping: its config built tiny (random init, no
download), the model under the reference implementation (`"sdpa"`, or `"eager"` where sdpa refuses the
model) and under `"shapesafe"` with the same weights, logits compared in float64 (float32 where the
model cannot run in float64). Verdicts: **equal**; **refused**, with our ConfigError's reason (a variant
we do not compute); **not through the interface** (the model does not take a registered attention
implementation); **not built tiny** (its config or model cannot be built at these sizes: not ours to
judge); **differs** or **fails** (a defect of ours: the test fails on any). New architectures of a future
transformers appear without edits.
"""

import argparse
import contextlib
import copy
import re
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PAGE = Path(__file__).resolve().parent.parent / "docs" / "hf-architectures.md"
SIZES = {
    "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
    "num_hidden_layers": 2, "vocab_size": 101, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    "max_position_embeddings": 64,
}  # fmt: skip
MAX_PARAMETERS = 2_000_000
TOLERANCE = 1e-6  # float64 logits; eager references compute softmax in float32 inside
BAD = ("differs", "fails")


@dataclass(frozen=True)
class Row:
    model_type: str
    verdict: str  # equal, refused, not through the interface, not built tiny, differs, fails
    reference: str = ""
    detail: str = ""
    seconds: float = 0.0


def _first(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:150] if text else ''}"


def sweep_one(model_type: str) -> Row:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    import shapesafe_mha as ssm
    import shapesafe_mha.hf

    start = time.perf_counter()
    shapesafe_mha.hf.register()
    try:
        config = CONFIG_MAPPING[model_type](**SIZES)
        rotary = getattr(config, "rotary_dim", None)  # GPT-J, CodeGen: 64 features by default, wider than a tiny head
        if isinstance(rotary, int) and getattr(config, "rope_parameters", None) is None:
            head = config.hidden_size // config.num_attention_heads
            if rotary > head:
                config.rotary_dim = head // 2
    except Exception as error:
        return Row(model_type, "not built tiny", detail=_first(error), seconds=time.perf_counter() - start)
    try:  # a config that ignores the tiny sizes (sub-configs of its own) would build a real model: not here
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(copy.deepcopy(config)).parameters())
    except Exception as error:
        return Row(model_type, "not built tiny", detail=_first(error), seconds=time.perf_counter() - start)
    if size > MAX_PARAMETERS:
        detail = f"{size:,} parameters at these sizes (its config keeps sizes of its own)"
        return Row(model_type, "not built tiny", detail=detail, seconds=time.perf_counter() - start)
    ids = torch.randint(3, 101, (2, 7), generator=torch.Generator().manual_seed(0))
    reference = None
    for dtype in (torch.float64, torch.float32):
        for implementation in ("sdpa", "eager"):
            try:
                torch.manual_seed(0)
                theirs = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation,
                                                          dtype=dtype).eval()  # fmt: skip
                with torch.no_grad():
                    expected = theirs(ids).logits
                reference = implementation
                break
            except Exception as error:
                last = error
        if reference is not None:
            break
    if reference is None:
        return Row(model_type, "not built tiny", detail=_first(last), seconds=time.perf_counter() - start)
    try:
        ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="shapesafe",
                                                dtype=dtype).eval()  # fmt: skip
    except Exception as error:
        verdict = "not through the interface" if "attn_implementation" in str(error) else "fails"
        return Row(model_type, verdict, reference, _first(error), time.perf_counter() - start)
    calls = []
    interface = _counting(calls)
    try:
        ours.load_state_dict(theirs.state_dict())
        with torch.no_grad(), interface:
            got = ours(ids).logits
    except ssm.ConfigError as error:
        reason = str(error).splitlines()[0]
        return Row(model_type, "refused", reference, re.sub(r"^\S+: ", "", reason)[:160], time.perf_counter() - start)
    except Exception as error:
        verdict = "fails" if calls else "not through the interface"
        return Row(model_type, verdict, reference, _first(error), time.perf_counter() - start)
    if not calls:
        detail = "computes attention itself: attn_implementation is not used"
        return Row(model_type, "not through the interface", reference, detail, time.perf_counter() - start)
    difference = float((got - expected).abs().max())
    verdict = "equal" if difference <= TOLERANCE * (1 if dtype == torch.float64 else 1e2) else "differs"
    detail = f"max difference {difference:.1e} ({str(dtype).removeprefix('torch.')})"
    return Row(model_type, verdict, reference, detail, time.perf_counter() - start)


@contextlib.contextmanager
def _counting(calls: list[int]) -> Iterator[None]:
    """`"shapesafe"` registered with a function that counts its calls (a model may not use the interface)."""
    from transformers import AttentionInterface

    import shapesafe_mha.hf

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return shapesafe_mha.hf.attention(*args, **kwargs)

    AttentionInterface.register("shapesafe", counted)
    try:
        yield
    finally:
        shapesafe_mha.hf.register()


def sweep(pattern: str = "", report: bool = False) -> list[Row]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest, and a shared machine's cores stay free
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
                if pattern in model_type:
                    rows.append(row := sweep_one(model_type))
                    if report:
                        print(f"{row.model_type:28s} {row.verdict:26s} {row.reference:6s} {row.seconds:5.1f}s "
                              f"{row.detail}", flush=True)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return rows


def render(rows: list[Row]) -> str:
    import transformers

    counts = {v: sum(r.verdict == v for r in rows) for v in dict.fromkeys(r.verdict for r in rows)}
    lines = [
        "# Hugging Face architectures under `attn_implementation=\"shapesafe\"`",
        "",
        f"Every causal LM architecture of transformers {transformers.__version__}, built tiny from its config",
        "(random weights), its logits under `\"shapesafe\"` compared with the reference implementation's, by",
        "`python -m tools.hf_sweep --write` (tests/test_hf_models.py fails if this page is stale or any row",
        "differs or fails). " + ", ".join(f"{n} {v}" for v, n in counts.items()) + ".",
        "",
        "| architecture | verdict | reference | detail |",
        "|---|---|---|---|",
    ]
    for row in rows:
        detail = row.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{row.model_type}` | {row.verdict} | {row.reference} | {detail} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {PAGE.name}")
    parser.add_argument("-k", default="", help="only model types containing this")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = sweep(args.k, report=True)
    print(f"{len(rows)} architectures in {time.perf_counter() - started:.0f} s")
    if args.write:
        PAGE.write_text(render(rows))
    sys.exit(1 if any(r.verdict in BAD for r in rows) else 0)


if __name__ == "__main__":
    main()
