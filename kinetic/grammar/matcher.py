"""Token masks from a grammar: a pushdown recognizer over bytes walked along a token trie.

A parser state is a set of stacks of grammar positions (the top a terminal position, the rest
the rule references to return to); the empty stack means the root rule is complete. State sets
are interned per grammar, and the transition table (state, byte) -> state is filled lazily and
shared by every matcher of the grammar, so in regular stretches (strings, numbers, whitespace)
the recognizer behaves like a cached DFA.

`fill_mask` walks the vocabulary's token trie level by level with numpy: at each depth it looks
up the transitions of all live (state, byte) pairs at once, computes only the missing ones in
Python (few: distinct pairs, not tokens), and prunes every subtree whose byte is rejected. The
mask of a state is cached, so returning to a state (inside a string after each character, say)
costs one copy.

Grammar work has a time budget (`mask_budget`): a client's grammar can make one state a set of
thousands of stacks, or a mask a walk of the whole trie from many states, so every loop here
checks the calling thread's deadline and raises MaskBudgetExceeded when it has passed. Nothing
is cached until it is complete, so the grammar's tables stay valid after an overrun.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kinetic.files import write_whole
from kinetic.grammar.ir import END, NONTERM, TERM, Grammar

DEAD = 0   # the empty state set
LOCAL_FRAMES = 3   # how many top stack frames a cached local walk covers, at most
SHARED_RULES = 64  # the most rules a signature may reach for its walk to be shared

_budget = threading.local()   # .deadline: time.perf_counter() past which grammar work stops


class MaskBudgetExceeded(RuntimeError):
    """Grammar work (a state's transitions, a mask) ran past the budget `mask_budget` set."""


class GrammarTooCostly(ValueError):
    """A grammar whose token masks cost more than the engine's budget (the API answers 400)."""


@contextmanager
def mask_budget(seconds: float | None):
    """Within the block, grammar work on this thread raises MaskBudgetExceeded once it has
    taken `seconds` in all (None: no limit). Blocks nest; the inner deadline rules inside."""
    previous = getattr(_budget, "deadline", None)
    _budget.deadline = None if seconds is None else time.perf_counter() + seconds
    try:
        yield
    finally:
        _budget.deadline = previous


def _check_budget() -> None:
    deadline = getattr(_budget, "deadline", None)
    if deadline is not None and time.perf_counter() > deadline:
        raise MaskBudgetExceeded("the grammar's token mask took longer than its budget")


TRIE_FORMAT = 1   # TokenVocab's arrays as _save writes them: a new layout, a new number


class TokenVocab:
    """A vocabulary's token trie, built once per tokenizer: `token_bytes[i]` are the exact bytes
    token i adds to the text; `eog_ids` the end-of-generation tokens, allowed exactly when the
    grammar can end. Tokens with no bytes (control tokens) are never allowed otherwise."""

    def __init__(self, token_bytes: list[bytes], eog_ids=()):
        self.size = len(token_bytes)
        self.token_bytes = list(token_bytes)
        self.eog_ids = np.array(sorted(set(eog_ids)), dtype=np.int64)
        self.n_words = (self.size + 31) // 32
        self.local_walks: dict[tuple, tuple] = {}   # grammar-independent walks (matcher.py)
        by_bytes: dict[bytes, list[int]] = {}
        eog = set(eog_ids)
        for i, b in enumerate(token_bytes):
            if b and i not in eog:
                by_bytes.setdefault(b, []).append(i)
        keys = sorted(by_bytes)
        # Level d holds the distinct prefixes of length d + 1, sorted, so the children of one
        # parent are contiguous: parent index, last byte, and the first/last child range.
        # int32 indexes and uint8 bytes (12 MB less than int64 throughout for a 262,144-token
        # vocabulary; the serving process builds the trie at start-up).
        self.levels: list[tuple[np.ndarray, np.ndarray]] = []
        self.child_lo: list[np.ndarray] = []   # per level d: children range in level d + 1
        self.child_hi: list[np.ndarray] = []
        self.ends: list[tuple[np.ndarray, np.ndarray]] = []  # (node index, token id) per level
        max_len = max((len(k) for k in keys), default=0)
        prev_index: dict[bytes, int] = {b"": 0}
        by_len: dict[int, list[bytes]] = {}
        for k in keys:
            by_len.setdefault(len(k), []).append(k)
        longer = list(keys)   # the keys of length >= d
        for d in range(1, max_len + 1):
            longer = [k for k in longer if len(k) >= d]
            prefixes = sorted({k[:d] for k in longer})
            index = {p: i for i, p in enumerate(prefixes)}
            parent = np.fromiter((prev_index[p[:-1]] for p in prefixes), np.int32, len(prefixes))
            byte = np.fromiter((p[-1] for p in prefixes), np.uint8, len(prefixes))
            self.levels.append((parent, byte))
            n_prev = len(prev_index)
            lo = np.searchsorted(parent, np.arange(n_prev), side="left").astype(np.int32)
            hi = np.searchsorted(parent, np.arange(n_prev), side="right").astype(np.int32)
            self.child_lo.append(lo)
            self.child_hi.append(hi)
            nodes, toks = [], []
            for k in by_len.get(d, ()):
                for t in by_bytes[k]:
                    nodes.append(index[k])
                    toks.append(t)
            self.ends.append((np.array(nodes, np.int32), np.array(toks, np.int32)))
            prev_index = index

    @classmethod
    def from_tokenizer(cls, tokenizer, special: bool = False,
                       cache: str | os.PathLike[str] | None = None) -> "TokenVocab":
        """The trie of a kinetic.text.tokenizer.Tokenizer. With `special`, control tokens
        count as their text (so a grammar can ask for a marker such as [TOOL_CALLS]); the
        engine uses this one, and renders those tokens as text in constrained answers.
        cache: a folder where the trie's arrays are kept, keyed by the tokens' bytes, so
        that the next start loads them (Gemma 3's 262,144 tokens: 2.6 s to build)."""
        token_bytes = [tokenizer.token_bytes(i, special) for i in range(tokenizer.vocab_size)]
        if cache is None:
            return cls(token_bytes, tokenizer.eog_ids)
        h = hashlib.sha256(f"trie {TRIE_FORMAT} {sorted(set(tokenizer.eog_ids))}".encode())
        for b in token_bytes:
            h.update(len(b).to_bytes(4, "little") + b)
        path = Path(cache) / f"trie-{h.hexdigest()[:32]}.npz"
        try:
            return cls._load(path, token_bytes, tokenizer.eog_ids)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            pass   # none yet, or torn: built and written again
        vocab = cls(token_bytes, tokenizer.eog_ids)
        vocab._save(path)
        return vocab

    def _arrays(self) -> dict[str, np.ndarray]:
        out = {}
        for d, ((parent, byte), lo, hi, (nodes, toks)) in enumerate(
                zip(self.levels, self.child_lo, self.child_hi, self.ends)):
            out.update({f"parent{d}": parent, f"byte{d}": byte, f"lo{d}": lo, f"hi{d}": hi,
                        f"nodes{d}": nodes, f"toks{d}": toks})
        return out

    def _save(self, path: Path) -> None:
        """The trie's arrays at path, written whole (a temporary name renamed); a folder that
        cannot be written is only a slower next start."""
        buf = io.BytesIO()
        np.savez(buf, **self._arrays())
        try:
            write_whole(path, buf.getvalue())
        except OSError:
            pass

    @classmethod
    def _load(cls, path: Path, token_bytes: list[bytes], eog_ids) -> "TokenVocab":
        """The trie _save wrote for these tokens, without building it."""
        vocab = cls([], eog_ids)
        vocab.size, vocab.token_bytes = len(token_bytes), list(token_bytes)
        vocab.n_words = (vocab.size + 31) // 32
        with np.load(path, allow_pickle=False) as z:
            if len(z.files) % 6:
                raise ValueError("not a trie")
            for d in range(len(z.files) // 6):
                vocab.levels.append((z[f"parent{d}"], z[f"byte{d}"]))
                vocab.child_lo.append(z[f"lo{d}"])
                vocab.child_hi.append(z[f"hi{d}"])
                vocab.ends.append((z[f"nodes{d}"], z[f"toks{d}"]))
        return vocab


class _States:
    """Interned state sets of one grammar and their lazily filled transition table."""

    def __init__(self, g: Grammar):
        self.g = g
        self.sets: list[frozenset] = [frozenset()]
        self.ids: dict[frozenset, int] = {frozenset(): DEAD}
        self.table = np.full((64, 256), -1, dtype=np.int32)
        self.table[DEAD] = DEAD
        self.can_end: list[bool] = [False]
        self.masks: dict[TokenVocab, dict[int, np.ndarray]] = {}   # vocab -> state -> mask
        self._signatures: dict[tuple, tuple | None] = {}
        self._frames: dict[tuple, tuple] = {}   # stack -> the frames its local walk covers
        self.local_walks: dict[TokenVocab, dict[tuple, tuple]] = {}   # unshared local walks
        self._can_end_np = np.zeros(0, dtype=bool)
        stacks: set = set()
        seen: set = set()
        for st in g.starts[g.root]:
            self._expand((st,), stacks, seen)
        self.start = self.intern(stacks)

    def intern(self, stacks) -> int:
        key = frozenset(stacks)
        sid = self.ids.get(key)
        if sid is None:
            sid = len(self.sets)
            self.ids[key] = sid
            self.sets.append(key)
            self.can_end.append(() in key)
            if sid >= len(self.table):
                grown = np.full((2 * len(self.table), 256), -1, dtype=np.int32)
                grown[:len(self.table)] = self.table
                self.table = grown
        return sid

    def signature(self, frames: tuple) -> tuple | None:
        """What a stack ending in `frames` can do until it returns below them, written without
        rule or position ids: the rest of each frame's alternative and every rule reachable
        from them, numbered in the order they are met, terminals as byte masks. None when
        more than SHARED_RULES rules are reachable: such a signature is about the whole
        grammar (the rest of a big object), costly to build and shared by no other grammar."""
        if frames in self._signatures:
            return self._signatures[frames]
        g = self.g
        order: dict[int, int] = {}
        queue: list[int] = []

        def tail(q: int) -> tuple:
            out = []
            while g.kind[q] != END:
                if g.kind[q] == TERM:
                    out.append(g.arg[q])
                else:
                    r = g.arg[q]
                    if r not in order:
                        order[r] = len(order)
                        queue.append(r)
                    out.append(-1 - order[r])
                q += 1
            return tuple(out)

        parts = [tail(q + 1) for q in frames[:-1]] + [tail(frames[-1])]
        i = 0
        while i < len(queue):
            if len(order) > SHARED_RULES:
                self._signatures[frames] = None
                return None
            parts.append(tuple(tail(st) for st in g.starts[queue[i]]))
            i += 1
        sig = self._signatures[frames] = tuple(parts)
        return sig

    def local_frames(self, stack: tuple) -> tuple:
        """The top frames of `stack` its local walk covers: the most (up to LOCAL_FRAMES)
        whose signature can be shared across grammars, else the top frame alone."""
        frames = self._frames.get(stack)
        if frames is None:
            _check_budget()
            frames = stack[-1:]
            for k in range(min(LOCAL_FRAMES, len(stack)), 0, -1):
                if self.signature(stack[-k:]) is not None:
                    frames = stack[-k:]
                    break
            self._frames[stack] = frames
        return frames

    def can_end_array(self) -> np.ndarray:
        if len(self._can_end_np) != len(self.can_end):
            self._can_end_np = np.array(self.can_end, dtype=bool)
        return self._can_end_np

    def _expand(self, stack: tuple, out: set, seen: set) -> None:
        """Adds to `out` the stacks with a terminal on top (or the empty stack) reachable from
        `stack` without consuming a byte."""
        g = self.g
        kind, arg, starts = g.kind, g.arg, g.starts
        work = [stack]
        n = 0
        while work:
            st = work.pop()
            if st in seen:
                continue
            seen.add(st)
            n += 1
            if not n & 1023:
                _check_budget()
            if not st:
                out.add(())
                continue
            p = st[-1]
            k = kind[p]
            if k == TERM:
                out.add(st)
            elif k == NONTERM:
                if kind[p + 1] == END:
                    # a tail call: returning here would only return again, so the callee
                    # takes this frame's place (keeps repetitions at a constant depth)
                    work.extend(st[:-1] + (s,) for s in starts[arg[p]])
                else:
                    work.extend(st + (s,) for s in starts[arg[p]])
            else:   # END: return to the caller, which moves past its reference
                work.append(st[:-2] + (st[-2] + 1,) if len(st) > 1 else ())

    def step(self, sid: int, b: int) -> int:
        t = int(self.table[sid, b])
        if t < 0:
            self.fill_row(sid)
            t = int(self.table[sid, b])
        return t

    def fill_row(self, sid: int) -> None:
        """Computes the transitions of a state on all 256 bytes at once: each stack's successor
        is the same for every byte of its top terminal, so the stacks are advanced once each and
        the bytes grouped by which stacks take them."""
        g = self.g
        stacks = [st for st in self.sets[sid] if st]
        succ = []
        bits = np.zeros((len(stacks), 256), dtype=bool)
        for i, st in enumerate(stacks):
            if not i & 63:
                _check_budget()
            out: set = set()
            self._expand(st[:-1] + (st[-1] + 1,), out, set())
            succ.append(out)
            m = g.arg[st[-1]]
            bits[i] = np.unpackbits(np.frombuffer(m.to_bytes(32, "little"), np.uint8),
                                    bitorder="little").astype(bool)
        # bytes taken by the same stacks share a successor
        if len(stacks) <= 62:
            weights = np.left_shift(np.int64(1), np.arange(len(stacks), dtype=np.int64))
            keys, inverse = np.unique(weights @ bits, return_inverse=True)
            sigs = ((keys[None, :] >> np.arange(len(stacks))[:, None]) & 1).astype(bool)
        else:
            sigs, inverse = np.unique(bits, axis=1, return_inverse=True)
        targets = np.zeros(sigs.shape[1], dtype=np.int32)
        for j in range(sigs.shape[1]):
            _check_budget()
            out: set = set()
            for i in np.flatnonzero(sigs[:, j]).tolist():
                out |= succ[i]
            targets[j] = self.intern(out) if out else DEAD
        self.table[sid] = targets[inverse.reshape(-1)]

    def fill(self, sids: np.ndarray, bs: np.ndarray) -> np.ndarray:
        """Vectorized step over (state, byte) pairs."""
        t = self.table[sids, bs]
        miss = t < 0
        if miss.any():
            for sid in np.unique(sids[miss]).tolist():
                self.fill_row(sid)
            t = self.table[sids, bs]
        return t


def _states(g: Grammar) -> _States:
    if g._states is None:
        g._states = _States(g)
    return g._states


def _going(depths: np.ndarray, width: int) -> list[int]:
    """For depths sorted in decreasing order: how many are deeper than each of 0..width - 1."""
    return np.searchsorted(-depths, -np.arange(width), side="left").tolist()


class Matcher:
    """Follows one generation through a grammar: accept tokens, compute the mask of the tokens
    allowed next, roll back rejected draft tokens."""

    def __init__(self, grammar: Grammar, vocab: TokenVocab):
        self.grammar = grammar
        self.vocab = vocab
        self._s = _states(grammar)
        self._history: list[int] = [self._s.start]   # state after each accepted token
        self._terminated = False
        self._eog = set(vocab.eog_ids.tolist())

    @property
    def state(self) -> int:
        return self._history[-1]

    def can_end(self) -> bool:
        """Whether the text so far is a complete sentence of the grammar (EOS allowed)."""
        return self._s.can_end[self.state]

    def is_terminated(self) -> bool:
        """Whether an end-of-generation token was accepted."""
        return self._terminated

    def accept_bytes(self, data: bytes) -> bool:
        """Advances over raw bytes; returns False (changing nothing) if they do not fit."""
        sid = self.state
        for b in data:
            sid = self._s.step(sid, b)
            if sid == DEAD:
                return False
        self._history.append(sid)
        return True

    def accept_token(self, token_id: int) -> bool:
        """Advances over a token; returns False (changing nothing) if the grammar rejects it."""
        if self._terminated:
            return False
        if token_id in self._eog:
            if not self.can_end():
                return False
            self._history.append(self.state)
            self._terminated = True
            return True
        data = self.vocab.token_bytes[token_id]
        if not data:
            return False
        return self.accept_bytes(data)

    def rollback(self, n: int) -> None:
        """Undoes the last n accepted tokens."""
        if n < 0 or n >= len(self._history):
            raise ValueError(f"cannot roll back {n} tokens: {len(self._history) - 1} accepted")
        if n:
            del self._history[-n:]
            self._terminated = False

    def fill_mask(self, out: np.ndarray) -> None:
        """Writes the allowed next tokens into `out`, an int32 row of ceil(vocab / 32) words
        (bit i % 32 of word i // 32 set when token i is allowed)."""
        if self._terminated:
            out[:] = 0
            return
        out[:] = self._mask(self.state).view(np.int32)[:len(out)]

    def allowed_tokens(self) -> np.ndarray:
        """The allowed token ids (for tests and debugging)."""
        row = np.zeros(self.vocab.n_words, np.int32)
        self.fill_mask(row)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:self.vocab.size]
        return np.flatnonzero(bits)

    def _mask(self, sid: int) -> np.ndarray:
        """The packed mask of a state. The top frames of each stack have a cached local walk
        (the trie walked from those frames alone, as if they were the whole stack): tokens it
        allows are allowed whatever lies below, and the trie nodes where it ran past the
        bottom frame's end (the frontier) are the only ones walked again with the real
        stacks. So entering a string in a new context costs only the tokens that leave it."""
        cache = self._s.masks.setdefault(self.vocab, {})
        cached = cache.get(sid)
        if cached is not None:
            return cached
        v = self.vocab
        s = self._s
        allowed = np.zeros(v.n_words * 32, dtype=bool)
        if s.can_end[sid] and len(v.eog_ids):
            allowed[v.eog_ids] = True
        fronts = []
        for frames in sorted({s.local_frames(st) for st in s.sets[sid] if st}):
            _check_budget()
            local_allowed, front = self._local(frames)
            allowed[:v.size] |= local_allowed
            if front is not None:
                fronts.append(front)
        if fronts:
            if len(fronts) == 1:
                depth, nodes, prefix, going = fronts[0]
            else:
                depth = np.concatenate([f[0] for f in fronts])
                nodes = np.concatenate([f[1] for f in fronts])
                prefix = np.zeros((len(depth), max(f[2].shape[1] for f in fronts)), np.uint8)
                at = 0
                for f in fronts:
                    prefix[at:at + len(f[0]), :f[2].shape[1]] = f[2]
                    at += len(f[0])
                _, first = np.unique(depth * (1 << 32) + nodes, return_index=True)
                first = first[np.argsort(-depth[first], kind="stable")]
                depth, nodes, prefix = depth[first], nodes[first], prefix[first]
                going = _going(depth, prefix.shape[1])
            # the real states at the frontier nodes, one column of prefix bytes at a time (the
            # rows are sorted deepest first, so the rows still going are a leading slice)
            states = np.full(len(depth), sid, np.int64)
            for j, n in enumerate(going):
                _check_budget()
                states[:n] = s.fill(states[:n], prefix[:n, j])
            entries = {}
            for d in np.unique(depth).tolist():
                sel = (depth == d) & (states != DEAD)
                if sel.any():
                    entries[d] = (nodes[sel], states[sel])
            if entries:
                self._walk(entries, allowed, None)
        packed = np.packbits(allowed, bitorder="little").view(np.uint32)
        if len(cache) >= 4096:
            cache.clear()
        cache[sid] = packed
        return packed

    def _local(self, frames: tuple):
        # Keyed by the shape of what can follow, so grammars with the same string or number
        # rules (every JSON schema) share the walks; frames that reach too much of their
        # grammar to be shared are cached by the grammar alone, keyed by the frames.
        key = self._s.signature(frames)
        if key is None:
            cache = self._s.local_walks.setdefault(self.vocab, {})
            key = frames
        else:
            cache = self.vocab.local_walks
        hit = cache.get(key)
        if hit is None:
            s = self._s
            local = s.intern({frames})
            allowed = np.zeros(self.vocab.size, dtype=bool)
            frontier: dict[int, np.ndarray] = {}
            self._walk({0: (np.zeros(1, np.int64), np.full(1, local, np.int64))}, allowed,
                       frontier)
            front = None
            if frontier:
                # (depths, nodes, prefix bytes padded to the deepest, how many rows are deeper
                # than each column) of the frontier nodes, deepest first
                order = sorted(frontier, reverse=True)
                depths = np.concatenate([np.full(len(frontier[d]), d, np.int64)
                                         for d in order])
                nodes = np.concatenate([frontier[d] for d in order])
                prefix = np.zeros((len(nodes), order[0]), np.uint8)
                at = 0
                for d in order:
                    n = frontier[d]
                    prefix[at:at + len(n), :d] = self._prefixes(d, n)
                    at += len(n)
                going = _going(depths, order[0])
                front = (depths, nodes, prefix, going)
            if len(cache) >= 256:
                cache.clear()
            hit = cache[key] = (allowed, front)
        return hit

    def _prefixes(self, depth: int, nodes: np.ndarray) -> np.ndarray:
        """The bytes of the trie nodes at `depth`, one row per node."""
        out = np.zeros((len(nodes), depth), np.int64)
        idx = nodes
        for d in range(depth - 1, -1, -1):
            parent, byte = self.vocab.levels[d]
            out[:, d] = byte[idx]
            idx = parent[idx]
        return out

    def _walk(self, entries: dict, allowed: np.ndarray, frontier: dict | None) -> None:
        """Walks the trie level by level from entries {depth: (nodes, states)}, marking the
        tokens whose bytes the states accept. With `frontier`, records the nodes (with
        children) where a state can end, that is, where the local walk left its frame."""
        v = self.vocab
        s = self._s
        depth = min(entries)
        nodes, states = entries.pop(depth)
        while depth < len(v.levels):
            _check_budget()
            if len(nodes):
                lo = v.child_lo[depth][nodes]
                counts = v.child_hi[depth][nodes] - lo
                total = int(counts.sum())
            else:
                total = 0
            parent, byte = v.levels[depth]
            if total:
                # children of the live nodes: ranges lo..hi, concatenated
                offs = np.repeat(lo - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
                child = offs + np.arange(total)
                cstate = s.fill(np.repeat(states, counts), byte[child]).astype(np.int64)
                live = cstate != DEAD
                child, cstate = child[live], cstate[live]
                end_nodes, end_toks = v.ends[depth]
                if len(end_nodes) and len(child):
                    mark = np.zeros(len(parent), dtype=bool)
                    mark[child] = True
                    allowed[end_toks[mark[end_nodes]]] = True
                if frontier is not None and len(child) and depth + 1 < len(v.levels):
                    ends = s.can_end_array()[cstate]
                    inner = v.child_hi[depth + 1][child] > v.child_lo[depth + 1][child]
                    if (ends & inner).any():
                        frontier[depth + 1] = child[ends & inner]
            else:
                child = cstate = np.zeros(0, np.int64)
            depth += 1
            if depth in entries:
                more_nodes, more_states = entries.pop(depth)
                child = np.concatenate((child, more_nodes))
                cstate = np.concatenate((cstate, more_states))
            nodes, states = child, cstate
            if not len(nodes) and not entries:
                break


def accepts(grammar: Grammar, data: bytes) -> bool:
    """Whether `data` is a whole sentence of the grammar (over bytes: no vocabulary needed)."""
    s = _states(grammar)
    sid = s.start
    for b in data:
        sid = s.step(sid, b)
        if sid == DEAD:
            return False
    return s.can_end[sid]
