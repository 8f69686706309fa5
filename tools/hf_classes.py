"""Every attention class of the installed transformers through `check_hf_attention`: a verdict for each.

    python -m tools.hf_classes                 # print the table
    python -m tools.hf_classes --write         # rewrite docs/hf-attention-classes.md from it
    python -m tools.hf_classes -k llama        # only classes whose name contains "llama"

The classes: every `...Attention` class defined in the modeling module of a causal-LM model type
(transformers' own mapping), built from the config class its constructor is annotated with (else the
model type's), tiny sizes drawn by the check. Each is checked eager and sdpa with a few examples per
property. Verdicts: **pass**; **refused**, with the first line of our ConfigError (a variant or layout
the reference does not compute, named); **fail** (an AssertionError on correct upstream code: a false
alarm) and **crash** (any other exception from inside the check): the test fails on either. New
classes of a future transformers appear without edits.
"""

import argparse
import importlib
import inspect
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PAGE = Path(__file__).resolve().parent.parent / "docs" / "hf-attention-classes.md"
ARCHITECTURES = PAGE.with_name("hf-architectures.md")  # tools/hf_sweep.py's: whole models under "shapesafe"
IMPLEMENTATIONS = ("eager", "sdpa")
EXAMPLES = 3  # per property and implementation: the sweep is a census of verdicts, the tests check deeper
BAD = ("fail", "crash")
SUFFIX = " is not computed by the per-head reference; it cannot be checked against it."


@dataclass(frozen=True)
class Row:
    attention: str
    config: str
    verdicts: tuple[str, ...]  # one per implementation
    detail: str = ""
    seconds: float = 0.0
    model_types: tuple[str, ...] = ()

    @property
    def verdict(self) -> str:
        return next((v for v in BAD if v in self.verdicts), self.verdicts[0])


