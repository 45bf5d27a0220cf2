"""The Python API of embedding and ranking models: what `kinetic.load` returns for them.

    import kinetic
    m = kinetic.load("all-MiniLM-L6-v2-f16.gguf")
    v = m.embed(["a cat", "a dog"])          # float32 [2, 384], each of length 1
    float(v[0] @ v[1])                       # cosine similarity
    r = kinetic.load("qwen3-reranker-0.6b-q8_0.gguf")
    r.rank("What is the capital of China?", ["Beijing is.", "Gravity pulls."])  # probabilities

The vectors and scores are the server's for the same texts (/v1/embeddings, /embedding,
/v1/rerank run these methods), and a text's are the same bits alone or in a batch.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from kinetic.engine.encoder import Encoder, EncoderConfig, normalize
from kinetic.model.loader import LoadedModel
from kinetic.text.tokenizer import Tokenizer

RERANK_TEMPLATE_KEY = "tokenizer.chat_template.rerank"

Input = str | Sequence[int]


class EmbeddingModel:
    """A loaded embedding (`kind` "embedding") or ranking ("rerank") model."""

    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, encoder: Encoder):
        self.loaded, self.tokenizer, self.encoder = loaded, tokenizer, encoder
        self.config = loaded.config
        self.kind = self.config.task
        self.pooling = self.config.pooling
        self.name = os.path.splitext(os.path.basename(loaded.file.path))[0]
        self.rerank_template: str | None = loaded.file.metadata.get(RERANK_TEMPLATE_KEY)

    @property
    def n_ctx(self) -> int:
        return self.encoder.n_ctx

    @property
    def dim(self) -> int:
        """Length of a vector (a ranking model: of its hidden state)."""
        return self.config.d_model

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def input_ids(self, item: Input) -> list[int]:
        """A text's token ids as llama-server tokenizes an embedding input (special tokens
        added and parsed), token ids as given, or, for a list mixing ids and texts, each text
        tokenized where it stands (special tokens added only to a text that starts it)."""
        if isinstance(item, str):
            return self.tokenize(item, add_special=True, parse_special=True)
        out: list[int] = []
        for i, part in enumerate(item):
            if isinstance(part, str):
                out += self.tokenize(part, add_special=i == 0, parse_special=True)
            else:
                out.append(int(part))
        return out

    def embed(self, inputs: Input | Sequence[Input], normalize_kind: int = 2) -> np.ndarray:
        """One pooled vector per input (a text or token ids; one input or a list): float32
        [n, dim], scaled as `normalize_kind` says (encoder.normalize: 2, Euclidean, by
        default; -1 leaves them as pooled). A model that does not pool (pooling none) has
        token_vectors instead."""
        if self.pooling == "none":
            raise ValueError("the model's pooling is none: it gives a vector per token "
                             "(token_vectors), not one per text")
        items = _as_list(inputs)
        vectors = self.encoder.pooled([self.input_ids(x) for x in items])
        return np.stack([normalize(v, normalize_kind) for v in vectors]) if vectors else \
            np.zeros((0, self.dim), np.float32)

    def token_vectors(self, inputs: Input | Sequence[Input],
                      normalize_kind: int = -1) -> list[np.ndarray]:
        """Every token's hidden state per input, float32 [tokens, dim], each row scaled as
        `normalize_kind` says (by default not at all, as llama-server's /embedding)."""
        items = _as_list(inputs)
        return [np.stack([normalize(r, normalize_kind) for r in h])
                for h in self.encoder.hidden([self.input_ids(x) for x in items])]

    def rank_prompt(self, query: str, document: str) -> list[int]:
        """The tokens a (query, document) pair is scored on, laid out as llama-server lays
        them out: the model's rerank template with {query} and {document} filled in, or
        else [BOS] query [EOS] [SEP] document [EOS], each special token where the vocabulary
        adds it (EOS falls back to SEP)."""
        tok = self.tokenizer
        if self.rerank_template is not None:
            text = self.rerank_template.replace("{query}", query).replace("{document}", document)
            return tok.encode(text, add_special=False, parse_special=True)
        eos = tok.eos_id if tok.eos_id is not None else tok.sep_id
        out = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
        out += tok.encode(query, add_special=False)
        if tok.add_eos and eos is not None:
            out.append(eos)
        if tok.add_sep and tok.sep_id is not None:
            out.append(tok.sep_id)
        out += tok.encode(document, add_special=False)
        if tok.add_eos and eos is not None:
            out.append(eos)
        return out

    def rank(self, query: str, documents: Sequence[str]) -> list[float]:
        """Each document's relevance to the query, in the documents' order: the model's
        score (a probability for the Qwen3-Reranker style; a BERT cross-encoder's head
        output as it is)."""
        return self.encoder.scores([self.rank_prompt(query, d) for d in documents])

    def close(self) -> None:
        """Nothing runs in the background; here for symmetry with kinetic.llm.Model."""


def _as_list(inputs: Input | Sequence[Input]) -> list[Input]:
    if isinstance(inputs, str):
        return [inputs]
    items = list(inputs)
    if items and all(isinstance(t, (int, np.integer)) for t in items):
        return [items]   # one list of token ids
    return items


def load_embedding_model(loaded: LoadedModel, tokenizer: Tokenizer, n_ctx: int,
                         compile: bool = False, progress=None) -> EmbeddingModel:
    """The EmbeddingModel of a loaded embedding or ranking model, its context n_ctx (capped
    by the model's own; 0: the model's)."""
    ctx = loaded.config.context_length
    n_ctx = min(n_ctx, ctx) if n_ctx > 0 else ctx
    encoder = Encoder(loaded, EncoderConfig(n_ctx=n_ctx))
    if compile:
        encoder.compile(progress)
    return EmbeddingModel(loaded, tokenizer, encoder)
