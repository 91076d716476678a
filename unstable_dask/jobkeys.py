"""The job-key reference, docs/job-keys.md, generated from the config classes.

Every key's description is its field's docstring (`Strict` reads them: use_attribute_docstrings);
its type, default and allowed values come from the field itself (Literal types, Field bounds).
The tables are walked from `Job` as jobfile.py reads a file: a model field is a table
(`[model.lora]`), a list of models an array of tables (`[[round.train_envs]]`), a dict of models
tables by name (`[endpoints.<name>]`); `[learn]` adds, per algorithm, the keys its Config class
declares beside the shared ones. `python -m unstable_dask.jobkeys` rewrites the page;
tests/config/test_job_keys.py fails when the page and the code drift.

On the top floor (tests/test_layout.py): it reads the algorithms' registry, which the learn stage owns.
"""
from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from unstable_dask.config import Job, LearnConfig
from unstable_dask.learn import algorithms

PAGE = Path("docs/job-keys.md")  # from the repository root
COMMAND = "python -m unstable_dask.jobkeys"
_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "length >="),
           ("max_length", "length <="))


@dataclass(frozen=True)
class Table:
    """One table of the job file: its header, the dotted prefix of its keys, and the keys it documents."""
    header: str  # "[model.lora]", "[[round.train_envs]]", "[endpoints.<name>]", '[learn] algorithm = "grpo"'
    path: str  # "model.lora", "round.train_envs", "endpoints.<name>", "learn"
    model: type[BaseModel]
    about: str
    keys: tuple[str, ...]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The model classes an annotation names, at any depth (Optional[...], list[...], dict[str, ...])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _shape(annotation: Any) -> str:
    """How a model-typed field appears in the file: table, array (of tables) or named (tables)."""
    origin = typing.get_origin(annotation)
    return "array" if origin is list else "named" if origin is dict else "table"


def _tables(model: type[BaseModel], path: str, header: str, about: str) -> list[Table]:
    keys, nested = [], []
    for name, f in model.model_fields.items():
        if f.exclude:  # not a key of the file (Job.source)
            continue
        inner = _models_in(f.annotation)
        if not inner:
            keys.append(name)
            continue
        shape, sub = _shape(f.annotation), f"{path}.{name}" if path else name
        if shape == "array":
            about_sub = f"{f.description} Default: `{_toml(f.default)}`."
            nested += _tables(inner[0], sub, f"[[{sub}]]", about_sub)
        elif shape == "named":
            nested += _tables(inner[0], f"{sub}.<name>", f"[{sub}.<name>]", f.description or "")
        else:
            nested += _tables(inner[0], sub, f"[{sub}]", f.description or "")
            if inner[0] is LearnConfig:
                nested += _algorithm_tables()
    return ([Table(header, path, model, about, tuple(keys))] if keys else []) + nested


def _algorithm_tables() -> list[Table]:
    """Per algorithm: the [learn] keys its Config adds, and the shared ones whose default it changes."""
    shared = LearnConfig.model_fields
    out = []
    for name in algorithms.ALGORITHMS:
        cls = algorithms.config_class(name)
        keys = tuple(k for k, f in cls.model_fields.items() if k != "algorithm" and
                     (k not in shared or f.default != shared[k].default))
        about = (f"{cls.model_fields['algorithm'].description} Its keys beside the shared [learn] keys, and "
                 f"the shared keys whose default it changes.")
        out.append(Table(f'[learn] algorithm = "{name}"', "learn", cls, about, keys))
    return out


def tables() -> list[Table]:
    """Every table of the job file, in the order of `Job`'s fields."""
    return _tables(Job, "", "", "")


def models_under(root: type[BaseModel]) -> list[type[BaseModel]]:
    """`root` and every model class its fields' types reach, at any depth."""
    found: list[type[BaseModel]] = []

    def walk(cls: type[BaseModel]) -> None:
        if cls not in found:
            found.append(cls)
            for f in cls.model_fields.values():
                for m in _models_in(f.annotation):
                    walk(m)
    walk(root)
    return found


def config_classes() -> list[type[BaseModel]]:
    """Every settings class a job file reaches: walked from `Job` (a new nested class is found on its
    own), plus each algorithm's `[learn]` Config."""
    found = models_under(Job)
    for name in algorithms.ALGORITHMS:
        found += [m for m in models_under(algorithms.config_class(name)) if m not in found]
    return found


