"""kinetic/memory.py: while Engine.compile runs, glibc's mmap threshold is held low, so that the
big blocks freed then go back to the system; after, the heap serves blocks up to 32 MB, so
that a step's buffers are reused warm instead of mapped anew on every call. jaxlib's clean
code pages are unmapped and fault back in where they run (drop_code_pages)."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc",
    reason="mallopt's threshold is glibc's (elsewhere kinetic.memory does nothing)")

# Frees one 16 MB block (glibc, left alone, then raises its threshold to 16 MB), then holds 64
# blocks of 1 MB and frees all but the last: prints how much anonymous memory grew, in MB,
# inside memory.compiling() and after it (argv[1] "compiling" / "after"), or with kinetic
# untouched ("plain").
_PROGRAM = """
import sys
import numpy as np
from kinetic import memory

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) // 1024

def growth():
    before = anon()
    big = np.ones(16 << 18, np.float32)
    del big
    blocks = [np.ones(1 << 18, np.float32) for _ in range(64)]
    del blocks[:-1]
    out = anon() - before
    del blocks
    memory.release_memory()
    return out

def top_growth():
    # 32 blocks of 1 MB freed in the order they were taken: they end at the top of the heap
    before = anon()
    blocks = [np.ones(1 << 18, np.float32) for _ in range(32)]
    while blocks:
        blocks.pop()
    return anon() - before

if sys.argv[1] == "top":
    with memory.compiling():
        inside = top_growth()
    print(inside, top_growth())
elif sys.argv[1] == "plain":
    print(growth())
elif sys.argv[1] == "compiling":
    with memory.compiling():
        print(growth())
else:
    with memory.compiling():
        pass
    print(growth())
