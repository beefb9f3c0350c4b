"""Pydantic validation errors retold in plain words, at the key path the user wrote.

Pydantic's error locations name union members (`buffer.sampler.priority.reuse_decay`); the
user's file has no `priority` key there. `locate` walks the models alongside the location,
drops those member labels and remembers which model owns the key, so that an unknown key
gets a did-you-mean from the fields it could have been.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache, reduce
from operator import or_
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import ErrorDetails

Key = str | int
"""One step of a key path: a mapping key, or a list index."""

_EXPECTED = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "string": "a string",
    "path": "a path",
    "list": "a list",
    "dict": "a mapping",
    "model": "a mapping",
}
"""What a wrong-type error expected, by the first word of pydantic's error type."""

_BOUNDS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}
"""Pydantic's bound errors: the context entry holding the limit, and its operator."""


@dataclass(frozen=True)
class Target:
    """Where an error location points, in terms of the user's data and of the schema."""

    keys: tuple[Key, ...]
    """Key path in the user's data (union member labels removed)."""

    owner: type[BaseModel] | None
    """The model whose field (or unknown key) the last key is; None for mapping entries."""

    annotation: Any
    """Declared type at the key, with None removed from optional types; None if unknown."""

    discriminator: str | None
    """The discriminator key when the annotation is a discriminated union."""


def dotted(keys: Sequence[Key]) -> str:
    """Render a key path as the user would write it: `buffer.sampler.type`, `a.list[0]`."""
    text = ""
    for key in keys:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else str(key))
    return text


def locate(root: type[BaseModel], loc: Sequence[Key]) -> Target:
    """Follow a pydantic error location through the models under `root`."""
    keys: list[Key] = []
    owner: type[BaseModel] | None = root
    annotation: Any = root
    discriminator: str | None = None
    for step in loc:
        annotation = _without_none(annotation)
        if discriminator is not None:  # this step is the tag that selected a variant
            annotation, discriminator = _variant(annotation, discriminator, step), None
            continue
        if _is_union(annotation):  # pydantic labels the union member it tried
            annotation = None
            continue
        keys.append(step)
        owner = annotation if _is_model(annotation) else None
        annotation, discriminator = _child(annotation, step)
    return Target(tuple(keys), owner, _without_none(annotation), discriminator)


def explain(root: type[BaseModel], error: ErrorDetails) -> tuple[tuple[Key, ...], str]:
    """The key path and a plain-words message for one pydantic error under `root`."""
    target = locate(root, error["loc"])
    kind = error["type"]
    given = error.get("input")
    ctx = error.get("ctx") or {}
    if kind == "extra_forbidden":
        return target.keys, "unknown key" + _key_hint(root, target)
    if kind == "missing":
        return target.keys, "required key is missing"
    if kind in ("union_tag_invalid", "union_tag_not_found") and target.discriminator:
        return _explain_tag(target, given)
    if kind == "literal_error":
        choices = get_args(target.annotation) if get_origin(target.annotation) is Literal else ()
        return target.keys, _expected_choice(choices, given, ctx.get("expected", ""))
    if kind in _BOUNDS:
        name, op = _BOUNDS[kind]
        return target.keys, f"must be {op} {ctx.get(name)}, got {_describe(given)}"
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return target.keys, str(ctx["error"])
    expected = _EXPECTED.get(kind.split("_", 1)[0])
    if expected is not None and (kind.endswith(("_type", "_parsing")) or kind == "int_from_float"):
        return target.keys, f"expected {expected}, got {_describe(given)}"
    return target.keys, f"{error['msg']} (got {_describe(given)})"


def _explain_tag(target: Target, given: Any) -> tuple[tuple[Key, ...], str]:
    disc = target.discriminator
    assert disc is not None
    tags = [tag for member in get_args(target.annotation) for tag in _tags(member, disc)]
    if isinstance(given, dict) and disc in given:
        return (*target.keys, disc), _expected_choice(tags, given[disc], "")
    choices = ", ".join(repr(t) for t in tags)
    return target.keys, f"needs a '{disc}' key, one of {choices}"


def _expected_choice(choices: Sequence[Any], given: Any, fallback: str) -> str:
    listed = ", ".join(repr(c) for c in choices) if choices else fallback
    message = f"expected one of {listed}, got {_describe(given)}"
    if isinstance(given, str):
        message += _did_you_mean(given, [str(c) for c in choices])
    return message


def _key_hint(root: type[BaseModel], target: Target) -> str:
    key = target.keys[-1] if target.keys else ""
    allowed = list(target.owner.model_fields) if target.owner else []
    hint = _did_you_mean(str(key), allowed)
    if hint:
        return hint
    elsewhere = [path for path, name in _all_fields(root) if name == key]
    if elsewhere:
        return _did_you_mean_text(elsewhere)
    return f"; allowed keys: {', '.join(allowed)}" if allowed else ""


def _did_you_mean(word: str, candidates: Sequence[str]) -> str:
    matches = difflib.get_close_matches(word, candidates, n=3, cutoff=0.6)
    return _did_you_mean_text(matches) if matches else ""


def _did_you_mean_text(matches: Sequence[str]) -> str:
    quoted = [f"'{m}'" for m in matches]
    listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return f"; did you mean {listed}?"


def _describe(value: Any) -> str:
    if value is None:
        return "an empty value"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return repr(value)


@cache
def _all_fields(model: type[BaseModel], prefix: str = "") -> tuple[tuple[str, str], ...]:
    """(dotted path, field name) of every field under `model`, union variants included."""
    found: list[tuple[str, str]] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        found.append((path, name))
        for sub in _models_in(field.annotation):
            found.extend(_all_fields(sub, path + "."))
    return tuple(dict.fromkeys(found))


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    if _is_model(annotation):
        yield annotation
    elif _is_union(annotation):
        for member in get_args(annotation):
            yield from _models_in(member)


def _child(annotation: Any, key: Key) -> tuple[Any, str | None]:
    """The declared type of entry `key` of a value declared as `annotation`."""
    if _is_model(annotation):
        field = annotation.model_fields.get(str(key))
        if field is None:
            return None, None
        disc = field.discriminator
        return field.annotation, disc if isinstance(disc, str) else None
    args = get_args(annotation)
    if get_origin(annotation) is dict and len(args) == 2:
        return args[1], None
    if get_origin(annotation) in (list, tuple) and args:
        return args[0], None
    return None, None


def _variant(annotation: Any, discriminator: str, tag: Key) -> Any:
    for member in get_args(annotation):
        if tag in _tags(member, discriminator):
            return member
    return None


def _tags(member: Any, discriminator: str) -> tuple[Any, ...]:
    if not _is_model(member) or discriminator not in member.model_fields:
        return ()
    return get_args(member.model_fields[discriminator].annotation)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def _without_none(annotation: Any) -> Any:
    if not _is_union(annotation):
        return annotation
    rest = [a for a in get_args(annotation) if a is not type(None)]
    return reduce(or_, rest) if rest else None
