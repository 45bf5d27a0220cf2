"""Probe values: strings, dicts and lists that remember whether a template used them.

llama.cpp learns what a chat template can do by rendering small conversations whose values
record each access (its value stats); `template_caps` renders its probes over these. A value
is `used` once the template reads it, and `ops` names how (array_access, object_access, a
filter or test it went through).
"""

from __future__ import annotations

from typing import Any


class ProbeStr(str):
    """A probe string. Iterating it fails, as a for loop over a string does in llama.cpp."""

    def __new__(cls, value: str) -> "ProbeStr":
        obj = super().__new__(cls, value)
        obj.used, obj.ops = False, set()
        return obj

    def _use(self, op: str | None = None) -> None:
        self.used = True
        if op:
            self.ops.add(op)

    def __str__(self) -> str:
        self._use()
        return str.__str__(self)

    def __len__(self) -> int:
        self._use()
        return str.__len__(self)

    def __eq__(self, other: object) -> bool:
        self._use()
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        self._use()
        return str.__ne__(self, other)

    __hash__ = str.__hash__

    def __add__(self, other: str) -> str:
        self._use()
        return str.__add__(self, other)

    def __radd__(self, other: str) -> str:
        self._use()
        return other + str.__str__(self)

    def __contains__(self, item: object) -> bool:
        self._use()
        return str.__contains__(self, item)

    def __getitem__(self, key: Any) -> str:
        self._use("array_access" if isinstance(key, int) else "object_access")
        return str.__getitem__(self, key)

    def __iter__(self):
        self._use("array_access")
        raise TypeError("Expected iterable or object type in for loop: got String")


class ProbeDict(dict):
    """A probe dict: reading a key marks the dict and the value."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.used, self.ops = False, set()

    def __getitem__(self, key: Any) -> Any:
        value = dict.__getitem__(self, key)
        self.used = True
        self.ops.add("object_access")
        mark(value)
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        self.used = True
        return self[key] if key in self else default

    def items(self):  # type: ignore[override]
        self.used = True
        return dict.items(self)


class ProbeList(list):
    """A probe list: indexing or iterating it marks it."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.used, self.ops = False, set()

    def __getitem__(self, key: Any) -> Any:
        self.used = True
        self.ops.add("array_access")
        value = list.__getitem__(self, key)
        mark(value)
        return value

    def __iter__(self):
        self.used = True
        self.ops.add("array_access")
        return list.__iter__(self)


def track(value: Any) -> Any:
    """A probe copy of JSON-like data."""
    if isinstance(value, dict):
        return ProbeDict({k: track(v) for k, v in value.items()})
    if isinstance(value, list):
        return ProbeList(track(v) for v in value)
    return ProbeStr(value) if isinstance(value, str) else value


def mark(value: Any, deep: bool = False) -> None:
    """Record a probe value (and with `deep`, everything inside it) as used; other values pass."""
    if isinstance(value, (ProbeStr, ProbeDict, ProbeList)):
        value.used = True
        if deep and isinstance(value, ProbeDict):
            for v in dict.values(value):
                mark(v, True)
        elif deep and isinstance(value, ProbeList):
            for v in list.__iter__(value):
                mark(v, True)


def peek(value: Any, *path: Any) -> Any:
    """Walk probe data without marking it."""
    for key in path:
        value = (dict if isinstance(value, dict) else list).__getitem__(value, key)
    return value
