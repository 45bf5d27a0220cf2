"""The Python API for notebooks and scripts: `kinetic.load(path) -> Model`.

    import kinetic
    m = kinetic.load("SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = m.tokenize("The capital of France is")
    logits = m.logits(ids)                      # [len(ids), vocab] float32
    for piece in m.generate([{"role": "user", "content": "Hi!"}], max_tokens=32):
        print(piece, end="")
    person = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    text = "".join(m.generate("A person as JSON:", json_schema=person))   # always parses

Everything runs through the model's engine (kinetic/engine), so the tokens and
log-probabilities here are the ones the server gives for the same request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from kinetic import compile_cache as _compile_cache
from kinetic.engine import hosts
from kinetic.engine.engine import Engine
from kinetic.memory import drop_staging_caches
from kinetic.engine.engine_config import CACHE_TYPES, EngineConfig, Split
from kinetic.engine.request import Delta, GenerationRequest, ImageRows
from kinetic.engine.sampling_params import SamplingParams
from kinetic.grammar import Grammar, compile_gbnf, compile_json_schema
from kinetic.model.loader import LoadedModel, load_model
from kinetic.text.chat_messages import MEDIA_MARKER
from kinetic.text.chat_template import ChatTemplate
from kinetic.text.tokenizer import Tokenizer
from kinetic.text.vocab import VOCAB_ONLY_KEYS

if TYPE_CHECKING:
    from kinetic.embedding import EmbeddingModel
    from kinetic.receipts import Signer

Messages = list[dict[str, Any]]


class Model:
    """A loaded GGUF model with its tokenizer, chat template and one compiled step."""

    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, engine: Engine,
                 projector=None):
        self.loaded, self.tokenizer, self.engine = loaded, tokenizer, engine
        self.projector = projector   # kinetic.vision.projector.Projector (--mmproj) or None
        self._pieces = None          # its PieceCache, made on first use
        self.config = loaded.config
        self.chat_template = ChatTemplate.from_metadata(loaded.file.metadata)
        # the template as given (the file's, or use_chat_template's), before kinetic's patches
        self.template_text = (loaded.file.metadata.get("tokenizer.chat_template")
                              or self.chat_template.source)
        self.name = os.path.splitext(os.path.basename(loaded.file.path))[0]
        self.default_params = SamplingParams.from_gguf_defaults(loaded.file.metadata)

    @property
    def n_ctx(self) -> int:
        return self.engine.max_context

    def use_chat_template(self, source: str) -> None:
        """Render conversations with this Jinja template (or "chatml") instead of the file's
        own, keeping the file's BOS and EOS texts."""
        t = self.chat_template
        self.template_text = source
        self.chat_template = ChatTemplate(source, t.bos_token, t.eos_token, add_bos=t.add_bos,
                                          add_eos=t.add_eos)

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def text_tokens(self, text: str) -> list[int]:
        """The token ids of plain text: no BOS, special tokens' text left as text."""
        return self.tokenizer.encode(text, add_special=False, parse_special=False)

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

    def logits(self, token_ids: list[int], images: tuple[ImageRows, ...] = ()) -> np.ndarray:
        """Next-token logits at every position: float32 [len(token_ids), vocab], computed by
        the engine's own steps (so they are the logits generation samples from). images:
        rows of token_ids that are image embeddings (image_prompt)."""
        return self.engine.score(list(token_ids), tuple(images))

    def image_prompt(self, text: str, images: list, marker: str = MEDIA_MARKER):
        """(token ids, image rows) of a prompt `text` in which each `marker` stands for one of
        `images` (kinetic.vision.images.Image, or PNG / JPEG bytes), laid out as llama.cpp's
        mtmd does for this model's projector (needs --mmproj / load(mmproj=...)). Pass both
        to `stream(ids, images=rows)` or `logits(ids, rows)`. (`generate` and `stream` also
        take messages with image_url parts, as the server does.)"""
        from kinetic.vision.images import from_bytes
        from kinetic.vision.prompt import PieceCache, image_prompt
        if self.projector is None:
            raise ValueError("this model has no vision projector (load it with mmproj=...)")
        if self._pieces is None:
            self._pieces = PieceCache(self.projector)
        decoded = [from_bytes(i) if isinstance(i, (bytes, bytearray)) else i for i in images]
        return image_prompt(self.tokenizer, self._pieces, text, decoded, marker)

    def generate(self, prompt: str | Messages, max_tokens: int = 256, temperature: float = 0.0,
                 seed: int | None = None, *, grammar: str | Grammar | None = None,
                 json_schema: dict | bool | None = None,
                 **template_kwargs: Any) -> Iterator[str]:
        """Yield the continuation's text pieces (never a split UTF-8 character) until an
        end-of-generation token, max_tokens, or the end of the context. temperature 0 is
        greedy; otherwise draws are keyed by (seed, position) and so repeatable. `grammar`
        (GBNF text or a compiled Grammar) or `json_schema` (True: any JSON) holds the text to
        that shape; GrammarError / UnsupportedSchema (ValueErrors) say why one cannot be used."""
        for delta in self.stream(prompt, max_tokens=max_tokens, temperature=temperature,
                                 seed=seed, grammar=grammar, json_schema=json_schema,
                                 **template_kwargs):
            if delta.text:
                yield delta.text

    def stream(self, prompt: str | Messages | list[int], max_tokens: int | None = 256,
               temperature: float = 0.0, seed: int | None = None, *,
               params: SamplingParams | None = None, stop: tuple[str, ...] = (),
               logprobs: int | None = None, grammar: str | Grammar | None = None,
               json_schema: dict | bool | None = None, images: tuple[ImageRows, ...] = (),
               **template_kwargs: Any) -> Iterator[Delta]:
        """The engine's deltas (token ids, text, log-probabilities, then the finish reason
        and usage) for a prompt given as text, messages or token ids. `params` replaces
        temperature and seed with a full SamplingParams (kinetic/engine/sampling_params);
        `grammar` and `json_schema` as in `generate`; `images` with token ids (image_prompt)."""
        request = self._request(prompt, max_tokens, temperature, seed, params, stop, logprobs,
                                grammar, json_schema, template_kwargs)
        if images:
            request = dataclasses.replace(request, images=tuple(images))
        yield from self.engine.generate(request)

    def receipt(self, prompt: str | Messages | list[int], max_tokens: int | None = 256,
                temperature: float = 0.0, seed: int | None = None, *,
                params: SamplingParams | None = None, stop: tuple[str, ...] = (),
                grammar: str | Grammar | None = None, json_schema: dict | bool | None = None,
                sign_key: "str | os.PathLike[str] | Signer | None" = None,
                **template_kwargs: Any) -> dict:
        """Generate as `stream` does and return the answer's receipt (kinetic/receipts):
        the request as the engine ran it (a fresh seed is recorded when none is given), the
        output's token ids, text and finish reason, the model file's hash and the engine's
        settings; signed with `sign_key` (a PEM Ed25519 key file or a receipts.Signer).
        `kinetic.verify_receipt(receipt, model=self)` checks it. Raises RuntimeError if the
        engine fails."""
        from kinetic.receipts import ReceiptMaker, Signer, load_signing_key
        request = self._request(prompt, max_tokens, temperature, seed, params, stop, None,
                                grammar, json_schema, template_kwargs)
        signer = (sign_key if isinstance(sign_key, Signer) or sign_key is None
                  else load_signing_key(sign_key))
        maker = ReceiptMaker(self.engine, request, signer, self.loaded.file.path)
        for delta in self.engine.generate(request):
            if delta.error:
                raise RuntimeError(delta.error)
            maker.feed(delta)
        return maker.receipt()

    def _request(self, prompt, max_tokens, temperature, seed, params, stop, logprobs, grammar,
                 json_schema, template_kwargs) -> GenerationRequest:
        images = () if _is_ids(prompt) or isinstance(prompt, str) else _image_parts(prompt)
        if images:   # messages with image_url parts (data URLs), as the server takes them
            text = self.apply_chat_template(prompt, **template_kwargs)
            ids, rows = self.image_prompt(text, list(images))
        else:
            ids = prompt if _is_ids(prompt) else self.prompt_ids(prompt, **template_kwargs)
            rows = ()
        if params is None:
            params = dataclasses.replace(self.default_params, temperature=temperature, seed=seed)
        if isinstance(grammar, str):
            grammar = compile_gbnf(grammar)
        if json_schema is not None:
            if grammar is not None:
                raise ValueError("give grammar or json_schema, not both")
            grammar = compile_json_schema(json_schema)
        return GenerationRequest([int(t) for t in ids], params, max_tokens, tuple(stop),
                                 logprobs, grammar=grammar, images=rows)

    def close(self) -> None:
        """Stop the engine thread."""
        self.engine.close()


