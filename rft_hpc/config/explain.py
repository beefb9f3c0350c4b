"""Pydantic validation errors retold in plain words, at the key path the user wrote.

Pydantic's error locations name union members (`buffer.sampler.priority.reuse_decay`); the
user's file has no `priority` key there. `locate` walks the models alongside the location,
drops those member labels and remembers which model owns the key, so that an unknown key
gets a did-you-mean from the fields it could have been.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Literal, get_args, get_origin

from pydantic import BaseModel, Tag
from pydantic_core import ErrorDetails

from rft_hpc.config.annotations import is_model, is_union, models_in, tags, without_none

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

    annotation: object
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
    """Follow a pydantic error location through the models under `root`: the key path as
    the user wrote it (union member labels dropped) and the model and type found there."""
    keys: list[Key] = []
    owner: type[BaseModel] | None = root
    annotation: object = root
    discriminator: str | None = None
    for step in loc:
        if not (is_union(annotation) and _tagged(annotation, step) is not None):
            annotation = without_none(annotation)  # (it would drop the members' tags)
        if discriminator is not None:  # this step is the tag that selected a variant
            annotation, discriminator = _variant(annotation, discriminator, step), None
            continue
        if is_union(annotation):  # pydantic labels the union member it tried
            annotation = _tagged(annotation, step)
            continue
        keys.append(step)
        owner = annotation if is_model(annotation) else None
        annotation, discriminator = _child(annotation, step)
    return Target(tuple(keys), owner, without_none(annotation), discriminator)


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
        return target.keys, f"must be {op} {ctx.get(name)}, got {describe(given)}"
    if kind == "too_short":
        return target.keys, (f"needs at least {ctx.get('min_length')} "
                             f"{'entry' if ctx.get('min_length') == 1 else 'entries'}, "
                             f"got {ctx.get('actual_length')}")
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return target.keys, str(ctx["error"])
    expected = _EXPECTED.get(kind.split("_", 1)[0])
    if expected is not None and (kind.endswith(("_type", "_parsing")) or kind == "int_from_float"):
        quote = expected in ("a string", "a path") and isinstance(given, int | float | bool)
        hint = "; put it in quotes to mean text" if quote else ""
        return target.keys, f"expected {expected}, got {describe(given)}{hint}"
    return target.keys, f"{error['msg']} (got {describe(given)})"


def _explain_tag(target: Target, given: object) -> tuple[tuple[Key, ...], str]:
    disc = target.discriminator
    assert disc is not None
    known = [tag for member in get_args(target.annotation) for tag in tags(member, disc)]
    if isinstance(given, dict) and disc in given:
        return (*target.keys, disc), _expected_choice(known, given[disc], "")
    choices = ", ".join(repr(t) for t in known)
    return target.keys, f"needs a '{disc}' key, one of {choices}"


def _expected_choice(choices: Sequence[object], given: object, fallback: str) -> str:
    listed = ", ".join(repr(c) for c in choices) if choices else fallback
    message = f"expected one of {listed}, got {describe(given)}"
    if isinstance(given, str):
        message += _did_you_mean(given, [str(c) for c in choices])
    return message


def _key_hint(root: type[BaseModel], target: Target) -> str:
    key = target.keys[-1] if target.keys else ""
    allowed = list(target.owner.model_fields) if target.owner else []
    hint = _did_you_mean(str(key), allowed)
    if hint:
        return hint
    here = dotted(target.keys)
    elsewhere = [path for path, name in _all_fields(root) if name == key and path != here]
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


def describe(value: object) -> str:
    """A short phrase for a value the user gave: `'abc'`, `3`, `true`, `a mapping`."""
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
        for sub in models_in(field.annotation):
            found.extend(_all_fields(sub, path + "."))
    return tuple(dict.fromkeys(found))


def _child(annotation: object, key: Key) -> tuple[object, str | None]:
    """The declared type of entry `key` of a value declared as `annotation`."""
    if is_model(annotation):
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


def _tagged(annotation: object, label: Key) -> object:
    """The member of union `annotation` that pydantic's location step `label` names: the one
    annotated with `Tag(label)` (a union told apart by a callable discriminator), else None."""
    for member in get_args(annotation):
        if get_origin(member) is Annotated and any(
                isinstance(m, Tag) and m.tag == label for m in member.__metadata__):
            return member
    return None


def _variant(annotation: object, discriminator: str, tag: Key) -> object:
    for member in get_args(annotation):
        if tag in tags(member, discriminator):
            return member
    return None
