"""The encoder: texts (token ids) of an embedding or ranking model -> vectors or scores.

A text runs whole in one step of the paged forward (runner.py), as one sequence in a slot of
its own; a step packs as many texts as fit its rows (`step_tokens`) and slots. The forward
returns every row's hidden state (an encoder's last block, a decoder's final norm); the
text's vector is pooled from its own rows on the host: the mean of its rows, its first
(cls) or last row, or every row (pooling none). A ranking model pools (BERT: the first row,
a decoder: the last) and scores the row with its classifier head (`Head`).

Exactness: with the C++ kernels a row's hidden state does not depend on the step's other
rows or their number (docs/architecture.md, the determinism contract), and pooling and the head
run per text on the host, so a text's vector and score are the same bits alone or among 256
others (tests/test_embeddings.py).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kinetic import kernels
from kinetic.engine.runner import RESERVED_PAGE, Runner, RunnerConfig
from kinetic.memory import drop_code_pages
from kinetic.model.loader import LoadedModel
from kinetic.model.quants import dequantize


@dataclass(frozen=True)
class EncoderConfig:
    n_ctx: int                 # the longest text, in tokens
    step_tokens: int = 512     # rows of the largest step (a longer text runs alone, at n_ctx)
    texts_per_step: int = 64   # slots: texts one step holds
    page_size: int = 16
    kv_dtype: str = "float16"  # K and V as llama.cpp holds them (its cache, or the f16 cast
                               # of its flash attention when there is no cache)

    def __post_init__(self) -> None:
        if self.n_ctx < 1 or self.step_tokens < 1 or self.texts_per_step < 1:
            raise ValueError("the encoder needs a context, step rows and slots of at least 1")


class Head:
    """A ranking model's classifier on a pooled row x [D]: cls (+ bias, then tanh) where the
    file has it, then cls.output (+ bias); a decoder's scores go through softmax (the
    Qwen3-Reranker style: the "yes" and "no" logits), as llama.cpp scores them. Run by the C++
    kernel where it is built (the step's arithmetic), else on dequantized float32 weights."""

    def __init__(self, loaded: LoadedModel):
        f = loaded.file
        self.parts = []
        for name in ("cls", "cls.output"):
            raw = f.tensors.get(f"{name}.weight")
            if raw is None:
                continue
            bias = f.tensors.get(f"{name}.bias")
            self.parts.append((raw, None if bias is None else dequantize(bias).astype(np.float32),
                               name == "cls"))
        self.softmax = loaded.config.causal
        self._dense = {}

    def _matvec(self, raw, x: np.ndarray) -> np.ndarray:
        n, k = raw.shape
        if kernels.available():
            return kernels.qmatmul_host(int(raw.qtype), raw.data, n, k, x[None, :])[0]
        if raw.name not in self._dense:
            self._dense[raw.name] = dequantize(raw).astype(np.float32)
        return (self._dense[raw.name] @ x).astype(np.float32)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = np.asarray(x, np.float32)
        for raw, bias, squash in self.parts:
            y = self._matvec(raw, y)
            if bias is not None:
                y = y + bias
            if squash:
                y = np.tanh(y)
        if self.softmax:
            e = np.exp(y - y.max())
            y = e / e.sum()
        return y


class Encoder:
    """Runs texts through an embedding or ranking model (loaded.config.pooling). Thread-safe:
    one batch runs at a time."""

    def __init__(self, loaded: LoadedModel, config: EncoderConfig):
        cfg = loaded.config
        if not cfg.pooling:
            raise ValueError(f"{loaded.file.path} is a text model, not an embedding or "
                             f"ranking model (it has no {cfg.arch}.pooling_type)")
        self.loaded, self.config, self.pooling = loaded, config, cfg.pooling
        ps = config.page_size
        self.max_rows = max(config.step_tokens, config.n_ctx)
        pages = -(-self.max_rows // ps) + config.texts_per_step + 1   # a text wastes < 1 page
        self.runner = Runner(loaded, RunnerConfig(
            step_tokens=self.max_rows, num_slots=config.texts_per_step, page_size=ps,
            num_pages=pages, pages_per_slot=-(-config.n_ctx // ps), kv_dtype=config.kv_dtype))
        self.head = Head(loaded) if self.pooling == "rank" else None
        self._lock = threading.Lock()

    @property
    def n_ctx(self) -> int:
        return self.config.n_ctx

    def compile(self, progress=None) -> None:
        """Compile the step at every row bucket now (the first batch of each size would wait
        for it otherwise); jaxlib's code pages the compiles touched are unmapped after each
        (kinetic.memory.drop_code_pages, as Engine.compile does)."""
        buckets = self.runner.row_buckets
        with self._lock:
            drop_code_pages()
            for i, rows in enumerate(buckets):
                self._run([[0] * min(rows, self.n_ctx)] * -(-rows // self.n_ctx))
                drop_code_pages()
                if progress:
                    progress(i + 1, len(buckets))

    def hidden(self, texts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Every row's hidden state, per text: float32 [len(text), D]."""
        for i, t in enumerate(texts):
            if not 0 < len(t) <= self.n_ctx:
                raise ValueError(f"text {i} has {len(t)} tokens; a text takes 1 to "
                                 f"{self.n_ctx}")
        out: list[np.ndarray | None] = [None] * len(texts)
        with self._lock:
            for batch in self.batches(texts):
                for i, h in zip(batch, self._run([texts[i] for i in batch])):
                    out[i] = h
        return out

    def pooled(self, texts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Each text's vector as the model pools it (float32 [D], or [len, D] for pooling
        none), not normalized; for a ranking model, its head's outputs."""
        return [self._pool(h) for h in self.hidden(texts)]

    def scores(self, texts: Sequence[Sequence[int]]) -> list[float]:
        """A ranking model's score of each text (a query and document pair as rank_prompt
        lays it out): the head's first output."""
        if self.head is None:
            raise ValueError("the model does not rank (its pooling is "
                             f"{self.pooling!r}, not 'rank')")
        return [float(v[0]) for v in self.pooled(texts)]

    def _pool(self, h: np.ndarray) -> np.ndarray:
        kind = self.pooling
        if kind == "rank":
            return self.head(h[-1] if self.loaded.config.causal else h[0])
        if kind == "mean":
            return h.mean(axis=0, dtype=np.float32)
        if kind == "cls":
            return h[0].copy()
        if kind == "last":
            return h[-1].copy()
        return h   # none: every token's vector

    def batches(self, texts: Sequence[Sequence[int]]) -> list[list[int]]:
        """The texts' indices packed into steps: longest first, each into the first step with
        room in its rows (step_tokens) and slots (first-fit decreasing), so that few steps
        run, each nearly full. Which texts share a step changes no text's result. The texts
        of one batch, given alone in this order, pack into that one step again (the server
        runs a request a batch at a time: api/embeddings.py)."""
        steps: list[list[int]] = []
        rows: list[int] = []
        limit, slots = self.config.step_tokens, self.config.texts_per_step
        for i in sorted(range(len(texts)), key=lambda i: -len(texts[i])):
            n = len(texts[i])
            at = next((j for j, r in enumerate(rows)
                       if r + n <= limit and len(steps[j]) < slots), None)
            if at is None:
                steps.append([i])
                rows.append(n)
            else:
                steps[at].append(i)
                rows[at] += n
        return steps

    def _run(self, batch: list[Sequence[int]]) -> list[np.ndarray]:
        ps, S = self.config.page_size, self.config.texts_per_step
        P = self.runner.config.pages_per_slot
        table = np.full((S, P), RESERVED_PAGE, np.int32)
        tokens, positions, slots, where = [], [], [], []
        page = RESERVED_PAGE + 1
        for s, t in enumerate(batch):
            n = len(t)
            pages = np.arange(page, page + -(-n // ps))
            page += len(pages)
            table[s, :len(pages)] = pages
            pos = np.arange(n)
            tokens.append(np.asarray(t, np.int64))
            positions.append(pos)
            slots.append(np.full(n, s))
            where.append(pages[pos // ps] * ps + pos % ps)
        cat = np.concatenate
        out = self.runner.step_device(cat(tokens), cat(positions), cat(slots), cat(where), table)
        rows = np.asarray(out[:sum(len(t) for t in batch)])
        ends = np.cumsum([0] + [len(t) for t in batch])
        return [rows[a:b] for a, b in zip(ends[:-1], ends[1:])]


def normalize(v: np.ndarray, kind: int = 2) -> np.ndarray:
    """v scaled as llama.cpp's embd_normalize: -1 none, 0 max absolute value to 32760 (the
    int16 range), 1 taxicab, 2 Euclidean (the default), p > 2 the p-norm. Sums in float64; a
    zero vector stays zero."""
    v = np.asarray(v, np.float32)
    x = v.astype(np.float64)
    if kind < 0:
        return v.copy()
    if kind == 0:
        total = np.abs(x).max(initial=0.0) / 32760.0
    elif kind == 2:
        total = math.sqrt(float((x * x).sum()))
    else:
        total = float((np.abs(x) ** kind).sum()) ** (1.0 / kind)
    scale = np.float32(1.0 / total) if total > 0 else np.float32(0.0)
    return v * scale