def _image_parts(messages: Messages) -> list:
    """The images of the messages' image_url parts (base64 data URLs of PNG or JPEG), in
    order; kinetic.vision.images.ImageError for one that cannot be read."""
    from kinetic.vision.images import from_data_url
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = part.get("image_url")
                out.append(from_data_url(url.get("url") if isinstance(url, dict) else url))
    return out


def _is_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(t, (int, np.integer)) for t in prompt)


def load(path: str | os.PathLike[str], *, n_ctx: int = 4096, dtype: str = "bfloat16",
         parallel: int = 1, step_tokens: int = 0, page_size: int = 16,
         speculative: bool = True, draft: str | os.PathLike[str] | None = None,
         llama_rounding: bool = True, kernel: str = "auto",
         progress: Callable[[int, int], None] | None = None,
         mmproj: str | os.PathLike[str] | None = None,
         cache_type: str = "f16", swa_full: bool = False,
         compile_cache: bool | None = None,
         split: Split | None = None) -> "Model | EmbeddingModel":
    """Load a GGUF model for use from Python: a Model for a text model, an
    kinetic.embedding.EmbeddingModel for an embedding or ranking model (one whose file has a
    pooling type; n_ctx, kernel and progress apply to it, the rest is for generation).

    n_ctx: context length per sequence (capped by the model's own); kernel: "ffi" (the
    weights stay in their GGUF blocks, multiplied by kinetic's C++ kernel: the default on
    CPU), "pallas" (the weights quantized on the device, multiplied by Pallas kernels: the
    default on a GPU; interpreted on a CPU, exact but slow), "xla" (dequantized at load,
    multiplied by XLA) or "auto"; dtype and
    llama_rounding apply to the "xla" kernel only: the projections' compute type
    ("bfloat16" or "float32") and whether activations are rounded as llama.cpp's CPU
    backend does (docs/parity.md); parallel: sequences the engine runs at once (0: as many
    as half the free memory holds, up to 4; at most 64); step_tokens: most rows per step
    (0: 16, past 8 streams 4 x parallel up to 64 rows and 2 x parallel beyond, 128 for a
    mixture of experts; at least parallel);
    speculative: drafting in the step's spare rows (never changes the output); draft: a
    smaller GGUF model of the same vocabulary to draft with (else n-gram lookup); mmproj:
    a vision projector (llama.cpp's mmproj GGUF) for this text model: prompts with images
    (Model.image_prompt); cache_type: the KV cache's type by llama-server's name (-ctk):
    "f16" (the default, as llama.cpp's), "f32", "bf16" or "q8_0" (docs/server.md);
    swa_full: keep the sliding-window layers' rows past their window (llama-server's
    --swa-full; by default the C++ kernel hands their memory back: kinetic/engine/
    sliding_window.py); compile_cache: keep compiled executables on disk and load them on a
    later start (kinetic/compile_cache.py; None: on unless KINETIC_COMPILE_CACHE=0);
    split: the model split over several devices, Split("row", N) (kinetic/engine/split.py:
    the same bits at any N). Raises a ValueError subclass naming the problem for a file that
    cannot be used.
    """
    if compile_cache is not None:
        _compile_cache.set_enabled(compile_cache)
    if cache_type not in CACHE_TYPES:
        raise ValueError(f"cache_type {cache_type!r}: one of {', '.join(CACHE_TYPES)}")
    config = EngineConfig(parallel=parallel, n_ctx=n_ctx, step_tokens=step_tokens,
                          page_size=page_size, speculative=speculative,
                          kv_dtype=CACHE_TYPES[cache_type], swa_full=swa_full,
                          split=split or Split())
    return open_model(path, config, dtype=dtype, draft=draft, llama_rounding=llama_rounding,
                      kernel=kernel, stage=lambda label: progress if label == "loading" else None,
                      mmproj=mmproj)


