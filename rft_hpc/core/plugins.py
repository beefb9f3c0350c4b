"""Name -> function lookups that users extend with their own code by import path.

Reward functions, advantage functions and policy losses are all chosen by a name in the
config: a registered name (`"grpo"`), or a user's function given as `"package.module:function"`,
imported when it is first resolved.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from rft_hpc.core.errors import UserError

F = TypeVar("F", bound=Callable[..., Any])


def import_callable(path: str, what: str) -> Callable[..., Any]:
    """The callable named by `path` ("package.module:attribute", dots allowed in attribute).

    Raises `UserError` saying "<what> '<path>' cannot be imported" when the module or the
    attribute is missing or the module fails while it is imported (a syntax error, an
    exception at its top level: the message names it), or that it is not callable.
    """
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise UserError(f"{what} {path!r} is not of the form package.module:function")
    try:
        obj: object = importlib.import_module(module)
    except ImportError as exc:
        raise UserError(f"{what} {path!r} cannot be imported: {exc}") from exc
    except Exception as exc:  # the user's module raised while it was imported
        raise UserError(f"{what} {path!r} cannot be imported: module {module} raised "
                        f"{type(exc).__name__}: {exc}") from exc
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        raise UserError(f"{what} {path!r} cannot be imported: {exc}") from exc
    if not callable(obj):
        raise UserError(f"{what} {path!r} is not callable")
    return obj


def resolve(name: str, registry: Mapping[str, F], what: str) -> F:
    """`registry[name]`, or the user's function when `name` holds a ':' (see `import_callable`).

    An unknown name raises `UserError` listing the registered names.
    """
    if name in registry:
        return registry[name]
    if ":" in name:
        return import_callable(name, what)  # type: ignore[return-value]
    raise UserError(f"unknown {what} {name!r}; registered: {', '.join(sorted(registry))}, "
                    "or give package.module:function")


def register(registry: dict[str, F], name: str) -> Callable[[F], F]:
    """Decorator: store the decorated function in `registry` under `name`."""
    def wrap(fn: F) -> F:
        registry[name] = fn
        return fn
    return wrap
