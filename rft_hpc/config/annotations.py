"""Small helpers to read the type annotations of the config models.

An annotation is any object (a class, a union, `Annotated[...]`, `Literal[...]`): the helpers
take `object` and look at it with `get_origin`, `get_args` and `isinstance`.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from functools import reduce
from operator import or_
from typing import Annotated, TypeGuard, Union, get_args, get_origin

from pydantic import BaseModel


def is_model(annotation: object) -> TypeGuard[type[BaseModel]]:
    """Whether `annotation` is a pydantic model class (a section of settings)."""
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def is_union(annotation: object) -> bool:
    """Whether `annotation` is a union (`A | B` or `typing.Union`)."""
    return get_origin(annotation) in (Union, types.UnionType)


def unannotated(annotation: object) -> object:
    """The type inside `Annotated[type, ...]` (a validated type such as a config path or a
    reward), else `annotation` itself."""
    return get_args(annotation)[0] if get_origin(annotation) is Annotated else annotation


def without_none(annotation: object) -> object:
    """`annotation` with `None` taken out of a union (`int | None` -> `int`), and out of
    `Annotated` (`Annotated[Path, ...] | None` -> `Path`)."""
    if not is_union(annotation):
        return unannotated(annotation)
    rest = [unannotated(a) for a in get_args(annotation) if a is not type(None)]
    return reduce(or_, rest) if rest else None


def tags(member: object, discriminator: str) -> tuple[object, ...]:
    """The discriminator values that select `member` of a discriminated union (or none)."""
    if not is_model(member) or discriminator not in member.model_fields:
        return ()
    return get_args(member.model_fields[discriminator].annotation)


def models_in(annotation: object) -> Iterator[type[BaseModel]]:
    """The model classes `annotation` allows: itself, or the models among a union's members."""
    annotation = unannotated(annotation)
    if is_model(annotation):
        yield annotation
    elif is_union(annotation):
        for member in get_args(annotation):
            yield from models_in(member)
