"""PageManager: exact page ids, refcounts, prefix keys and eviction order."""

from __future__ import annotations

import pytest

from kinetic.engine.kv_cache import OutOfPages, PageManager, extend_keys, page_key


def keyed(pm: PageManager, tokens: list[int], n_pages: int) -> list[int]:
    """Allocate n_pages for `tokens` and register every full one; returns the pages."""
    pages = pm.allocate(n_pages)
    for page, k in zip(pages, extend_keys([], tokens, pm.page_size, n_pages)):
        assert pm.register(page, k)
    return pages


def test_allocation_order_and_free_list():
    pm = PageManager(6, 4)
    assert pm.free_count == 5 and pm.available == 5
    assert pm.allocate(2) == [1, 2]  # page 0 is reserved
    assert [pm.refcount(p) for p in range(6)] == [0, 1, 1, 0, 0, 0]
    pm.release([1, 2])  # unkeyed pages return to the free list, reused before fresh ones
    assert pm.free_count == 5 and pm.evictable == []
    assert pm.allocate(5) == [1, 2, 3, 4, 5]
    pm.release([4, 5])
    pm.release([2])     # the last released first, then the other sequence's head first
    assert pm.allocate(3) == [2, 4, 5]
    pm.check_invariants()


def test_out_of_pages_changes_nothing():
    pm = PageManager(4, 2)
    pm.allocate(2)
    with pytest.raises(OutOfPages):
        pm.allocate(2)
    assert pm.free_count == 1 and pm.allocate(1) == [3]
    with pytest.raises(OutOfPages):
        pm.allocate(1)
    pm.check_invariants()


def test_eviction_takes_free_pages_first_then_the_tail_of_the_least_recent():
    pm = PageManager(6, 2)
    a_tokens = [10, 11, 12, 13, 14, 15, 16]
    a = keyed(pm, a_tokens, 3)
    assert a == [1, 2, 3]
    pm.release(a)
    assert pm.evictable == [3, 2, 1] and pm.free_count == 2
    assert pm.allocate(1) == [4]       # B: a never-used page
    assert pm.allocate(1) == [5]       # C: the last free page
    assert pm.allocate(1) == [3]       # D: evicts A's page 3, its tail, not page 1 or 2
    assert pm.key(3) is None and pm.evictable == [2, 1]
    assert pm.match_prefix(a_tokens) == [1, 2]  # A's head is still cached
    pm.check_invariants()


def test_matching_revives_an_evictable_page_and_release_makes_it_most_recent():
    pm = PageManager(8, 2)
    x = keyed(pm, [1, 2, 3], 1)
    y = keyed(pm, [7, 8, 9], 1)
    pm.release(x)
    pm.release(y)
    assert pm.evictable == [1, 2]
    assert pm.match_prefix([1, 2, 3]) == [1]
    assert pm.refcount(1) == 1 and pm.evictable == [2]
    pm.release([1])
    assert pm.evictable == [2, 1]  # page 2 is now the least recently used
    pm.check_invariants()


def test_shared_prefix_refcounts():
    pm = PageManager(8, 4)
    a = keyed(pm, list(range(12)), 3)
    b = pm.match_prefix(list(range(8)) + [99, 98])
    assert b == a[:2]
    assert [pm.refcount(p) for p in a] == [2, 2, 1]
    pm.release(a)
    assert [pm.refcount(p) for p in a] == [1, 1, 0] and pm.evictable == [a[2]]
    pm.release(b)
    assert pm.evictable == [a[2], a[1], a[0]]
    pm.check_invariants(held={})


def test_last_token_is_never_matched():
    pm = PageManager(8, 4)
    a = keyed(pm, list(range(8)), 2)
    # a prompt of exactly two cached pages matches one: its last token must be computed
    assert pm.match_prefix(list(range(8))) == [a[0]]
    assert pm.match_prefix(list(range(9))) == a
    assert pm.match_prefix([0]) == []


def test_partial_pages_are_never_keyed():
    assert len(extend_keys([], list(range(7)), 4, 10)) == 1
    pm = PageManager(8, 4)
    pages = pm.allocate(2)  # a sequence of 7 tokens: one full page, one partial
    keys = extend_keys([], list(range(7)), 4, 2)
    assert pm.register(pages[0], keys[0])
    assert pm.match_prefix(list(range(12))) == [pages[0]]


def test_keys_name_the_whole_prefix():
    same_page = [5, 6]
    assert page_key(None, same_page) != page_key(page_key(None, [1, 2]), same_page)
    assert page_key(None, [1, 2]) != page_key(None, [2, 1])
    pm = PageManager(8, 2)
    keyed(pm, [1, 2, 5, 6, 0], 2)
    assert len(pm.match_prefix([3, 4, 5, 6, 0])) == 0  # same second page, other parent


def test_duplicate_key_keeps_the_first_page():
    pm = PageManager(8, 2)
    k = page_key(None, [4, 4])
    p, q = pm.allocate(2)
    assert pm.register(p, k) and pm.register(p, k)
    assert not pm.register(q, k) and pm.key(q) is None
    pm.release([p, q])
    assert pm.evictable == [p] and pm.free_count == 6
    pm.check_invariants()


def test_misuse_is_refused():
    pm = PageManager(4, 2)
    with pytest.raises(ValueError):
        pm.register(1, page_key(None, [1, 1]))  # not in use
    (p,) = pm.allocate(1)
    pm.release([p])
    with pytest.raises(ValueError):
        pm.release([p])
    with pytest.raises(ValueError):
        pm.acquire([p])  # free, not cached
    with pytest.raises(ValueError):
        PageManager(1, 4)


def test_check_invariants_catches_corruption():
    pm = PageManager(6, 2)
    pages = pm.allocate(2)
    with pytest.raises(AssertionError):
        pm.check_invariants(held={pages[0]: 1})  # page 2's holder is missing
    pm._free.append(pages[0])  # a used page also listed free
    with pytest.raises(AssertionError):
        pm.check_invariants()


def test_written_pages_are_reused_before_never_used_ones_beyond_the_retained():
    """With `retain` pages of released prefixes kept, allocation reuses the least recently
    released evictable pages past that before it takes a never-used page (whose memory the
    system has not given yet), so the cache's memory follows the pages in use at once."""
    pm = PageManager(8, 2, retain=1)
    a_tokens = [10, 11, 12, 13, 14, 15, 16]
    a = keyed(pm, a_tokens, 3)
    assert a == [1, 2, 3]
    pm.release(a)
    assert pm.evictable == [3, 2, 1]
    assert pm.allocate(2) == [3, 2]    # A's tail, then the next, while more than 1 is kept
    assert pm.evictable == [1] and pm.allocate(1) == [4]   # 1 kept: a never-used page
    assert pm.match_prefix(a_tokens) == [1]   # A's head is still cached
    pm.release([1])
    pm.release([2])                    # unkeyed now: free, and reused first
    assert pm.allocate(1) == [2]
    assert pm.free_count == 3 and pm.allocate(4) == [5, 6, 7, 1]   # then the kept one
    pm.check_invariants()