Stage = Callable[[str], "Callable[[int, int], None] | None"]
EMBEDDING_POOLINGS = ("none", "mean", "cls", "last")


def open_model(path: str | os.PathLike[str], config: EngineConfig, *, dtype: str = "bfloat16",
               draft: str | os.PathLike[str] | None = None, llama_rounding: bool = True,
               kernel: str = "auto", stage: Stage | None = None,
               compile: bool = False, pooling: str | None = None,
               mmproj: str | os.PathLike[str] | None = None) -> "Model | EmbeddingModel":
    """A GGUF file ready to run, the one set-up of `load` and `kinetic serve`: the file read,
    its tokenizer, then an Engine over `config` for a text model (with `draft` for
    speculative decoding) or an Encoder for an embedding or ranking model. compile: every
    step shape compiled now, so that no request waits for XLA. stage(label) gives the
    progress callback of one stage ("loading", "loading the draft model", "compiling",
    "compiling the draft model"), or None. pooling: an embedding model's pooling instead of
    the file's ("none", "mean", "cls" or "last"; llama-server's --pooling). mmproj: a
    vision projector for the text model (--mmproj), checked against it."""
    stage = stage or (lambda label: None)
    _compile_cache.configure()
    loaded = load_model(os.fspath(path), dtype=dtype, act_quant=llama_rounding,
                        progress=stage("loading"), kernel=kernel, defer_repack=True)
    # what the executables depend on: those the last compile of the same set used load in
    # threads meanwhile (compile_cache.preloading)
    key = repr((loaded.config, config, dtype, kernel, llama_rounding, pooling,
                None if draft is None else os.fspath(draft),
                None if mmproj is None else os.fspath(mmproj)))
    with _compile_cache.preloading(key) if compile else contextlib.nullcontext():
        return _assemble(loaded, os.fspath(path), config, dtype=dtype, draft=draft,
                         llama_rounding=llama_rounding, kernel=kernel, stage=stage,
                         compile=compile, pooling=pooling, mmproj=mmproj)