def undocumented(classes: list[type[BaseModel]]) -> list[str]:
    """`Class.field` for every field without a description."""
    return [f"{c.__module__}.{c.__qualname__}.{k}" for c in classes for k, f in c.model_fields.items()
            if not (f.description or "").strip()]


def keys() -> set[str]:
    """Every documented key, dotted from the file's root (`model.lora.rank`, `endpoints.<name>.model`)."""
    return {f"{t.path}.{k}" for t in tables() for k in t.keys}


def _toml(v: Any) -> str:
    """A default as it would be written in the job file; `unset` for None (TOML has no null)."""
    if v is PydanticUndefined:
        return "required"
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, BaseModel):
        v = {k: getattr(v, k) for k in type(v).model_fields if k in v.model_fields_set}
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }" if v else "{}"
    return "[" + ", ".join(_toml(x) for x in v) + "]"


def _type(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(dict.fromkeys(_type(a) for a in args if a is not type(None)))
    if origin is Literal:
        return " or ".join(dict.fromkeys(_type(type(a)) for a in args))
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return "table"
    return {bool: "bool", int: "integer", float: "float", str: "string"}.get(annotation, "any")


def _literals(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    return [x for a in typing.get_args(annotation) for x in _literals(a)]


def _allowed(model: type[BaseModel], key: str, f: FieldInfo) -> str:
    if model is LearnConfig and key == "algorithm":  # a str here; each algorithm's Config narrows it
        values: list[Any] = list(algorithms.ALGORITHMS)
    else:
        values = _literals(f.annotation)
    out = [", ".join(f"`{_toml(v)}`" for v in values)] if values else []
    for m in f.metadata:
        out += [f"{sign} {getattr(m, attr)!r}" for attr, sign in _BOUNDS if getattr(m, attr, None) is not None]
        if getattr(m, "pattern", None) is not None:
            out.append(f"matches `{m.pattern}`")
    return "; ".join(out)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _about(t: Table) -> str:
    text = _cell(t.about.removeprefix(f"{t.header}:").strip())
    return text[:1].upper() + text[1:]


def _default(f: FieldInfo) -> str:
    text = _toml(f.default)
    return text if f.default is None or f.default is PydanticUndefined else f"`{_cell(text)}`"


def section(t: Table) -> str:
    """One table's section of the page."""
    lines = [f"## {t.header}", "", _about(t), "", "| key | type | default | allowed | description |",
             "|---|---|---|---|---|"]
    for k in t.keys:
        f = t.model.model_fields[k]
        lines.append(f"| {k} | {_cell(_type(f.annotation))} | {_default(f)} | "
                     f"{_cell(_allowed(t.model, k, f))} | {_cell(f.description or '')} |")
    return "\n".join(lines)


INTRO = f"""# Job keys

Every key a job file (TOML) accepts: its type, its default and its allowed values. A file names
only what it changes; `--set KEY=VALUE` overrides any key on the command line (e.g.
`--set round.train_games=4`). "unset" is a key left out (TOML has no null). Beyond the bounds
below, every integer is at most 2^53 and every float finite (`unstable_dask/config/base.py`), and
the checks that span several keys run when the job loads (`unstable_dask/jobfile.py`).

Generated from the settings classes' docstrings (`unstable_dask/config/`; the `[learn]` keys of
one algorithm: `unstable_dask/learn/algorithms/<name>.py`) by `{COMMAND}`.
A test fails when this page and the code differ: do not edit it by hand."""


def markdown() -> str:
    """The whole page."""
    return "\n\n".join([INTRO, *map(section, tables())]) + "\n"


if __name__ == "__main__":  # rewrites docs/job-keys.md (run from the repository root)
    import argparse
    ap = argparse.ArgumentParser(prog="python -m unstable_dask.jobkeys", description="Write the job-key reference.")
    ap.add_argument("out", nargs="?", type=Path, default=PAGE, help=f"the page to write (default: {PAGE})")
    out = ap.parse_args().out
    out.write_text(markdown(), encoding="utf-8")
    print(f"wrote {out}")
