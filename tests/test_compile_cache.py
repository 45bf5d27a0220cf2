"""kinetic/compile_cache.py: executables kept on disk, loaded on a later start with the same
bits, never reused where anything that makes them differs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from kinetic import compile_cache
from kinetic.engine.engine_config import EngineConfig
from kinetic.llm import open_model
from tests.tiny_models import write_tiny_model


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The cache on, in a directory of this test's own."""
    path = tmp_path / "compiled"
    monkeypatch.setenv("KINETIC_COMPILE_CACHE_DIR", str(path))
    monkeypatch.setitem(compile_cache._state, "enabled", True)
    return path


def entries(path) -> list[str]:
    return sorted(p.name for p in path.rglob("*.exe"))


def _double(x, n):   # a test's function: persist=True vouches for it
    return x * n


def test_a_call_is_compiled_once_then_loaded_from_disk(cache_dir):
    f = compile_cache.jit(_double, name="double", static_argnums=(1,), persist=True)
    x = jnp.arange(4, dtype=jnp.float32)
    before = compile_cache.counts()
    assert np.asarray(f(x, 3)).tolist() == [0, 3, 6, 9]
    assert len(entries(cache_dir)) == 1
    compile_cache.clear()   # as a new process: nothing in memory
    assert np.asarray(f(x + 1, 3)).tolist() == [3, 6, 9, 12]
    after = compile_cache.counts()
    assert (after["compiled"] - before["compiled"], after["loaded"] - before["loaded"]) == (1, 1)
    # a static argument, a shape or a dtype of its own is another executable
    f(x, 4)
    f(jnp.arange(5, dtype=jnp.float32), 3)
    f(jnp.arange(4, dtype=jnp.int32), 3)
    assert len(entries(cache_dir)) == 4
    # the same function under another name or context, or with compiler options, too
    compile_cache.jit(_double, name="double", context=("other",), static_argnums=(1,),
                      persist=True)(x, 3)
    compile_cache.jit(_double, name="double2", static_argnums=(1,), persist=True)(x, 3)
    assert len(entries(cache_dir)) == 6


def test_a_static_argument_given_by_name_or_position_is_the_same_call(cache_dir):
    f = compile_cache.jit(_double, name="double", static_argnames=("n",), persist=True)
    x = jnp.ones(3)
    assert np.asarray(f(x, 2)).tolist() == np.asarray(f(x, n=2)).tolist() == [2, 2, 2]
    assert np.asarray(f(x, n=5)).tolist() == [5, 5, 5]


def test_a_function_kinetic_does_not_name_stays_in_memory(cache_dir):
    """A closure or a test's function is keyed by name alone, which does not say what it
    computes: its executables are never written, unless the caller vouches (persist)."""
    for k in (2.0, 3.0):
        f = compile_cache.jit(lambda x: x * k, name="scale")
        assert float(f(jnp.ones(()))) == k
    compile_cache.jit(_double, name="double", static_argnums=(1,))(jnp.ones(2), 2)
    assert entries(cache_dir) == []
    from kinetic.engine import sampler   # kinetic's own module-level functions are written
    sampler.pick_rows(jnp.zeros((3, 7)), jnp.zeros(2, jnp.int32))
    assert [n.split("-")[0] for n in entries(cache_dir)] == ["pick_rows"]


def test_prepare_has_the_executable_ready_without_running_it(cache_dir, monkeypatch):
    """Runner.compile's warm-up: prepare loads or compiles, and the call after finds it; with
    the cache off calls go through jax.jit, which compiles only on a call: False then."""
    f = compile_cache.jit(_double, name="double", static_argnums=(1,), persist=True)
    x = jnp.arange(3, dtype=jnp.float32)
    compiled = compile_cache.counts()["compiled"]
    assert f.prepare(x, 7) is True
    assert compile_cache.counts()["compiled"] == compiled + 1 and len(entries(cache_dir)) == 1
    assert np.asarray(f(x, 7)).tolist() == [0, 7, 14]
    assert compile_cache.counts()["compiled"] == compiled + 1
    monkeypatch.setitem(compile_cache._state, "enabled", False)
    assert f.prepare(x, 8) is False


