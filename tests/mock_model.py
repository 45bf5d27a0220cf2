"""A hand-calculable mock model for engine tests (STYLE.md: JetStream's mock engine).

The rule. The next token after a sequence `tokens` (prompt plus output so far) is

    target(tokens) = (sum(tokens) + len(tokens)) % V          V = 31

and the logits of a row are `-((v - target) % V)` for every v: the target first, then
target+1, target+2, ... (mod V), one nat apart, so greedy decoding, the top-n
alternatives and every log-probability can be worked out by hand.

The rule is computed through the paged KV cache, so that paging bugs change tokens: each
row writes its token id into the K cache and its position + 1 into the V cache at its
write_index, then reads back its own sequence's rows through step.page_table[step.slots[t]]
at positions <= its own and sums the tokens (+1 each). A key found where the V cache says
another position was written (pages out of order, a wrong offset, a page of another
position) shifts the answer by 7; a stale, foreign or missing token changes the sum. Either
way the token changes.

Hand arithmetic. The first output token is x0 = (sum(prompt) + len(prompt)) % V; after a
token x the next is (2x + 1) % V. So every answer runs round one cycle of x -> 2x + 1 mod 31
(with the pieces below):
    a b d h p             0 1 3 7 15
    c f l x q             2 5 11 23 16
    e j t i r             4 9 19 8 17
    g n </s>              6 13 27: 27 is the end-of-generation token
    k v m z u             10 21 12 25 20
    o \xc3 \xa9 ' ' w     14 29 28 26 22: "oé w", with é split over two tokens
    '\n'                  30 (a fixed point)
e.g. the prompt "abc" = [0, 1, 2]: (3 + 3) % 31 = 6 "g", then 13 "n", then 27, which ends it.
Periodic answers are what n-gram drafting needs, so speculative decoding gets drafts
proposed and accepted.
"""

from __future__ import annotations

import queue
import sys
import threading
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from kinetic.engine.engine import Engine
from kinetic.engine.engine_config import EngineConfig
from kinetic.engine.request import Delta, GenerationRequest
from kinetic.model.config import Config
from kinetic.model.layers import StepInput, write_kv
from kinetic.model.loader import LoadedModel

V = 31
EOG = 27
PIECES: list[bytes] = ([bytes([ord("a") + i]) for i in range(26)]
                       + [b" ", b"</s>", b"\xa9", b"\xc3", b"\n"])
CONFIG = Config(arch="mock", n_layer=1, d_model=1, n_head=1, n_kv_head=1, head_dim=1,
                v_head_dim=1, d_ffn=1, vocab_size=V, context_length=1 << 16, norm_eps=1e-5,
                rope_base=10000.0, rope_dim=0, rope_neox=True)


# --- the architecture (what Runner calls as model.arch.forward) ------------------------------

def forward(weights: dict, cfg: Config, cache: list, step: StepInput):
    """[T] rows -> (logits [T, V] float32, the updated cache). Pure and jittable."""
    (k_cache, v_cache), = cache
    T = step.tokens.shape[0]
    k_cache = write_kv(k_cache, step.tokens.astype(jnp.float32)[:, None, None], step.write_index)
    v_cache = write_kv(v_cache, (step.positions + 1).astype(jnp.float32)[:, None, None],
                       step.write_index)
    table = step.page_table[step.slots]                       # [T, P] the row's own pages
    keys = k_cache[table].reshape(T, -1)                      # [T, L] token ids by position
    where = v_cache[table].reshape(T, -1)                     # [T, L] 1 + the position written
    L = keys.shape[1]
    visible = jnp.arange(L)[None, :] <= step.positions[:, None]
    total = jnp.sum(jnp.where(visible, keys + 1.0, 0.0), axis=1)  # sum(tokens) + len(tokens)
    # a key read from the wrong place (page order, offset, a page of another position)
    # shifts the answer by 7: never right by accident
    misplaced = jnp.any(visible & (where != jnp.arange(1, L + 1)[None, :]), axis=1)
    target = (total.astype(jnp.int32) + jnp.where(misplaced, 7, 0)) % cfg.vocab_size
    v = jnp.arange(cfg.vocab_size)[None, :]
    logits = -((v - target[:, None]) % cfg.vocab_size).astype(jnp.float32)
    return logits, [(k_cache, v_cache)]


# --- the hand formula -------------------------------------------------------------------------

def target(tokens: list[int]) -> int:
    return (sum(tokens) + len(tokens)) % V


def logits_of(tokens: list[int]) -> np.ndarray:
    """The mock's logits [V] after `tokens`."""
    return -((np.arange(V) - target(tokens)) % V).astype(np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.sum(np.exp(x - m)))


def greedy(prompt: list[int], max_tokens: int | None = None, n_ctx: int | None = None,
           banned: frozenset[int] | set[int] = frozenset()) -> tuple[list[int], str]:
    """What the engine must answer greedily: (output tokens, finish reason). EOG ends the
    answer and is not part of it; max_tokens or the context end (the sequence may reach
    n_ctx + 1 tokens: the last one needs no K/V) give "length". `banned` tokens (logit_bias
    -100, ignore_eos) are skipped: the best of target + 1, target + 2, ... is taken."""
    tokens, out = list(prompt), []
    while True:
        t = next((target(tokens) + j) % V for j in range(V)
                 if (target(tokens) + j) % V not in banned)
        if t == EOG:
            return out, "stop"
        tokens.append(t)
        out.append(t)
        if (max_tokens is not None and len(out) >= max_tokens) or (
                n_ctx is not None and len(tokens) > n_ctx):
            return out, "length"


