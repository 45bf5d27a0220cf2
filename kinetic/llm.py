"""The Python API for notebooks and scripts: `kinetic.load(path) -> Model`.

    import kinetic
    m = kinetic.load("SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = m.tokenize("The capital of France is")
    logits = m.logits(ids)                      # [len(ids), vocab] float32
    for piece in m.generate([{"role": "user", "content": "Hi!"}], max_tokens=32):
        print(piece, end="")

`generate` drives one sequence through the same fixed-shape step the engine uses, so its
tokens and log-probabilities are the ones the server gives for the same request.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterator

import numpy as np

from kinetic.engine.runner import Runner, RunnerConfig
from kinetic.model.loader import LoadedModel, load_model
from kinetic.text.chat_template import ChatTemplate
from kinetic.text.decoder import IncrementalDecoder
from kinetic.text.tokenizer import Tokenizer
from kinetic.engine.sampling import sample_token

Messages = list[dict[str, Any]]


class ContextFullError(ValueError):
    """The tokens do not fit the context this model was loaded with."""


class Model:
    """A loaded GGUF model with its tokenizer, chat template and one compiled step."""

    def __init__(self, loaded: LoadedModel, runner: Runner):
        self.loaded, self.runner = loaded, runner
        self.config = loaded.config
        self.tokenizer = Tokenizer.from_metadata(loaded.file.metadata)
        self.chat_template = ChatTemplate.from_metadata(loaded.file.metadata)
        self.name = os.path.splitext(os.path.basename(loaded.file.path))[0]

    @property
    def n_ctx(self) -> int:
        return self.runner.config.max_context

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def apply_chat_template(self, messages: Messages, tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The conversation rendered by the model's own template (kwargs are
        chat_template_kwargs, e.g. enable_thinking=False)."""
        return self.chat_template.render(messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **kwargs)

    def prompt_ids(self, prompt: str | Messages, **template_kwargs: Any) -> list[int]:
        """Token ids of a plain prompt (with BOS where the model wants it) or of a
        conversation rendered through the chat template, as llama-server tokenizes them."""
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_special=True, parse_special=True)
        text = self.apply_chat_template(prompt, **template_kwargs)
        return self.tokenize(text, add_special=True, parse_special=True)

    def logits(self, token_ids: list[int]) -> np.ndarray:
        """Next-token logits at every position: float32 [len(token_ids), vocab]."""
        seq = _Sequence(self.runner)
        return seq.feed(list(token_ids))

    def generate(self, prompt: str | Messages, max_tokens: int = 256, temperature: float = 0.0,
                 seed: int | None = None, **template_kwargs: Any) -> Iterator[str]:
        """Yield the continuation's text pieces (never a split UTF-8 character) until an
        end-of-generation token, max_tokens, or the end of the context. temperature 0 is
        greedy; otherwise draws are keyed by (seed, position) and so repeatable."""
        for piece, _ in self.generate_tokens(prompt, max_tokens, temperature, seed,
                                             **template_kwargs):
            if piece:
                yield piece

    def generate_tokens(self, prompt: str | Messages, max_tokens: int = 256,
                        temperature: float = 0.0, seed: int | None = None,
                        **template_kwargs: Any) -> Iterator[tuple[str, int]]:
        """Like generate, yielding (text piece, token id) per generated token."""
        yield from self.generate_from_ids(self.prompt_ids(prompt, **template_kwargs),
                                          max_tokens, temperature, seed)

    def generate_from_ids(self, ids: list[int], max_tokens: int = 256,
                          temperature: float = 0.0,
                          seed: int | None = None) -> Iterator[tuple[str, int]]:
        """(text piece, token id) per generated token after the prompt `ids`; the
        end-of-generation token itself is not yielded."""
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        seq = _Sequence(self.runner)
        decoder = IncrementalDecoder(self.tokenizer)
        logits = seq.feed(list(ids))[-1]
        for _ in range(max_tokens):
            token = sample_token(logits, temperature, seed, seq.length)
            if token in self.tokenizer.eog_ids:
                break
            yield decoder.add(token), token
            if seq.length >= self.n_ctx:
                break
            logits = seq.feed([token])[-1]
        tail = decoder.flush()
        if tail:
            yield tail, -1


class _Sequence:
    """One sequence in slot 0 of a runner, fed in step-sized chunks."""

    def __init__(self, runner: Runner):
        self.runner = runner
        cfg = runner.config
        self.page_table = np.arange(1, cfg.pages_per_slot + 1, dtype=np.int32)[None, :]
        self.length = 0

    def feed(self, tokens: list[int]) -> np.ndarray:
        cfg = self.runner.config
        if self.length + len(tokens) > cfg.max_context:
            raise ContextFullError(f"{self.length + len(tokens)} tokens do not fit the context "
                                   f"of {cfg.max_context}")
        out = []
        for i in range(0, len(tokens), cfg.step_tokens):
            chunk = np.asarray(tokens[i:i + cfg.step_tokens], dtype=np.int32)
            pos = np.arange(self.length, self.length + len(chunk), dtype=np.int32)
            write = self.page_table[0, pos // cfg.page_size] * cfg.page_size + pos % cfg.page_size
            out.append(self.runner.step(chunk, pos, np.zeros_like(chunk), write, self.page_table))
            self.length += len(chunk)
        return np.concatenate(out) if out else np.zeros((0, self.runner.model.config.vocab_size),
                                                        np.float32)


def load(path: str | os.PathLike[str], *, n_ctx: int = 4096, dtype: str = "bfloat16",
         step_tokens: int = 16, page_size: int = 16, llama_rounding: bool = True,
         progress: Callable[[int, int], None] | None = None) -> Model:
    """Load a GGUF model for use from Python.

    n_ctx: context length (capped by the model's own); dtype: the projection weights'
    compute type ("bfloat16" or "float32"); step_tokens: rows per compiled step;
    llama_rounding: round activations as llama.cpp's CPU backend does (docs/parity.md).
    Raises a ValueError subclass naming the problem for a file that cannot be used.
    """
    loaded = load_model(os.fspath(path), dtype=dtype, act_quant=llama_rounding,
                        progress=progress)
    n_ctx = max(page_size, min(n_ctx, loaded.config.context_length))
    pages = math.ceil(n_ctx / page_size)
    runner = Runner(loaded, RunnerConfig(step_tokens=step_tokens, num_slots=1,
                                         page_size=page_size, num_pages=pages + 1,
                                         pages_per_slot=pages))
    return Model(loaded, runner)