def test_preloading_loads_last_times_set_ahead(cache_dir):
    """Under one key, the executables the last run used are loaded in threads before they
    are asked for, and give the same answers; one no longer on disk is compiled again;
    another key has no list."""
    f = compile_cache.jit(_double, name="double", static_argnums=(1,), persist=True)
    x = jnp.arange(3, dtype=jnp.float32)
    with compile_cache.preloading("model A"):
        assert not compile_cache.loading_ahead()   # nothing listed yet: a cold start
        cold = [np.asarray(f(x, n)).tolist() for n in (2, 3)]
    assert len(list((cache_dir).rglob("preload/*"))) == 1
    compile_cache.clear()
    ahead = compile_cache.loaded_ahead()
    with compile_cache.preloading("model A"):
        assert compile_cache.loading_ahead()
        assert [np.asarray(f(x, n)).tolist() for n in (2, 3)] == cold == [[0, 2, 4], [0, 3, 6]]
    assert compile_cache.loaded_ahead() == ahead + 2
    compile_cache.clear()
    for path in cache_dir.rglob("*.exe"):
        path.unlink()
    compiled = compile_cache.counts()["compiled"]
    with compile_cache.preloading("model A"):
        assert np.asarray(f(x, 2)).tolist() == [0, 2, 4]
    assert compile_cache.counts()["compiled"] == compiled + 1
    with compile_cache.preloading("model B"):
        assert not compile_cache.loading_ahead()


def test_a_torn_entry_is_compiled_again(cache_dir):
    f = compile_cache.jit(_double, name="double", static_argnums=(1,), persist=True)
    x = jnp.arange(3, dtype=jnp.float32)
    f(x, 2)
    [path] = list(cache_dir.rglob("*.exe"))
    path.write_bytes(path.read_bytes()[:100])
    compile_cache.clear()
    compiled = compile_cache.counts()["compiled"]
    assert np.asarray(f(x, 2)).tolist() == [0, 2, 4]
    assert compile_cache.counts()["compiled"] == compiled + 1
    assert path.stat().st_size > 100   # written whole again


def test_trim_removes_the_least_recently_used(cache_dir):
    build = cache_dir / "old-build"
    build.mkdir(parents=True)
    for i, name in enumerate(("a", "b", "c")):
        (build / name).write_bytes(b"x" * 1000)
        os.utime(build / name, (1000 + i, 1000 + i))
    assert compile_cache.trim(limit=2500) == 1000
    assert sorted(p.name for p in build.iterdir()) == ["b", "c"]
    compile_cache.trim(limit=0)
    assert not build.exists()   # an emptied build directory goes too


def test_the_build_key_follows_the_environment(monkeypatch):
    """Another XLA flag or kinetic setting is another build; where the cache lives is not."""
    base = compile_cache._build_hash()
    monkeypatch.setenv("KINETIC_COMPILE_CACHE_DIR", "/elsewhere")
    assert compile_cache._build_hash() == base
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    flagged = compile_cache._build_hash()
    monkeypatch.setenv("KINETIC_KERNEL_ISA", "scalar")
    assert len({base, flagged, compile_cache._build_hash()}) == 3


def test_enabled_follows_the_environment(monkeypatch):
    for value, on in (("0", False), ("off", False), ("1", True), ("", True)):
        monkeypatch.setenv("KINETIC_COMPILE_CACHE", value)
        monkeypatch.setitem(compile_cache._state, "enabled", None)
        assert compile_cache.enabled() is on


def test_the_flag_turns_it_off(monkeypatch):
    from kinetic.cli import build_parser
    from kinetic.serve_cli import apply_compile_cache_flag
    monkeypatch.setitem(compile_cache._state, "enabled", True)
    monkeypatch.delenv("KINETIC_COMPILE_CACHE", raising=False)
    args = build_parser().parse_args(["serve", "m.gguf", "--no-compile-cache"])
    apply_compile_cache_flag(args)
    assert not compile_cache.enabled() and os.environ["KINETIC_COMPILE_CACHE"] == "0"


def run_engine(path, **config):
    # a context no other test uses: JAX's own persistent cache (the session's) has none of
    # these shapes, so the cold run compiles (and writes) every one
    model = open_model(path, EngineConfig(parallel=2, n_ctx=136, **config), kernel="ffi",
                       compile=True)
    try:
        out = [(d.token_ids, d.logprobs) for d in model.stream([1, 5, 9, 30, 2], max_tokens=6,
                                                             temperature=0.9, seed=7,
                                                             logprobs=2)]
        return out, np.asarray(model.logits([3, 4, 5]))
    finally:
        model.close()


