"""`python -m frontier.config_reference > docs/reference.md`: every config key, from the typed schemas.

Each key's type and default come from its dataclass field in frontier/config.py, what it does from
the comment beside (or just above) the field, and its allowed range from the `_require`, `_choice`
and `_fraction` checks that name it. tests/test_docs.py fails when docs/reference.md is not this
module's output, so a schema change and its reference are committed together.
"""
from __future__ import annotations

import ast
import inspect
import io
import re
import sys
import tokenize
import typing
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from frontier import budget_keys, config, paths

KERNEL_OP_NOTE = "this op's backend: reference | triton | nki, or null for the preset's choice"

CHECKS = {"_require": 1, "_choice": 0, "_fraction": 0}  # check -> which argument names the key


def type_name(annotation: Any) -> str:
    """A field's annotation in words: `Optional[int]` is `int or null`, `list[float]` `list of float`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return " or ".join(type_name(a) for a in rest) + " or null"
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}"
    return getattr(annotation, "__name__", str(annotation))


def default_text(f) -> str:
    if f.default is not MISSING:
        value = f.default
    elif f.default_factory is not MISSING:
        value = f.default_factory()
    else:
        return ""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{value}`"


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment: the one at the end of its line, else the comment lines just above it."""
    source = inspect.getsource(cls)
    lines = source.splitlines()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    found = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        line = node.lineno
        if line in comments and lines[line - 1].lstrip()[:1] != "#":
            found[node.target.id] = comments[line]
            continue
        above, at = [], line - 1
        while at in comments and lines[at - 1].lstrip().startswith("#"):
            above.insert(0, comments[at])
            at -= 1
        if above and not (len(above) == 1 and len(above[0].split()) <= 2):  # a one- or two-word section label
            found[node.target.id] = " ".join(above)
    return found


class _Words(ast.NodeTransformer):
    """An f-string message as it reads for any value: `model.n_head={self.n_head}` is `model.n_head`,
    `{self.depth - 1}` is `depth - 1`, a value of the check's own (`{total:g}`) is left out, and the
    loop variable (`f"model.{key}"`) stays for `text` to fill in."""

    def __init__(self, loop_var: str):
        self.loop_var = loop_var

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.AST:
        text = ""
        for part in node.values:
            if isinstance(part, ast.Constant):
                text += str(part.value)
            elif isinstance(part.value, ast.Name) and part.value.id == self.loop_var:
                text += "{}"
            elif text.endswith("="):
                text = text[:-1]
            elif "self" in ast.unparse(part.value):
                text += ast.unparse(part.value).replace("self.", "")
        return ast.Constant(" ".join(re.sub(r"\s*\(is\s*\)|\s*\(\)", "", text).split()))


def checks(tree: ast.AST) -> dict[str, list[str]]:
    """Allowed ranges by full key, from every `_require` / `_choice` / `_fraction` call in the module,
    a call inside `for key in ("depth", ...)` (or over a module constant) once per key."""
    found: dict[str, list[str]] = {}

    def visit(node: ast.AST, loop: tuple[str, tuple]) -> None:
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            try:
                values = eval(compile(ast.Expression(node.iter), "<check>", "eval"), vars(config))  # noqa: S307
            except Exception:
                values = ()
            for child in node.body:
                visit(child, (node.target.id, tuple(v for v in values if isinstance(v, str))))
            return
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CHECKS:
            record(node, loop)
        for child in ast.iter_child_nodes(node):
            visit(child, loop)

    def text(node: ast.AST, loop_var: str, key: str) -> str | None:
        try:
            words = ast.fix_missing_locations(ast.Expression(_Words(loop_var).visit(node)))
            value = eval(compile(words, "<check>", "eval"), {}, {loop_var: key})  # noqa: S307
        except Exception:
            return None
        return value.replace("{}", key) if isinstance(value, str) else None

    def record(call: ast.Call, loop: tuple[str, tuple]) -> None:
        name_arg = call.args[CHECKS[call.func.id]]
        loop_var, keys = loop
        for key in keys or ("",):
            name = text(name_arg, loop_var, key)
            if not name:
                continue
            if call.func.id == "_fraction":  # the helpers' own messages
                allowed = "must be between 0 and 1"
            elif call.func.id == "_choice":
                # a tuple, or a module constant such as SAMPLERS
                values = eval(compile(ast.Expression(call.args[2]), "<check>", "eval"), vars(config))  # noqa: S307
                allowed = "choose one of " + ", ".join(values)
            else:
                allowed = text(call.args[3], loop_var, key)
            if allowed and allowed not in found.setdefault(name, []):
                found[name].append(allowed)

    visit(tree, ("", ()))
    return found


