"""Evicted-but-valid KV pages kept in host memory.

When the device page pool runs out, the least recently used cached pages are evicted; their
contents are copied here first (keyed by the same hash chain as the device prefix cache), so a
later request that starts the same way gets them back by a copy instead of recomputing them.
On this CPU a page copy costs a few microseconds per layer, far less than the share of a step
its 16 tokens would cost to recompute. LRU, bounded in bytes.

The bound counts what the store holds: an array that is a view into a bigger block (a page
of Runner.read_pages' batch of 8, itself a view of XLA's buffer) is copied in, since the view
would keep the whole block alive. Kept as views, each page held up to 8 pages' bytes while
counting one, and a server's memory grew by about 1 GB per batch request of 64 prompts, to
about 8 times --cache-ram (issue 36; docs/architecture.md).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class HostPageStore:
    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.used = 0
        self._pages: OrderedDict[bytes, list[np.ndarray]] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def put(self, key: bytes, data: list[np.ndarray]) -> None:
        """Keep one page's arrays (one per cache, e.g. per layer k and v); the least recently
        used pages go when the store is over capacity. Views are copied: the store owns
        exactly the bytes it counts."""
        size = sum(a.nbytes for a in data)
        if size > self.capacity:
            return
        if key in self._pages:
            self._pages.move_to_end(key)
            return
        self._pages[key] = [a if a.flags.owndata else a.copy() for a in data]
        self.used += size
        while self.used > self.capacity:
            _, old = self._pages.popitem(last=False)
            self.used -= sum(a.nbytes for a in old)

    def drop(self, key: bytes) -> bool:
        """Forget one page; False if it was not here."""
        data = self._pages.pop(key, None)
        if data is None:
            return False
        self.used -= sum(a.nbytes for a in data)
        return True

    def get(self, key: bytes) -> list[np.ndarray]:
        self._pages.move_to_end(key)
        return self._pages[key]
