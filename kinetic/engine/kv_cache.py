"""KV page manager: page allocation, reference counts and the prefix cache (pure Python).

The KV cache on the device is an array of `num_pages` pages of `page_size` token rows; this
module only decides which page ids each sequence uses. Page 0 is reserved for the runner's
padding rows and is never handed out.

Prefix reuse. Each FULL page of a sequence has a key: the SHA-256 of (its parent page's key,
its token ids), so a key names the whole token prefix up to the end of that page. When a page
has been computed the scheduler `register`s it; a later sequence whose tokens start the same
way finds the pages by key and shares them read-only (its refcount goes up). A partial page is
never keyed, so a sequence that continues from a shared prefix writes only into its own pages.

Every page 1..num_pages-1 is in exactly one state:
  free       refcount 0, no key; never used, or released without a key
  evictable  refcount 0, keyed: still matchable, kept in LRU order
  used       refcount > 0 (keyed or not)
The cache's memory is taken from the system as pages are first written (Runner.cache), so
reusing a written page costs nothing and a never-used one costs a page of memory per layer.
Allocation therefore takes written pages first: released free ones (the last released
first, a sequence's head before its tail), then, once more than `retain` pages are
evictable, the least recently released evictable page (its key dropped); only then a
never-used page, lowest id first; and evictable pages again when none is left. The device
thus keeps at least `retain` pages of released prefixes (the scheduler gives a quarter of
one slot's context), and its memory grows with the pages in use at once, not with every
token ever served; older prefixes go to the host tier (host_cache.py, --cache-ram) as they
are evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

RESERVED_PAGE = 0  # the runner's padding rows write here (kinetic/engine/runner.py)
# hand_back's runs take up to this many handed-back neighbours on each side: a memory page
# (4 KiB) that two cache pages share (a page is 1 KiB a layer at the least: 16 rows of 2
# heads of 16 values in f16) goes back once both are handed back
HAND_BACK_REACH = 4


class OutOfPages(RuntimeError):
    """Raised by `PageManager.allocate` when free + evictable pages cannot cover a request;
    the scheduler answers it by preempting a sequence."""


def page_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Key of a full page holding `tokens`, whose preceding page has key `parent` (None for
    the first page). Parent digests are 32 bytes, so the byte string hashed is unambiguous."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", tokens).tobytes())
    return h.digest()


def partial_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Key of the first len(tokens) < page_size rows of a page (a finished sequence's last,
    partly filled page), after the page with key `parent`. The hashed bytes are 7 mod 8 long,
    so they never equal a full page's (0 mod 8)."""
    h = hashlib.sha256(b"partial" + (parent or b""))
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_keys(keys: list[bytes], tokens: Sequence[int], page_size: int,
                num_pages: int) -> list[bytes]:
    """Extend `keys` (the chain for the first len(keys) pages of `tokens`) in place to the
    first `num_pages` full pages of `tokens`, or as many as are full; returns `keys`."""
    num_pages = min(num_pages, len(tokens) // page_size)
    while len(keys) < num_pages:
        i = len(keys)
        keys.append(page_key(keys[-1] if keys else None,
                             tokens[i * page_size:(i + 1) * page_size]))
    return keys


class PageManager:
    """Owns page ids 1..num_pages-1: their refcounts, keys and free / evictable lists."""

    def __init__(self, num_pages: int, page_size: int, retain: int | None = None):
        """retain: evictable pages kept before a written one is reused rather than a
        never-used one taken (None: all of them, never-used pages always first)."""
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"need at least 2 pages (one is reserved) and page_size >= 1, "
                             f"got num_pages={num_pages}, page_size={page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.retain = num_pages if retain is None else max(0, retain)
        self._refs = [0] * num_pages
        self._free: deque[int] = deque()   # released free pages, next to be reused first
        self._fresh = 1                   # never-used pages: self._fresh .. num_pages - 1
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recent first
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        # (page, key) of valid pages evicted since the last `take_evicted`: their content
        # is still on the device until the next step overwrites it (the host tier saves it)
        self.evicted: list[tuple[int, bytes]] = []
        # pages whose sliding-window layers' rows are to be handed back, and those handed
        # back, since they were last allocated (engine/sliding_window.py)
        self._to_hand_back: set[int] = set()
        self._handed_back: set[int] = set()

    # --- inspection -------------------------------------------------------------------
    @property
    def free_count(self) -> int:
        """Pages with no refcount and no key."""
        return len(self._free) + self.num_pages - self._fresh

    @property
    def evictable(self) -> list[int]:
        """Keyed pages with refcount 0, in eviction order (next to be evicted first)."""
        return list(self._evictable)

    @property
    def available(self) -> int:
        """Pages `allocate` can hand out now: free plus evictable."""
        return self.free_count + len(self._evictable)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def key(self, page: int) -> bytes | None:
        return self._key_of.get(page)

    # --- prefix cache -----------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Pages holding the longest cached prefix of the key chain `keys`; changes nothing."""
        pages = []
        for k in keys:
            page = self._page_of.get(k)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: Sequence[int]) -> None:
        """Take one more reference on each of `pages` (keyed pages found by `lookup`); an
        evictable page leaves the evictable list."""
        for page in pages:
            if self._refs[page] == 0:
                if page not in self._evictable:
                    raise ValueError(f"page {page} is neither used nor evictable")
                del self._evictable[page]
            self._refs[page] += 1

    def match_prefix(self, tokens: Sequence[int]) -> list[int]:
        """Acquire and return the cached pages of the longest full-page prefix of `tokens`,
        leaving at least the last token uncomputed (its logits are needed), so a prompt of
        exactly n full pages matches at most n - 1. Cached tokens = len(result) * page_size."""
        keys = extend_keys([], tokens, self.page_size, (len(tokens) - 1) // self.page_size)
        pages = self.lookup(keys)
        self.acquire(pages)
        return pages

    def register(self, page: int, key: bytes) -> bool:
        """Record that used `page` now holds the full page named `key`. Returns False, and
        records nothing, when another page already holds `key` (two sequences computed the
        same prefix at once: the first one stays the cached copy)."""
        if self._refs[page] == 0:
            raise ValueError(f"page {page} is not in use and cannot be registered")
        if key in self._page_of:
            return self._page_of[key] == page
        if page in self._key_of:
            raise ValueError(f"page {page} already holds another key")
        self._page_of[key] = page
        self._key_of[page] = key
        return True

    def forget(self, keys: Sequence[bytes]) -> int:
        """Drop the cached pages named by `keys` that no sequence uses (they become free).
        Returns how many were dropped; pages in use keep their keys."""
        dropped = 0
        for key in keys:
            page = self._page_of.get(key)
            if page is None or self._refs[page] > 0:
                continue
            del self._evictable[page], self._page_of[key], self._key_of[page]
            self._free.append(page)
            dropped += 1
        return dropped

    # --- allocation -------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n pages with refcount 1, written ones first (see the module's docstring; evicted
        pages' keys are dropped). All or nothing: raises OutOfPages, changing nothing, if
        n > available."""
        if n > self.available:
            raise OutOfPages(f"{n} pages requested, {self.available} available")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            elif len(self._evictable) <= self.retain and self._fresh < self.num_pages:
                page, self._fresh = self._fresh, self._fresh + 1
            else:
                page, _ = self._evictable.popitem(last=False)
                key = self._key_of.pop(page)
                del self._page_of[key]
                self.evicted.append((page, key))
            self._refs[page] = 1
            self._to_hand_back.discard(page)   # its next owner writes it: nothing to hand back
            self._handed_back.discard(page)
            pages.append(page)
        return pages

    def pass_window(self, page: int) -> None:
        """List `page`'s sliding-window rows to be handed back (by hand_back), unless it is
        allocated again first."""
        self._to_hand_back.add(page)

    @property
    def to_hand_back(self) -> int:
        return len(self._to_hand_back)

    def hand_back(self) -> list[tuple[int, int]]:
        """The runs (first page, count) of the listed pages to hand back now, each with up
        to HAND_BACK_REACH neighbours on either side that were handed back before (and not
        allocated since), consecutive ones as one run, so that a memory page two cache pages
        share goes back once both have. They count as handed back until next allocated."""
        pages, self._to_hand_back = sorted(self._to_hand_back), set()
        self._handed_back.update(pages)
        wanted: set[int] = set()
        for page in pages:
            wanted.add(page)
            for step in (-1, 1):
                for k in range(1, HAND_BACK_REACH + 1):
                    if page + step * k not in self._handed_back:
                        break
                    wanted.add(page + step * k)
        runs: list[tuple[int, int]] = []
        for page in sorted(wanted):
            if runs and runs[-1][0] + runs[-1][1] == page:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((page, 1))
        return runs

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference on each of a sequence's `pages` (given in sequence order). A
        page whose refcount reaches 0 becomes evictable if keyed, else free. Pages are
        released last first, so a sequence's tail is evicted before its head: a cached
        prefix is only useful from its start."""
        for page in reversed(pages):
            if self._refs[page] <= 0:
                raise ValueError(f"page {page} released more often than acquired")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.appendleft(page)

    def check_invariants(self, held: dict[int, int] | None = None) -> None:
        """Raise AssertionError unless every page is in exactly one state, refcounts are
        non-negative, keys and pages map one to one, and (if `held`, page -> number of
        holders, is given) each refcount equals its number of holders."""
        free, evict = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a page is twice in the free list"
        assert all(p < self._fresh for p in free), "a never-used page is in the free list"
        free |= set(range(self._fresh, self.num_pages))
        assert not free & evict, f"pages both free and evictable: {free & evict}"
        assert RESERVED_PAGE not in free | evict and self._refs[RESERVED_PAGE] == 0
        for page in range(1, self.num_pages):
            r = self._refs[page]
            assert r >= 0, f"page {page} has refcount {r}"
            states = (page in free) + (page in evict) + (r > 0)
            assert states == 1, f"page {page} is in {states} states (refcount {r})"
            if page in free:
                assert page not in self._key_of, f"free page {page} has a key"
            if page in evict:
                assert page in self._key_of, f"evictable page {page} has no key"
        assert len(self._key_of) == len(self._page_of)
        for page, k in self._key_of.items():
            assert self._page_of.get(k) == page, f"key of page {page} maps elsewhere"
        if held is not None:
            for page in range(1, self.num_pages):
                assert self._refs[page] == held.get(page, 0), (
                    f"page {page}: refcount {self._refs[page]}, "
                    f"held by {held.get(page, 0)} sequences")
