"""The types of JSON values: what `json.dumps` writes and `json.loads` gives back.

Heartbeats, metrics rows, ledger events and the run directory's records are JSON on disk;
these aliases name such values in signatures instead of `Any`.
"""

from __future__ import annotations

from typing import TypeAlias

JSONScalar: TypeAlias = str | int | float | bool | None
"""A JSON leaf: a string, a number, true/false or null."""

JSONValue: TypeAlias = JSONScalar | list["JSONValue"] | dict[str, "JSONValue"]
"""Any JSON value: a leaf, an array of values or an object of values by key."""

JSONObject: TypeAlias = dict[str, JSONValue]
"""A JSON object (a heartbeat, a metrics row, a ledger event)."""