def group_defaults() -> dict[str, str]:
    """Which preset each group takes by default, from conf/config.yaml's defaults list."""
    chosen = {}
    for entry in OmegaConf.to_container(OmegaConf.load(paths.conf_dir() / "config.yaml"))["defaults"]:
        if not isinstance(entry, dict):
            continue
        (group, value), = entry.items()
        sized = re.fullmatch(r"\$\{frontier\.sized:\w+,(\w+),(\w+)\}", str(value))
        if sized:
            chosen[group] = f"`{sized[1]}` on an accelerator, `{sized[2]}` on a CPU-only machine"
        elif value is not None and "/" not in group:
            chosen[group] = f"`{value}`"
    return chosen


def options(group: str) -> list[str]:
    folder = (paths.conf_dir() if group != "sweep" else paths.sweeps_dir().parent / "sweeps")
    folder = folder / group if group != "sweep" else folder
    return sorted(p.stem for p in folder.glob("*.yaml"))


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    hints = typing.get_type_hints(config.Config)
    ranges = checks(ast.parse(inspect.getsource(config)))
    for key, allowed in checks(ast.parse(inspect.getsource(budget_keys))).items():  # the sweep's budget keys' checks
        ranges.setdefault(key, []).extend(allowed)
    chosen = group_defaults()
    root_comments = field_comments(config.Config)
    out = [
        "# Config reference",
        "",
        "<!-- Generated by `python -m frontier.config_reference > docs/reference.md` from the schemas in",
        "frontier/config.py; tests/test_docs.py fails when it is out of date. Edit the schemas, not this file. -->",
        "",
        "Every key of `python -m frontier.train`, by group. A key is set on the command line as",
        "`GROUP.KEY=VALUE` (`model.depth=6`), a group's preset with `GROUP=NAME` (`model=tiny`). The",
        "defaults below are the schema's; a preset sets its own values for the keys it names, and",
        "`python -m frontier.train --cfg job` prints the composed configuration. A value outside its",
        "allowed range is refused before anything runs: one sentence naming the key, exit code 2.",
        "",
    ]
    root = []
    for f in fields(config.Config):
        annotation = hints[f.name]
        schema = next((a for a in (annotation, *typing.get_args(annotation)) if is_dataclass(a)), None)
        if schema is None:
            root.append((f.name, f, annotation, root_comments.get(f.name, "")))
            continue
        out += [f"## `{f.name}`", ""]
        doc = ast.get_docstring(ast.parse(inspect.getsource(schema)).body[0])  # its own, not dataclass's
        if doc:
            out += [" ".join(doc.split()), ""]
        if (paths.conf_dir() / f.name).is_dir() or f.name == "sweep":
            presets = ", ".join(f"`{name}`" for name in options(f.name))
            default = chosen.get(f.name, "none")
            out += [f"Presets (`{f.name}=NAME`): {presets}. Default: {default}.", ""]
        out += table(f.name, schema, ranges)
    out += ["## Root keys", "", "| key | type | default | allowed | what it does |", "|---|---|---|---|---|"]
    for name, f, annotation, comment in root:
        out.append(row(name, f, annotation, ranges.get(name, []), comment))
    return "\n".join(out) + "\n"


def table(group: str, schema: type, ranges: dict[str, list[str]]) -> list[str]:
    return ["| key | type | default | allowed | what it does |", "|---|---|---|---|---|",
            *rows(group, schema, ranges), ""]


def rows(prefix: str, schema: type, ranges: dict[str, list[str]]) -> list[str]:
    """One row per key, and the keys of a nested schema (sweep.frontier.depths) after their parent's."""
    hints = typing.get_type_hints(schema)
    comments = field_comments(schema)
    lines = []
    for f in fields(schema):
        key = f"{prefix}.{f.name}"
        note = comments.get(f.name) or (KERNEL_OP_NOTE if f.name in config.KERNEL_OPS else "")
        lines.append(row(key, f, hints[f.name], ranges.get(key, []), note))
        nested = next((a for a in (hints[f.name], *typing.get_args(hints[f.name])) if is_dataclass(a)), None)
        if nested is not None:
            lines += rows(key, nested, ranges)
    return lines


def row(key: str, f, annotation: Any, allowed: list[str], note: str) -> str:
    return (f"| `{key}` | {cell(type_name(annotation))} | {cell(default_text(f))} | "
            f"{cell('; '.join(allowed))} | {cell(note)} |")


def main(argv: list[str]) -> None:
    text = render()
    if argv:
        Path(argv[0]).write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