def classes(pattern: str = "") -> list[tuple[type, type, tuple[str, ...]]]:
    """`(attention class, config class, model types)` for every attention class of a causal-LM model type, sorted
    by name; the model types are those whose modeling module defines the class (`llama4` and `llama4_text`)."""
    from torch import nn
    from transformers import CONFIG_MAPPING, PretrainedConfig
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found: dict[type, type] = {}
    types: dict[type, list[str]] = {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        module_name = model_type_to_module_name(model_type)
        try:
            modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
        except Exception:
            continue  # a model type served by another model's module (it appears there)
        for name, cls in vars(modeling).items():
            if not (inspect.isclass(cls) and issubclass(cls, nn.Module) and name.endswith("Attention")):
                continue
            if cls.__module__ != modeling.__name__ or pattern.lower() not in name.lower():
                continue
            types.setdefault(cls, []).append(model_type)
            if cls in found:
                continue
            parameter = inspect.signature(cls.__init__).parameters.get("config")
            annotation = None if parameter is None else parameter.annotation
            if isinstance(annotation, str):
                annotation = getattr(modeling, annotation, None)
            found[cls] = _config_class(annotation, CONFIG_MAPPING[model_type], PretrainedConfig)
    return sorted(((c, f, tuple(types[c])) for c, f in found.items()), key=lambda row: row[0].__name__)


def _config_class(annotation: Any, fallback: type, base: type) -> type:
    """The config class an attention class is built from: its annotation (a member of `X | None`), else the
    model type's; a composite config (Qwen3.5's, Emu3's) stands for its `text_config`, which the decoder gets."""
    members = [
        a for a in (*getattr(annotation, "__args__", ()), annotation) if inspect.isclass(a) and issubclass(a, base)
    ]
    config_cls = members[0] if members else fallback
    text = getattr(config_cls, "sub_configs", {}).get("text_config")
    return text if inspect.isclass(text) and issubclass(text, base) else config_cls


def _first(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def check_one(
    attention_cls: type, config_cls: type, examples: int = EXAMPLES, model_types: tuple[str, ...] = ()
) -> Row:
    import shapesafe_mha as ssm
    from shapesafe_mha.testing.hf import check_hf_attention

    verdicts, details = [], []
    start = time.perf_counter()
    for implementation in IMPLEMENTATIONS:
        try:
            check_hf_attention(attention_cls, config_cls, attn_implementation=implementation, max_examples=examples)
            verdicts.append("pass")
        except ssm.ConfigError as error:
            heading = f"check_hf_attention(): {attention_cls.__name__}: "
            first = _first(error)
            if not first.startswith(heading):  # a refusal must name the class (never another function's name)
                verdicts.append("crash")
                details.append(f"ConfigError not headed {heading!r}: {first}")
                continue
            verdicts.append("refused")
            details.append(first.removeprefix(heading).removesuffix(SUFFIX))
        except AssertionError as error:
            verdicts.append("fail")
            details.append(_first(error))
        except Exception as error:
            verdicts.append("crash")
            details.append(f"{type(error).__name__}: {_first(error)}")
    detail = details[0] if details and all(d == details[0] for d in details) else " / ".join(details)
    seconds = time.perf_counter() - start
    return Row(attention_cls.__name__, config_cls.__name__, tuple(verdicts), detail[:220], seconds, model_types)


def sweep(pattern: str = "", report: bool = False, examples: int = EXAMPLES) -> list[Row]:
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny layers: one thread is fastest, and a shared machine's cores stay free
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for attention_cls, config_cls, model_types in classes(pattern):
                rows.append(row := check_one(attention_cls, config_cls, examples, model_types))
                if report:
                    print(f"{row.attention:36s} {'/'.join(row.verdicts):16s} {row.seconds:5.1f}s {row.detail}",
                          flush=True)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return rows


def whole_models(page: Path = ARCHITECTURES) -> dict[str, str]:
    """model type -> its verdict under `attn_implementation="shapesafe"`, read from tools/hf_sweep.py's page
    (tests/test_hf_models.py fails when that page is stale), so the two sweeps make one table."""
    found = re.findall(r"^\| `([^`]+)` \| ([^|]+?) \|", page.read_text(), flags=re.M)
    return dict(found)


def counts(rows: list[Row]) -> dict[str, int]:
    return {v: sum(r.verdict == v for r in rows) for v in ("pass", "refused", *BAD)}


def render(rows: list[Row], whole: dict[str, str] | None = None) -> str:
    import transformers

    whole = whole_models() if whole is None else whole
    tally = ", ".join(f"{n} {v}" for v, n in counts(rows).items())
    lines = [
        "# Every attention class of transformers through `check_hf_attention`",
        "",
        f"Each `...Attention` class of a causal-LM model type of transformers {transformers.__version__}, built",
        f"tiny from its config class and checked eager and sdpa (float32, {EXAMPLES} examples per property) by",
        "`python -m tools.hf_classes --write`; tests/test_hf_classes.py fails if this page is stale or any row",
        f"fails or crashes. {len(rows)} classes: {tally}.",
        "",
        "A refusal is a `ConfigError` whose first line names the class and what the per-head reference does not",
        "compute (the variant or the layout, as listed here); it is a verdict, not a failure: the check does not",
        "call correct code wrong. Time: both implementations, on one thread. The last column is the",
        "[whole-model sweep](hf-architectures.md)'s verdict for each model type whose module defines the class:",
        "its tiny model's logits under `attn_implementation=\"shapesafe\"` against transformers' own.",
        "",
        '| class | config | eager / sdpa | time | reason refused | whole model under `"shapesafe"` |',
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        detail = row.detail.replace("|", "\\|").replace("\n", " ")
        verdicts = " / ".join(row.verdicts)
        models = ", ".join(f"`{t}`: {whole.get(t, 'not in the sweep')}" for t in row.model_types)
        lines.append(f"| `{row.attention}` | `{row.config}` | {verdicts} | {row.seconds:.1f} s | {detail} | {models} |")
    return "\n".join(lines) + "\n"


def without_times(page: str) -> str:
    """The page with its time column blanked: what a stale page is told by (times vary from run to run)."""
    return re.sub(r"\| [0-9.]+ s \|", "| |", page)


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {PAGE.name}")
    parser.add_argument("-k", default="", help="only classes whose name contains this")
    parser.add_argument("--examples", type=int, default=EXAMPLES)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = sweep(args.k, report=True, examples=args.examples)
    print(f"{len(rows)} classes in {time.perf_counter() - started:.0f} s: {counts(rows)}")
    if args.write:
        PAGE.write_text(render(rows))
    sys.exit(1 if any(r.verdict in BAD for r in rows) else 0)


if __name__ == "__main__":
    main()
