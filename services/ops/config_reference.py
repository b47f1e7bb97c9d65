"""`marge config reference`: every section and field of a run's config, generated from the dataclasses that
define them, so the reference cannot fall behind the code (docs/configuration.md is this output; a test
regenerates and compares it).

For each field: its YAML type, the default (what a config that leaves it out gets), the value in
`deploy/configs/paper.yaml` (the paper's setting; for `model`, the `paper` preset) and in the learning recipe
(`deploy/configs/learning.yaml`), and its documentation: the string literal written under the field in the
dataclass (the project's convention for field docs), followed by whether a resumed run may change it (the field's
`marge.contracts.config.resumable` mark).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
import typing
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "deploy" / "configs"


def field_docs(cls: type) -> dict[str, str]:
    """{field: the string literal under it} for a dataclass and its bases (the nearest definition wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
        for node, after in zip(body, [*body[1:], None]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def type_name(typ: Any) -> str:
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is typing.Union or (origin is not None and type(None) in args and origin.__name__ == "UnionType"):
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if type(None) in args:
        return " or ".join(type_name(a) for a in args if a is not type(None)) + " or null"
    if origin in (list, tuple):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {type_name(args[1])}" if len(args) == 2 else "mapping"
    if dataclasses.is_dataclass(typ):
        return "section"
    return {int: "int", float: "float", str: "str", bool: "bool"}.get(typ, getattr(typ, "__name__", str(typ)))


def show(value: Any) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a section's value, never its class
        value = dataclasses.asdict(value)
    text = json.dumps(value, default=str)
    return "`" + (text if len(text) <= 40 else text[:37] + "...") + "`"


def rows(cls: type, prefix: str, paper: Any, learning: Any) -> list[tuple[str, str, str, str, str, str]]:
    """(key, type, default, paper.yaml, learning.yaml, doc) for every leaf of a section, nested sections expanded."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        key, typ = f"{prefix}.{f.name}", hints[f.name]
        nested = next((a for a in (typ, *typing.get_args(typ)) if isinstance(a, type) and dataclasses.is_dataclass(a)),
                      None)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        paper_value = getattr(paper, f.name, None) if paper is not None else None
        learning_value = getattr(learning, f.name, None) if learning is not None else None
        if nested is not None:
            out.append((key, "section" + (" (optional: null turns it off)" if type(None) in typing.get_args(typ) else ""),
                        "null" if default is None else "", show(paper_value) if paper_value is None else "on",
                        show(learning_value) if learning_value is None else "on", docs.get(f.name, "")))
            out += rows(nested, key, paper_value, learning_value)
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append((key, type_name(typ), "(required)" if required else show(default), show(paper_value),
                    show(learning_value), docs.get(f.name, "")))
    return out


def model_rows(paper_cfg, learning_cfg) -> list[tuple[str, str, str, str, str, str]]:
    from marge.model.architecture import MargeConfig, preset

    hints, docs = typing.get_type_hints(MargeConfig), field_docs(MargeConfig)
    tiny = preset("tiny")
    paper = paper_cfg.model_config(vocab_size=paper_cfg.data.vocab_size)
    learning = learning_cfg.model_config(vocab_size=learning_cfg.data.vocab_size)
    out = [("model.preset", "str", "(required)", show(paper_cfg.model["preset"]), show(learning_cfg.model["preset"]),
            "The architecture: `tiny`, `base` or `paper`; every field below may be set beside it to override the "
            "preset's value (`model.d_model: 128`). The default column is the `tiny` preset's value.")]
    for f in dataclasses.fields(MargeConfig):
        out.append((f"model.{f.name}", type_name(hints[f.name]), show(getattr(tiny, f.name)),
                    show(getattr(paper, f.name)), show(getattr(learning, f.name)), docs.get(f.name, "")))
    return out


def reference() -> str:
    """The whole reference as Markdown."""
    from marge.contracts.config import may_change_on_resume
    from services.driver.config import RESUMABLE, PipelineConfig, load_config

    paper = load_config(CONFIGS / "paper.yaml")
    learning = load_config(CONFIGS / "learning.yaml")
    lines = ["# Configuration reference", "",
             "Generated by `marge config reference` from the config dataclasses (do not edit by hand; a test keeps it "
             "equal to the code). A run's config is `deploy/configs/<name>.yaml` plus `section.key=value` overrides on "
             "the command line; every value is checked when the file is loaded, before anything starts.", "",
             "Columns: the default (what a config that leaves the key out gets), the value in "
             "`deploy/configs/paper.yaml` (the paper's setting) and in the learning recipe "
             "`deploy/configs/learning.yaml`.", ""]
    for f in dataclasses.fields(PipelineConfig):
        lines += [f"## `{f.name}`", ""]
        section_rows = model_rows(paper, learning) if f.name == "model" else rows(
            typing.get_type_hints(PipelineConfig)[f.name], f.name, getattr(paper, f.name), getattr(learning, f.name))
        doc = field_docs(PipelineConfig).get(f.name)
        whole = f"{f.name}." in RESUMABLE
        if doc or whole:
            lines += [" ".join(filter(None, [doc, "A resumed run may change any key of this section." if whole
                                             else ""])), ""]
        lines += ["| key | type | default | paper.yaml | learning.yaml | what it does |", "|---|---|---|---|---|---|"]
        for key, typ, default, paper_value, learning_value, text in section_rows:
            if not whole and may_change_on_resume(key, RESUMABLE):
                text = f"{text} A resumed run may change it." if text else "A resumed run may change it."
            text = text.replace("|", "\\|")
            lines.append(f"| `{key}` | {typ} | {default} | {paper_value} | {learning_value} | {text} |")
        lines.append("")
    return "\n".join(lines)