def _assemble(loaded, path: str, config: EngineConfig, *, dtype, draft, llama_rounding,
              kernel, stage, compile, pooling, mmproj) -> "Model | EmbeddingModel":
    """open_model's part after the file is read."""
    tokenizer = Tokenizer.from_metadata(loaded.file.metadata)
    # the arrays only the vocabulary reads go before the steps compile, whose peak they would
    # add to (Llama 3's merges: 25 MB of str); /api/show reads them from the file again
    loaded.file.drop(VOCAB_ONLY_KEYS)
    if pooling is not None and pooling != loaded.config.pooling:
        if loaded.config.task != "embedding" or pooling not in EMBEDDING_POOLINGS:
            raise ValueError(f"pooling {pooling!r}: {os.fspath(path)} is "
                             f"{'a text' if loaded.config.task == 'text' else 'a ranking'} "
                             f"model; another pooling is for embedding models (none, mean, "
                             f"cls, last)")
        loaded.config = dataclasses.replace(loaded.config, pooling=pooling)
    if loaded.config.task != "text" and hosts.joined():
        raise ValueError(f"{os.fspath(path)} is an {loaded.config.task} model; only text "
                         f"models are served across processes yet")
    if loaded.config.task != "text" and config.split.active:
        raise ValueError(f"{os.fspath(path)} is an {loaded.config.task} model, which runs on "
                         f"one device; --split-mode / --tensor-split are for text models")
    if loaded.config.task != "text":
        from kinetic.embedding import load_embedding_model
        if draft is not None:
            raise ValueError(f"a draft model is for text models; {os.fspath(path)} is an "
                             f"{loaded.config.task} model")
        return load_embedding_model(loaded, tokenizer, config.n_ctx, compile=compile,
                                    progress=stage("compiling") if compile else None)
    draft_model = None if draft is None else load_model(
        os.fspath(draft), dtype=dtype, act_quant=llama_rounding, kernel=kernel,
        progress=stage("loading the draft model"), defer_repack=True)
    if draft_model is not None:
        draft_model.file.drop(VOCAB_ONLY_KEYS)   # it has no tokenizer of its own
    projector = None
    if mmproj is not None:
        from kinetic.vision.projector import load_projector
        if loaded.config.task != "text":
            raise ValueError("a vision projector (--mmproj) is for text models")
        projector = load_projector(os.fspath(mmproj))
        if projector.n_embd != loaded.config.d_model:
            raise ValueError(f"{os.fspath(mmproj)} projects to width {projector.n_embd}; the "
                             f"text model's is {loaded.config.d_model}: not its projector")
        if projector.non_causal and loaded.config.arch != "gemma3":
            raise ValueError(f"{os.fspath(mmproj)}: {projector.family} images attend to "
                             f"themselves both ways, which kinetic does for Gemma 3's text "
                             f"model only, not {loaded.config.arch}")
        if projector.non_causal and not config.step_tokens:
            # an image whose rows see each other is computed in one step: the automatic step
            # size grows to hold one (an explicit -ub smaller than that refuses images)
            c = projector.cfg
            rows = (c.image_size // c.patch_size // c.scale_factor) ** 2
            config = dataclasses.replace(config, step_tokens=max(rows, 16, 2 * config.parallel))
    engine = Engine(loaded, tokenizer, config, draft=draft_model, images=projector is not None)
    if compile:
        engine.compile(progress=stage("compiling"))
        if engine.drafter is not None:
            engine.drafter.runner.compile(progress=stage("compiling the draft model"))
            drop_staging_caches()
            engine.drafter.runner.model.finish_repack()   # as Engine.compile does its own
    return Model(loaded, tokenizer, engine, projector)