"""


def _run(mode: str, **env: str) -> list[int]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _PROGRAM, mode], env={**base, **env},
                         check=True, capture_output=True, text=True).stdout
    return [int(v) for v in out.split()]


def _growth(mode: str, **env: str) -> int:
    return _run(mode, **env)[-1]


def test_the_top_of_the_heap_is_handed_back_while_compiling_and_kept_after():
    # 32 MB freed at the top of the heap: handed back inside compiling() (glibc's 128 KB trim
    # threshold), kept after it (64 MB), for the next step to reuse without faulting it in
    inside, after = _run("top")
    assert inside <= 4
    assert after >= 24
    # a trim threshold the user set in the environment is left as set
    assert _run("top", MALLOC_TRIM_THRESHOLD_="131072")[1] <= 4


def test_blocks_freed_while_compiling_go_back_to_the_system():
    # left alone, glibc keeps the 63 freed 1 MB blocks in the heap
    assert _growth("plain") >= 48
    assert _growth("compiling") <= 8


def test_after_compiling_the_heap_serves_blocks_up_to_32_mb():
    # a decode step's freed buffers stay for the next step, as glibc's raised threshold has it
    assert _growth("after") >= 48


def test_a_threshold_set_in_the_environment_is_left_as_set(monkeypatch):
    from kinetic import memory
    # the user's 32 MB threshold keeps the 1 MB blocks in the heap, even while compiling
    assert _growth("compiling", MALLOC_MMAP_THRESHOLD_="33554432") >= 48
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "33554432")
    assert memory.set_mmap_threshold(memory.COMPILE_THRESHOLD) is False


def _mapping_of(addr: int) -> str:
    """The /proc/self/maps line of the mapping that holds addr."""
    for line in open("/proc/self/maps"):
        lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
        if lo <= addr < hi:
            return line
    raise AssertionError(f"{addr:#x} is not mapped")


def _thp_off() -> bool:
    try:
        return "[never]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return True


@pytest.mark.skipif(_thp_off(), reason="this system has no transparent huge pages to ask for")
def test_huge_pages_move_whole_pieces_of_a_private_map_and_keep_every_byte(tmp_path):
    import mmap

    import numpy as np

    from kinetic import memory
    H = memory.HUGE_PAGE
    data = np.random.default_rng(0).integers(0, 256, 5 * H + 12345, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), data.nbytes, access=mmap.ACCESS_COPY)
    buf = np.frombuffer(m, dtype=np.uint8)
    base = buf.ctypes.data
    inside = [p for p in range(-(-base // H), (base + buf.nbytes) // H)]   # whole pieces
    done: set[int] = set()
    # a range over the second whole piece and into the third: both move, nothing else
    start = inside[1] * H - base + 100
    assert memory.huge_pages(buf, start, H, done) == 2 * H
    assert done == {inside[1], inside[2]}
    assert " 00:00 0 " in _mapping_of(inside[1] * H)           # now anonymous memory
    assert "weights.bin" in _mapping_of(inside[0] * H)           # its neighbour is not
    # pieces already moved are skipped; a range over the whole map moves only the pieces
    # that lie inside it (never memory beyond either end)
    assert memory.huge_pages(buf, start, 10, done) == 0
    moved = memory.huge_pages(buf, 0, buf.nbytes, done)
    assert moved == (len(inside) - 2) * H and done == set(inside)
    ends = [a for a in (base, base + buf.nbytes - 1) if a // H not in done]
    assert ends and all("weights.bin" in _mapping_of(a) for a in ends)   # partial pieces
    assert np.array_equal(buf, data)                             # every byte as it was
    buf[start] ^= 0xFF                                           # still writable, privately
    assert path.read_bytes()[start] == data[start]
    del buf
    m.close()


def test_huge_pages_off_moves_nothing(monkeypatch, tmp_path):
    import numpy as np

    from kinetic import memory
    monkeypatch.setenv("KINETIC_HUGE_PAGES", "0")
    memory._huge_pages_on.cache_clear()
    try:
        buf = np.zeros(3 * memory.HUGE_PAGE, np.uint8)
        assert memory.huge_pages(buf, 0, buf.nbytes, set()) == 0
    finally:
        monkeypatch.undo()
        memory._huge_pages_on.cache_clear()


def test_code_pages_of_jaxlib_are_dropped_and_fault_back_in_where_they_run():
    """drop_code_pages unmaps jaxlib's clean code and read-only pages (the file-backed part of
    the resident set falls), and JAX computes as before afterwards, compiles included."""
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kinetic import memory
    if sys.platform != "linux" or not os.path.exists("/proc/self/smaps"):
        pytest.skip("drop_code_pages reads /proc/self/smaps (Linux)")

    def rss_file() -> int:
        with open("/proc/self/status") as f:
            return int(re.search(r"RssFile:\s+(\d+) kB", f.read()).group(1))

    def f(x):
        return jnp.tanh(x) @ x.T + jnp.float32(3)
    x = jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8) / 64
    want = np.asarray(jax.jit(f)(x))
    before = rss_file()
    assert memory.drop_code_pages() > 0
    assert rss_file() < before
    assert np.array_equal(np.asarray(jax.jit(f)(x)), want)
    g = jax.jit(lambda y: jnp.sort(y * 2.5, axis=-1))   # a new compile after the drop
    assert np.array_equal(np.asarray(g(x)), np.sort(np.asarray(x) * 2.5, axis=-1))


def test_drop_code_pages_can_be_turned_off(monkeypatch):
    from kinetic import memory
    monkeypatch.setenv("KINETIC_DROP_CODE", "0")
    assert memory.drop_code_pages() == 0


def test_the_token_embeddings_file_pages_are_dropped_and_read_back_the_same(tmp_path,
                                                                             monkeypatch):
    """Runner.drop_embedding_pages: an embedding that stays in the file's blocks (not tied to
    the output) has its pages unmapped (the file's resident pages fall) and the rows read
    after it are the file's: the same answer as before the drop, and as an engine that never
    drops. A tied embedding (rearranged for the output projection) has none to drop."""
    import re

    from kinetic.engine import runner as runner_module
    from kinetic.engine.engine import Engine
    from kinetic.engine.engine_config import EngineConfig
    from kinetic.engine.request import GenerationRequest
    from kinetic.engine.sampling_params import SamplingParams
    from kinetic.model.loader import load_model
    from kinetic.text.tokenizer import Tokenizer
    from tests.tiny_models import write_tiny_model
    if sys.platform != "linux" or not os.path.exists("/proc/self/maps"):
        pytest.skip("file_pages reads /proc/self/maps (Linux)")
    monkeypatch.setattr(runner_module, "EMBEDDING_DROP_STEPS", 10 ** 9)   # only when called

    def file_rss(path: str) -> int:
        total, cur = 0, None
        with open("/proc/self/smaps") as f:
            for line in f:
                if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                    cur = line.split(maxsplit=5)[-1].strip()
                elif line.startswith("Rss:") and cur == path:
                    total += int(line.split()[1])
        return total

    def answer(engine, ids):
        out = []
        for d in engine.generate(GenerationRequest(ids, SamplingParams(temperature=0.0),
                                                   max_tokens=12, logprobs=2)):
            out += [(lp.token, lp.logprob) for lp in d.logprobs]
        return out

    path = os.path.realpath(write_tiny_model(tmp_path / "untied.gguf", "llama", tied=False,
                                             qtype="Q8_0", d_model=256, output_scale=2.0))
    model = load_model(path)
    if model.config.kernel != "ffi":
        pytest.skip("the embedding is in the file's blocks with the C++ kernel only")
    tok = Tokenizer.from_metadata(model.file.metadata)
    engine = Engine(model, tok, EngineConfig(n_ctx=256, parallel=1, speculative=False))
    try:
        ids = tok.encode(" ".join(f"word{i}" for i in range(40)), add_special=True)
        want = answer(engine, ids)
        runner = engine.runner
        before = file_rss(path)
        runner.drop_embedding_pages()
        assert runner._embedding_pages and file_rss(path) < before
        assert answer(engine, ids) == want
    finally:
        engine.close()
    tied = load_model(str(write_tiny_model(tmp_path / "tied.gguf", "llama", tied=True,
                                           qtype="Q8_0")))
    engine = Engine(tied, tok, EngineConfig(n_ctx=256, parallel=1))
    try:
        engine.runner.drop_embedding_pages()
        assert engine.runner._embedding_pages == []
    finally:
        engine.close()
