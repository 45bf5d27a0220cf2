"""A serving process's memory stays bounded under batch requests (issue 36): the host prompt
cache (kinetic/engine/host_cache.py, --cache-ram) holds no more than it counts.

It held each evicted page as a view into Runner.read_pages' batch of 8 pages, counting one
page and keeping 8 alive: SmolLM2 at `-np 2` grew by about 1 GB per request of 64 prompts."""

import json
import platform
import urllib.request

import numpy as np
import pytest

from kinetic.engine.host_cache import HostPageStore
from tests.serve_process import serving
from tests.tiny_models import write_tiny_model

CACHE_RAM_MB = 256
BATCHES, PROMPTS = 20, 64
# what the server may add after its first batch: the host cache filling up to --cache-ram,
# and the heap and the KV pages around it (measured: 289 MiB; 2314 MiB with views kept)
GROWTH_BOUND_MB = CACHE_RAM_MB + 128

WORDS = ("river stone garden window silver morning engine yellow quiet forest market letter "
         "winter candle bridge orange summer mountain pocket thunder velvet harbor").split()


def test_the_host_cache_holds_the_bytes_it_counts():
    block = np.arange(8 * 16 * 4, dtype=np.float32).reshape(8, 16, 4)  # read_pages' batch
    store = HostPageStore(capacity_bytes=1 << 20)
    store.put(b"k", [block[3], block[5]])
    kept = store.get(b"k")
    assert [a.base for a in kept] == [None, None]   # copies: the block is not kept alive
    assert store.used == sum(a.nbytes for a in kept) == 2 * 16 * 4 * 4
    np.testing.assert_array_equal(kept[0], block[3])
    owned = np.ones((16, 4), np.float32)
    store.put(b"o", [owned])
    assert store.get(b"o")[0] is owned             # an array that owns its data is kept as is


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


def _prompts(rng: np.random.Generator, batch: int) -> list[str]:
    """PROMPTS different sentences of about 26 tokens, none alike across batches: every
    page of every batch is new to the prefix cache and goes to the host cache when evicted."""
    return [f"Batch {batch} note {i}: write one line about the " + " ".join(rng.choice(WORDS, 12))
            for i in range(PROMPTS)]


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/PID/status")
def test_memory_stops_growing_under_batch_requests(tmp_path):
    # 4 layers of 8 kv heads of 64: a page of 16 tokens is 256 KB, a batch about 50 MB of pages
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_layer=4, n_head=8, n_kv_head=8,
                             head_dim=64, context_length=4096)
    rng = np.random.default_rng(0)
    with serving(str(model), "-np", "2", "--cache-ram", str(CACHE_RAM_MB)) as s:
        rss = []
        for b in range(BATCHES):
            body = json.dumps({"prompt": _prompts(rng, b), "n_predict": 16,
                               "temperature": 0, "ignore_eos": True}).encode()
            req = urllib.request.Request(s.url + "/completion", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                answers = json.loads(r.read())
            assert len(answers) == PROMPTS
            assert all(a["tokens_predicted"] == 16 for a in answers)
            rss.append(_rss_mb(s.proc.pid))
    growth = max(rss[1:]) - rss[0]
    assert growth < GROWTH_BOUND_MB, f"RSS after each batch (MiB): {rss}"