def text_of(tokens: list[int]) -> str:
    return b"".join(PIECES[t] for t in tokens).decode("utf-8", errors="replace")


def ids(text: str) -> list[int]:
    """Token ids of a text of single-byte pieces ("a".."z", " ", "\\n")."""
    return [PIECES.index(bytes([b])) for b in text.encode()]


# --- tokenizer, model, engine -----------------------------------------------------------------

class MockTokenizer:
    """The interface the engine uses: eog_ids, token_bytes, token_piece, encode, decode."""

    vocab_size = V
    eog_ids = frozenset({EOG})
    bos_id = None
    eos_id = EOG

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        if token_id == EOG:
            return PIECES[token_id] if special else b""
        return PIECES[token_id]

    def token_piece(self, token_id: int, special: bool = False) -> str:
        if token_id == EOG and not special:
            return ""
        return PIECES[token_id].decode("utf-8", errors="replace")

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return [PIECES.index(bytes([b])) for b in text.encode() if bytes([b]) in PIECES]

    def decode(self, token_ids: list[int], skip_special: bool = True) -> str:
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")


def mock_model() -> LoadedModel:
    # the arch is this module: it has `forward`, as kinetic.model.llama does
    return LoadedModel(file=None, config=CONFIG, weights={}, arch=sys.modules[__name__])


def make_engine(**config) -> Engine:
    """An engine over the mock model; EngineConfig fields as keywords (small defaults). Its
    cache holds token ids and positions, so a float32 one: a half holds integers exactly only
    up to 2048."""
    defaults = dict(parallel=2, n_ctx=64, step_tokens=16, page_size=4, kv_dtype="float32")
    return Engine(mock_model(), MockTokenizer(), EngineConfig(**{**defaults, **config}))


# --- driving an engine from a test ------------------------------------------------------------

TIMEOUT = 120.0  # seconds; only ever reached when something hangs (then the test fails)


@dataclass
class Result:
    """Everything one request produced, folded from its deltas."""

    deltas: list[Delta]

    @property
    def tokens(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    @property
    def logprobs(self) -> list:
        return [lp for d in self.deltas for lp in d.logprobs]

    @property
    def finish_reason(self) -> str | None:
        return self.deltas[-1].finish_reason

    @property
    def usage(self):
        return self.deltas[-1].usage


def run(engine: Engine, request: GenerationRequest) -> Result:
    """The request through `engine.generate`, to its end."""
    return Result(list(engine.generate(request)))


class Collector:
    """A sink (called on the engine thread) that keeps a request's deltas for `wait`."""

    def __init__(self):
        self.deltas: queue.SimpleQueue = queue.SimpleQueue()

    def __call__(self, delta: Delta) -> None:
        self.deltas.put(delta)

    def wait(self) -> Result:
        """Every delta up to the final one (blocks until it arrives)."""
        out = []
        while not out or out[-1].finish_reason is None:
            out.append(self.deltas.get(timeout=TIMEOUT))
        return Result(out)


class Gate(Collector):
    """A sink that, once `at` deltas with tokens have arrived, holds the engine thread inside
    it (mid-step: the scheduler has planned the step, `complete` has not run) until
    `release`. While held, the test thread can read the engine's state without a race and
    queue requests that must reach the engine together."""

    def __init__(self, at: int = 1):
        super().__init__()
        self.at, self.seen = at, 0
        self.reached, self.released = threading.Event(), threading.Event()

    def __call__(self, delta: Delta) -> None:
        super().__call__(delta)
        if delta.token_ids:
            self.seen += 1
            if self.seen == self.at:
                self.reached.set()
                if not self.released.wait(TIMEOUT):
                    raise RuntimeError("the test never released the gate")

    def wait_reached(self) -> None:
        if not self.reached.wait(TIMEOUT):
            raise AssertionError("the engine never reached the gate")

    def release(self) -> None:
        self.released.set()


class Paused:
    """`with Paused(engine) as p:` holds the engine thread still inside a one-token request
    (prompt "\\n", one page), so the block sees a consistent scheduler and whatever it
    starts reaches the engine's inbox together. On exit the request finishes."""

    PROMPT = [30]

    def __init__(self, engine: Engine):
        self.engine = engine
        self.gate = Gate(at=1)

    def __enter__(self) -> "Paused":
        request = GenerationRequest(self.PROMPT, max_tokens=1, speculative=False)
        self.seq_id = self.engine.start(request, self.gate)
        self.gate.wait_reached()
        self.seq = self.engine.scheduler.sequences[self.seq_id]
        return self

    def __exit__(self, *exc) -> None:
        self.gate.release()
        result = self.gate.wait()
        assert result.tokens == [target(self.PROMPT)] and result.finish_reason == "length"

    def assert_only_this_runs(self) -> None:
        """Nothing else holds a slot, a queue place or a page: every page other than this
        request's one is free or evictable with refcount 0."""
        s = self.engine.scheduler
        assert list(s.sequences) == [self.seq_id]
        assert s.running == [self.seq] and not s.waiting
        assert [st.seq_id for st in s.slot_stats() if st.busy] == [self.seq_id]
        pages = s.pages
        assert len(self.seq.pages) == 1 and pages.refcount(self.seq.pages[0]) == 1
        assert all(pages.refcount(p) == 0 for p in range(1, pages.num_pages)
                   if p != self.seq.pages[0])
        assert pages.free_count + len(pages.evictable) == pages.num_pages - 2
        s.check_invariants()