def test_a_warm_engine_loads_every_shape_and_gives_the_same_bits(cache_dir, tmp_path):
    """An engine started again (nothing in memory) loads all its step, decode-loop and
    sampler executables and answers with the same tokens, log-probabilities and logits;
    another cache type is another program, compiled anew."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama", qtype="Q4_0", d_model=96, d_ffn=160)
    start = compile_cache.counts()
    cold = run_engine(path)
    mid = compile_cache.counts()
    compile_cache.clear()
    warm = run_engine(path)
    end = compile_cache.counts()
    assert mid["compiled"] > start["compiled"]
    assert end["compiled"] == mid["compiled"], "a warm start compiled"
    assert end["loaded"] - mid["loaded"] >= mid["compiled"] - start["compiled"]
    assert warm[0] == cold[0] and warm[1].tobytes() == cold[1].tobytes()
    names = {n.split("-")[0] for n in entries(cache_dir)}
    assert {"step", "decode", "sample_rows", "logprobs"} <= names
    compile_cache.clear()
    run_engine(path, kv_dtype="float32")
    assert compile_cache.counts()["compiled"] > end["compiled"]


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    """Across processes, as a second `kinetic serve` runs: the same answer, nothing compiled
    by kinetic's cache in the second."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama", qtype="Q4_0", d_model=64, d_ffn=128)
    script = textwrap.dedent(f"""
        from kinetic import compile_cache
        from kinetic.engine.engine_config import EngineConfig
        from kinetic.llm import open_model
        model = open_model({str(path)!r}, EngineConfig(parallel=1, n_ctx=64), kernel="ffi",
                           compile=True)
        print([d.token_ids for d in model.stream([1, 2, 3], max_tokens=5)])
        print({{**compile_cache.counts(), "ahead": compile_cache.loaded_ahead()}})
        model.close()
    """)
    env = {**os.environ, "KINETIC_COMPILE_CACHE_DIR": str(tmp_path / "compiled"),
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla")}
    env.pop("KINETIC_COMPILE_CACHE", None)
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, timeout=600) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    (tokens1, counts1), (tokens2, counts2) = [r.stdout.strip().splitlines()[-2:] for r in runs]
    assert tokens1 == tokens2
    first, second = eval(counts1), eval(counts2)   # noqa: S307 - our own dict's repr
    assert first["compiled"] > 0 and first["loaded"] == 0
    # every one loaded, and ahead (compile_cache.preloading: what the first start used)
    assert second == {"loaded": first["compiled"], "compiled": 0, "ahead": first["compiled"]}


def test_jaxs_own_cache_never_answers_for_these_functions(tmp_path):
    """JAX's persistent cache (JAX_COMPILATION_CACHE_DIR, which the tests and `configure`
    set) could answer our compile with an executable it loaded, which serializes without all
    its functions (a later load failed: "Function broadcast_select_fusion not found"). It
    writes nothing while these functions compile, so with a fresh cache of ours a second
    process compiles them anew and writes them whole, and a third loads them and runs."""
    script = textwrap.dedent("""
        import jax.numpy as jnp
        from kinetic import compile_cache
        from kinetic.engine import sampler
        for B in (1, 4):
            sampler.logprobs(jnp.zeros((B, 5000)), jnp.zeros(B, jnp.int32), 20)[0] \\
                .block_until_ready()
        print(compile_cache.counts())
    """)

    def run(ours: str) -> dict:
        env = {**os.environ, "KINETIC_COMPILE_CACHE_DIR": str(tmp_path / ours),
               "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
        env.pop("KINETIC_COMPILE_CACHE", None)
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        return eval(r.stdout.strip().splitlines()[-1])   # noqa: S307 - our own dict's repr
    assert run("first") == {"loaded": 0, "compiled": 2}
    assert run("second") == {"loaded": 0, "compiled": 2}   # not JAX's: compiled anew
    assert len(entries(tmp_path / "second")) == 2
    assert run("second") == {"loaded": 2, "compiled": 0}   # and what was written runs
