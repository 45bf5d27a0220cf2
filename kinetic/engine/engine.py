"""The engine: one thread that owns the device and runs the step loop.

    start(request, sink) -> id; sink(Delta) on the engine thread   (the server: api/core.py)
    generate(request) -> iterator of Delta                          (notebooks, tests)

One turn of the loop: take new requests and cancellations from the inbox; propose n-gram
drafts for sequences that are caught up; `Scheduler.schedule` packs decode rows, draft rows
and prompt chunks of any sequences into one step; the runner computes the step's logits at
its row bucket; the rows whose next token is wanted are sampled together (one jitted sampler
call at the bucket of their count, every row keyed by its own (seed, position)); drafts are accepted
while they equal the samples; each request's new tokens go through end-of-generation,
stop-string and UTF-8 handling and out to its sink; `Scheduler.complete` advances the
sequences and frees the pages of finished ones at once.

Requests with a grammar: drafts are cut where the grammar rejects them; each sampled row gets
its token bitmask from the request's matcher (advanced through the row's draft tokens, then
rolled back), computed after the step is dispatched, so on the host while the device runs it;
the tokens kept advance the matcher (Job.take). Every piece of that grammar work runs under
MASK_BUDGET_SECONDS (kinetic.grammar.mask_budget): a request whose grammar overruns it fails
alone, with a 503-class error, and the step goes on for the others, so whatever grammar a
client sends, the engine thread's time per step stays bounded. `prepare_grammar` builds a
grammar's start state and first mask under the same budget on the caller's thread, before the
request reaches the engine (the server runs it in a worker thread, refusing with 400).

Prefills (`start_prefill`, /v1/prefill): token ids run into the prefix cache and nothing else,
at the lowest priority (the scheduler's "Prefills"): no sampling and no output, a slot only
while no request waits for one, the rows real requests leave. A request arriving ends every
prefill before the next step is planned, so it waits for no more than the step in flight;
each prefill's sink then gets a `Prefilled` saying how much of it is cached. While a prefill
wants rows, steps run one at a time (no several decode steps per call), so it advances.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from kinetic.engine import sampler
from kinetic.engine.draft_model import DraftModel
from kinetic.engine.engine_config import EngineConfig
from kinetic.engine.host_cache import HostPageStore
from kinetic.engine.job import Job
from kinetic.engine.recurrent_state import StateSnapshots
from kinetic.engine.request import Delta, GenerationRequest, MAX_LOGPROBS
from kinetic.engine.runner import Runner, RunnerConfig
from kinetic.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams, history_rows
from kinetic.engine.scheduler import (ContextOverflow, Prefilled, Scheduler, SchedulerConfig,
                                      Sequence)
from kinetic.engine.speculative import accept, ngram_draft
from kinetic.grammar import (Grammar, GrammarTooCostly, MaskBudgetExceeded, Matcher, TokenVocab,
                             mask_budget)
from kinetic.kernels import ffi as native
from kinetic.memory import compiling, release_memory
from kinetic.model.loader import LoadedModel
from kinetic.text.tokenizer import Tokenizer

STATE_SNAPSHOTS_PER_SLOT = 4   # recurrent models: prefix states kept (StateSnapshots)
HISTORY_WIDTH = 4096  # the penalties' window holds at most the last this many tokens
# (token id, bias) pairs per sampled row: a request's logit_bias names at most MAX_LOGIT_BIAS
# distinct tokens (SamplingParams refuses more) and ignore_eos adds the eog ids; an engine
# whose tokenizer has more than 64 eog ids widens it to hold them all (Engine._bias_width)
BIAS_WIDTH = MAX_LOGIT_BIAS + 64
# most rows one call of sampler.sample takes; more sample in chunks of it (a row's draw does
# not depend on the rows beside it). Chunks of 4 cost less per row than one call over 16 or
# 32 rows on CPU, and each compiled size of the sampler holds tens of MB (docs/performance.md)
SAMPLE_CHUNK = 4
# DRY (token id, penalty) pairs per sampled row. A row's penalised tokens are the distinct ones
# that followed an earlier occurrence of its last dry_allowed_length tokens (sampling_params.
# dry_pairs): a handful in ordinary text, but up to every distinct token of the DRY window
# (allowed_length 0, a crafted prompt), so no width short of min(V, window) always holds them.
# A row with more than this travels whole in the dense spill (Engine._dry), in the same
# compiled shape; the bits are the same either way.
DRY_WIDTH = 256
# The most one request's grammar work may take in one turn, its draft check, masks and accepted
# tokens together (Engine._grammar_work). Masks of real schemas take 0.2 ms typically and at most 0.2-0.4 s
# on a busy 2-core machine (docs/performance.md); a grammar past this is a hostile one.
MASK_BUDGET_SECONDS = 1.0
COUNTERS = ("requests", "prompt_tokens", "prompt_tokens_cached", "prompt_seconds",
            "tokens_predicted", "tokens_predicted_seconds", "draft_tokens", "draft_accepted",
            "steps", "pages_to_host", "pages_from_host", "decode_step_calls",
            "prefills", "prefill_tokens", "prefill_seconds")


@dataclass(frozen=True)
class EngineStats:
    slots: list            # scheduler.SlotStats per slot
    queue_length: int
    requests_processing: int


class Engine:
    """Batched generation over one model. Thread-safe: start/generate/cancel from anywhere."""

    def __init__(self, model: LoadedModel, tokenizer: Tokenizer, config: EngineConfig,
                 draft: LoadedModel | None = None, images: bool = False):
        """draft: a smaller model of the same vocabulary that proposes speculative drafts
        (otherwise n-gram lookup does, when config.speculative). images: requests may give
        prompt rows as embeddings (GenerationRequest.images: a vision projector's)."""
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config.resolved(model.config)
        runner_config = RunnerConfig(
            step_tokens=config.step_tokens, num_slots=config.parallel,
            page_size=config.page_size, num_pages=config.num_pages,
            pages_per_slot=config.pages_per_slot, kv_dtype=config.kv_dtype,
            decode_steps=config.decode_steps if draft is None else 1,
            # a recurrent model keeps each draft row's inputs until it is verified; the
            # placeholders of decode steps are verified as drafts when pages run short
            max_draft=max(config.max_draft if config.speculative else 0,
                          config.decode_steps - 1), image_rows=images)
        self.runner = Runner(model, runner_config)
        self.drafter = DraftModel(draft, model, runner_config) if draft is not None else None
        self.host_pages = HostPageStore(config.host_cache_mb << 20)
        self.scheduler = Scheduler(SchedulerConfig.from_runner(
            self.runner.config, chunk_tokens=config.chunk_tokens))
        if config.host_cache_mb > 0:
            self.scheduler.host = self.host_pages
        self.scheduler.keep_partial = self.drafter is None
        # the runners with recurrent layers (the target's, the draft model's): each keeps its
        # slots' states, and a snapshot of the prefix for each (_save_states)
        self._stateful = [r for r in (self.runner, self.drafter and self.drafter.runner)
                          if r is not None and r.state is not None]
        if self._stateful:
            self.scheduler.snapshots = StateSnapshots(STATE_SNAPSHOTS_PER_SLOT * config.parallel)
        self.vocab_size = model.config.vocab_size
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._jobs: dict[int, Job] = {}
        self._prefills: dict[int, Callable[[Prefilled], None]] = {}   # prefill id -> its sink
        self._over_budget: set[int] = set()   # this turn's requests whose grammar overran
        self._grammar_spent: dict[int, float] = {}   # this turn's grammar seconds per request
        self._scored: dict[int, np.ndarray] = {}  # all-logits jobs: [len(prompt), V]
        self._ids = itertools.count(1)
        self._stop = False
        self._dead: str | None = None  # set if the engine thread failed
        self._turn_started: float | None = None  # time.monotonic() of the running turn
        self._counters = dict.fromkeys(COUNTERS, 0.0)
        # Sampling runs at the smallest sampler bucket (sample_buckets) that holds a step's
        # sampled rows (the sampler gives a row the same bits at any batch size:
        # tests/test_invariance.py); the inputs shared by rows without a mask, a bias or
        # penalties are made once per bucket (by compile, or on first use)
        self._full_masks: dict[int, jax.Array] = {}
        self._zero_biases: dict[int, sampler.Sparse] = {}
        self._zero_dries: dict[int, sampler.Sparse] = {}
        self._post_sampling_lock = threading.Lock()
        self._post_sampling_ready = False
        self._no_histories: dict[int, jax.Array] = {}
        self._last_bias: tuple | None = None   # (T, the jobs' bias pairs, their device Sparse)
        self._vocab: TokenVocab | None = None   # the token trie, built for the first grammar
        self._vocab_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="kinetic-engine", daemon=True)
        self._thread.start()

    # --- the outside ----------------------------------------------------------------------

    @property
    def max_context(self) -> int:
        return self.runner.config.max_context

    def grammar_vocab(self) -> TokenVocab:
        """The tokenizer's trie for grammar masks (control tokens as their text), built once
        (about a second for a 150k vocabulary: the server builds it while it starts)."""
        with self._vocab_lock:
            if self._vocab is None:
                self._vocab = TokenVocab.from_tokenizer(self.tokenizer, special=True)
            return self._vocab

    def prepare_grammar(self, grammar: Grammar) -> None:
        """Build `grammar`'s start state and first token mask on the calling thread (never
        the engine's: the server calls it from a worker thread), within MASK_BUDGET_SECONDS.
        Raises GrammarTooCostly (a ValueError) past it. The engine then finds both cached."""
        vocab = self.grammar_vocab()
        row = np.zeros(vocab.n_words, np.int32)
        try:
            with mask_budget(MASK_BUDGET_SECONDS):
                Matcher(grammar, vocab).fill_mask(row)
        except MaskBudgetExceeded:
            raise GrammarTooCostly(
                f"the grammar's first token mask takes more than {MASK_BUDGET_SECONDS:g} s "
                f"to compute (its start has too many alternatives to follow at once); "
                f"simplify it") from None

    def start(self, request: GenerationRequest, sink: Callable[[Delta], None],
              all_logits: bool = False) -> int:
        """Queue a request; `sink` gets its deltas from the engine thread. Returns its id.
        Raises ContextOverflow (a ValueError) at once if the prompt cannot fit."""
        self._check_tokens(request.prompt, "prompt")
        if request.images and not self.runner.config.image_rows:
            raise ValueError("this engine takes no images (no vision projector)")
        for image in request.images:
            if image.embeddings.shape[1:] != (self.model.config.d_model,):
                raise ValueError(f"image rows of width {image.embeddings.shape[1:]}, not the "
                                 f"model's {self.model.config.d_model}")
            rows = min(self.config.chunk_tokens, self.config.step_tokens)
            if image.non_causal and len(image.embeddings) > rows:
                raise ValueError(f"an image of {len(image.embeddings)} rows that attend to each "
                                 f"other must be computed in one step, and a prompt chunk here "
                                 f"is at most {rows} rows (-ub, -b)")
        if self._dead:
            raise RuntimeError(self._dead)
        seq_id = next(self._ids)
        seed = request.params.seed
        if seed is None or seed == -1:
            seed = int.from_bytes(os.urandom(4), "little")
        vocab = self.grammar_vocab() if request.grammar is not None else None
        job = Job(seq_id, request, sink, self.tokenizer, seed, all_logits, vocab)
        self._inbox.put(("add", job))
        self._wake.set()
        if self._dead:  # the engine failed after the check above: nobody will answer it
            job.fail(self._dead)
        return seq_id

    def _check_tokens(self, tokens: list[int], what: str) -> None:
        """ContextOverflow when `tokens` leave no room in a slot, ValueError for an id outside
        the vocabulary: a request's or a prefill's, checked before it is queued."""
        if len(tokens) >= self.max_context:
            raise ContextOverflow(f"the {what} has {len(tokens)} tokens; the context "
                                  f"holds {self.max_context}")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary "
                             f"(0..{self.vocab_size - 1})")

    def cancel(self, seq_id: int) -> None:
        """Stop a request or a prefill; its pages are freed on the engine's next turn."""
        self._inbox.put(("cancel", seq_id))
        self._wake.set()

    def start_prefill(self, tokens: list[int], sink: Callable[[Prefilled], None]) -> int:
        """Queue a prefill of `tokens`: their whole pages are computed into the prefix cache
        (module docstring). `sink` gets one Prefilled, on the engine thread, once they are
        cached, or as soon as the prefill is cut short (a request arrived, a newer prefill of
        the same conversation, pages a request needs, a cancel). Returns its id. Raises
        ContextOverflow (a ValueError) at once if the tokens cannot fit a slot."""
        self._check_tokens(tokens, "prefill")
        if self._dead:
            raise RuntimeError(self._dead)
        seq_id = next(self._ids)
        self._inbox.put(("prefill", (seq_id, list(tokens), sink)))
        self._wake.set()
        if self._dead:
            sink(Prefilled(seq_id, 0, 0, self._dead))
        return seq_id

    def prefill(self, tokens: list[int]) -> Prefilled:
        """A prefill of `tokens`, synchronously (for notebooks and tests)."""
        out: queue.SimpleQueue = queue.SimpleQueue()
        self.start_prefill(tokens, out.put)
        return out.get()

    async def submit_prefill(self, tokens: list[int]) -> Prefilled:
        """A prefill of `tokens`, awaited; cancelling the await cancels the prefill."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def answer(result: Prefilled) -> None:
            if not done.done():
                done.set_result(result)
        seq_id = self.start_prefill(tokens, lambda r: loop.call_soon_threadsafe(answer, r))
        answered = False
        try:
            result = await done
            answered = True
            return result
        finally:
            if not answered:
                self.cancel(seq_id)

    async def forget(self, tokens: list[int]) -> int:
        """Drop the prefix cache's pages of `tokens` that no request is using (llama-server's
        slot erase), on the engine thread. Returns the tokens whose pages were dropped."""
        if self._dead:
            raise RuntimeError(self._dead)
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._inbox.put(("forget", (list(tokens),
                                    lambda n: loop.call_soon_threadsafe(done.set_result, n))))
        self._wake.set()
        return await done

    def generate(self, request: GenerationRequest) -> Iterator[Delta]:
        """The request's deltas, synchronously (for notebooks and tests)."""
        out: queue.SimpleQueue = queue.SimpleQueue()
        seq_id = self.start(request, out.put)
        done = False
        try:
            while not done:
                delta = out.get()
                done = delta.finish_reason is not None
                yield delta
        finally:
            if not done:
                self.cancel(seq_id)

    def score(self, tokens: list[int], images: tuple = ()) -> np.ndarray:
        """Logits at every position of `tokens` ([len, V] float32), computed by the same
        steps as generation (teacher forcing: receipts and parity use this); images: rows of
        `tokens` that are image embeddings (ImageRows)."""
        out: queue.SimpleQueue = queue.SimpleQueue()
        request = GenerationRequest(list(tokens), max_tokens=1, speculative=False,
                                    images=tuple(images))
        seq_id = self.start(request, out.put, all_logits=True)
        while True:
            delta = out.get()
            if delta.finish_reason is not None:
                break
        if delta.error:
            raise RuntimeError(delta.error)
        return self._scored.pop(seq_id)

    def counters(self) -> dict[str, float]:
        """Totals since start: requests, prompt tokens run and reused, predicted tokens, the
        seconds spent on each (a step's time split by its rows), drafts proposed/accepted,
        prefills answered and the rows they ran (not counted as requests or prompt tokens)."""
        return dict(self._counters)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(s.slot_stats(), s.queue_length, len(s.running))

    def compile(self, progress=None) -> None:
        """Compile the sampler and log-probabilities at every row bucket, then the step at
        every row and key bucket, now: the first request of each shape would otherwise stall
        every stream while XLA compiles. progress(done, total) as Runner.compile.

        Compiling takes hundreds of MB that the C library keeps after XLA frees them; they are
        handed back after each compile (release_memory), and the sampler compiles before the
        first step maps the weights in, so that the peak is one compile's, not their sum; the
        steps warm up on zero weights (Runner.compile), and the weights are rearranged into
        the kernel's layout only at the end (LoadedModel.finish_repack).
        JAX's tracing caches are dropped after (drop_staging_caches). glibc's mmap threshold
        is held low meanwhile (kinetic.memory.compiling)."""
        with compiling():
            self._compile(progress)

    def _compile(self, progress) -> None:
        for B in self.sample_buckets:
            logits = jnp.zeros((B, self.vocab_size), jnp.float32)
            tokens = jnp.zeros((B,), jnp.int32)
            if B in self.chunk_buckets:
                params = sampler.make_row_params([SamplingParams(temperature=0.8)] * B, [0] * B,
                                                 [1] * B, [None] * B, n_ctx=self.max_context)
                # the arguments exactly as _sample_rows passes them: its one compiled variant
                # (bias and DRY pairs at their fixed widths, the DRY spill at [B, V])
                tokens, _ = sampler.sample(logits, params, self._no_history(B),
                                           self._zero_bias(B), self._full_mask(B),
                                           self._zero_dry(B))
            # logprobs run at the bucket of the rows that ask, picked from the step's logits
            # (pick_rows below)
            sampler.logprobs(logits, tokens, MAX_LOGPROBS)[0].block_until_ready()
            self._greedy(logits, self._zero_bias(B), self._full_mask(B)).block_until_ready()
            for rows in {1, *self.runner.row_buckets}:   # the logits a step can return
                sampler.pick_rows(jnp.zeros((rows, self.vocab_size), jnp.float32),
                                  jnp.zeros(B, jnp.int32)).block_until_ready()
            del logits, tokens
            release_memory()
        # the decode-step loops take _run_decode_steps' bias pairs (_bias at the row bucket)
        self.runner.compile(progress=_releasing(progress), bias=self._zero_bias)
        drop_staging_caches()
        release_memory()
        # the weights' 16-column rearrangement, left by the loader until the compiler's memory
        # is handed back (Runner.compile warms up on zero weights)
        self.runner.model.finish_repack()

    def prepare_post_sampling(self) -> None:
        """Compile sampler.distribution (post-sampling probabilities) at every sampler
        bucket, once. Seconds per bucket, so not at start-up: call it in a worker thread
        before starting the first request with post_sampling, which would otherwise compile
        it on the engine thread and stall every stream meanwhile."""
        with self._post_sampling_lock:
            if self._post_sampling_ready:
                return
            for B in self.chunk_buckets:   # the arguments exactly as _sample_rows passes them
                params = sampler.make_row_params([SamplingParams(temperature=0.8)] * B,
                                                 [0] * B, [1] * B, [None] * B,
                                                 n_ctx=self.max_context)
                logits = jnp.zeros((B, self.vocab_size), jnp.float32)
                jnp.log(sampler.distribution(logits, params, self._no_history(B),
                                             self._zero_bias(B), self._full_mask(B),
                                             self._zero_dry(B))).block_until_ready()
                del logits
                release_memory()
            self._post_sampling_ready = True

    @property
    def sample_buckets(self) -> list[int]:
        """Rows of the compiled greedy draw, log-probabilities and bitmasks: every other row
        bucket of the step (1, 4, 16, 64, ...) and the largest (sampler.sample: the ones up
        to SAMPLE_CHUNK, chunk_buckets). Each compiled size holds MBs of code, and sampling a
        few padding rows costs less than that."""
        buckets = self.runner.row_buckets
        keep = [b for b in buckets if (b.bit_length() - 1) % 2 == 0]   # 1, 4, 16, ...
        return keep if keep[-1:] == buckets[-1:] else keep + buckets[-1:]

    @property
    def chunk_buckets(self) -> list[int]:
        """The sizes sampler.sample is compiled at: the sampler buckets that hold a chunk of
        up to SAMPLE_CHUNK rows (more rows sample in chunks: _sample); with XLA's kernel,
        whose steps run at T rows only, that is T."""
        top = self.sample_buckets[-1]
        return sorted({self.sample_bucket(min(n, top)) for n in range(1, SAMPLE_CHUNK + 1)})

    def sample_bucket(self, n: int) -> int:
        """Rows of the compiled sampler that holds n rows."""
        return next(b for b in self.sample_buckets if b >= n)

    def stalled_for(self) -> float:
        """Seconds the engine thread has spent in its current turn (one step: plan, run,
        sample, hand out tokens); 0 while it waits for work. /health reads it: a turn that
        never ends (a stuck device call) is what no other signal shows."""
        started = self._turn_started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def failure(self) -> str | None:
        """Why the engine thread died (every request since fails with it), or None."""
        return self._dead

    def close(self, timeout: float = 30.0) -> bool:
        """Stop the engine thread between two turns; requests still running end
        "cancelled". Returns whether the thread ended within `timeout` seconds (not if it
        is stuck inside a turn: a device call cannot be interrupted)."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=timeout)
        return not self._thread.is_alive()

    # --- the engine thread ----------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                self._answer_prefills()
                if not self.scheduler.has_work:
                    self._wake.wait()
                    self._wake.clear()
                    continue
                self._turn_started = time.monotonic()
                self._turn()
                self._answer_prefills()
                self._turn_started = None
            self._drain_inbox()
            for job in list(self._jobs.values()):  # closed: end what is still running
                job.finish("cancelled", self._usage(job.seq_id))
                self._drop(job.seq_id)
            for seq_id in list(self._prefills):
                if seq_id in self.scheduler.sequences:
                    self.scheduler.cancel(seq_id)
            self._answer_prefills()
        except Exception as e:  # never lose a request silently: fail them all, loudly
            self._dead = f"engine error: {type(e).__name__}: {e}"
            try:
                self._drain_inbox()
            except Exception:  # the jobs already known still get their error below
                pass
            for job in list(self._jobs.values()):
                job.fail(self._dead)
            for seq_id, sink in list(self._prefills.items()):
                self._answer(sink, Prefilled(seq_id, 0, 0, self._dead))
            raise

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._jobs[item.seq_id] = item
                self._counters["requests"] += 1
                if item.all_logits:
                    self._scored[item.seq_id] = np.zeros(
                        (len(item.request.prompt), self.vocab_size), np.float32)
                seq = Sequence(item.seq_id, item.request.prompt, item.request.max_tokens)
                seq.use_prefix_cache = not item.all_logits  # scoring needs every row
                seq.image_keys = image_keys(item.request.images)
                seq.blocks = [(i.start, i.end) for i in item.request.images if i.non_causal]
                seq.group = item.request.group
                self.scheduler.add(seq)
            elif kind == "prefill":
                seq_id, tokens, sink = item
                self._prefills[seq_id] = sink
                self.scheduler.add_prefill(seq_id, tokens)
            elif kind == "forget":
                tokens, answer = item
                self._answer(answer, self.scheduler.forget(tokens))
            elif kind == "cancel" and item in self._jobs:
                self._jobs[item].finish("cancelled", self._usage(item))
                self._drop(item)
            elif kind == "cancel" and item in self._prefills and item in self.scheduler.sequences:
                self.scheduler.cancel(item)

    def _answer_prefills(self) -> None:
        """Hand each prefill that ended its Prefilled."""
        for result in self.scheduler.take_prefilled():
            sink = self._prefills.pop(result.seq_id, None)
            if sink is not None:
                self._counters["prefills"] += 1
                self._answer(sink, result)

    @staticmethod
    def _answer(sink: Callable[[Prefilled], None], result: Prefilled) -> None:
        try:
            sink(result)
        except Exception:  # its consumer has gone (a closed event loop): nobody to tell
            pass

    def _drop(self, seq_id: int) -> None:
        self._jobs.pop(seq_id, None)
        if seq_id in self.scheduler.sequences:
            self.scheduler.cancel(seq_id)

    def _turn(self) -> None:
        self._grammar_spent.clear()   # each turn's grammar budget starts afresh
        self._propose_drafts()
        n_steps = self._plan_decode_steps()
        plan = self.scheduler.schedule()
        self._answer_prefills()   # those a request's arrival ended: before the step runs
        self._sync_host_pages(plan)
        for slot, snapshots in plan.state_loads:
            for runner, snapshot in zip(self._stateful, snapshots):
                runner.load_state(slot, snapshot)
        if not len(plan):
            return
        started = time.perf_counter()
        rows = plan.sample_rows
        if n_steps and self._decode_steps_plan(plan, n_steps):
            self._finish_turn(plan, rows, self._run_decode_steps(plan, rows, n_steps), started,
                              multi=True)
            return
        # A step computes only the logits it samples (ffi kernel: the output projection is
        # the largest matrix of a small model), unless a job scores every row; at_row maps a
        # plan row to its row of the logits (one sampled row: its logits alone).
        sampled = [r for rs in rows.values() for r in rs]
        only = (self.runner.exact_rows
                and not any(c.seq_id in self._scored for c in plan.chunks))
        logits = self.runner.step_device(plan.tokens, plan.positions, plan.slots,
                                         plan.write_index, plan.page_table,
                                         sampled if only else None, plan.draft_rows,
                                         self._image_inputs(plan))
        at_row = {r: 0 for r in sampled} if only and len(sampled) == 1 else None
        for c in plan.chunks:
            if c.seq_id in self._prefills:
                continue
            self._jobs[c.seq_id].cached = self.scheduler.sequences[c.seq_id].num_cached
            if c.seq_id in self._scored:  # by position: a preempted sequence recomputes rows
                self._scored[c.seq_id][c.start:c.start + c.num_rows] = np.asarray(
                    logits[c.first_row:c.first_row + c.num_rows])
        masks = self._masks(plan, rows)   # host work while the device runs the step
        samples = self._sample(plan, logits, rows, masks, at_row) if rows else {}
        self._finish_turn(plan, rows, samples, started)

    def _finish_turn(self, plan, rows: dict[int, list[int]], samples: dict, started: float,
                     multi: bool = False) -> None:
        """Hand out a step's tokens (samples: seq id -> (tokens drawn at its rows, logprob
        entries or None)), advance the scheduler, end the requests that ended. multi: the
        step ran as decode steps (_run_decode_steps), whose later rows took the drawn tokens."""
        accepted: dict[int, list[int]] = {}
        ending: dict[int, str] = {}
        for seq_id, row_ids in rows.items():
            job, (tokens, lps) = self._jobs[seq_id], samples[seq_id]
            if seq_id in self._over_budget:
                continue
            draft = plan.tokens[row_ids[1:]].tolist() if len(row_ids) > 1 else []
            new = tokens if multi else accept(draft, tokens)
            with self._grammar_work(seq_id):
                keep, reason = job.take(new, lps[:len(new)] if lps else None)
            if seq_id in self._over_budget:
                continue
            accepted[seq_id] = new[:keep] if reason is None else new[:max(keep, 1)]
            if reason is not None:
                ending[seq_id] = reason
        for seq_id in self._over_budget:   # before complete(), which then skips them
            self._fail_over_budget(seq_id)
        self._over_budget.clear()
        if self.drafter is not None:
            self.drafter.follow(plan)
        self._count(plan, rows, accepted, time.perf_counter() - started, multi)
        finished = self.scheduler.complete(plan, accepted)
        for slot, key, position, tag in self.scheduler.take_state_saves():
            snapshots = tuple(runner.save_state(slot) for runner in self._stateful)
            if snapshots[0].position == position:   # (else accepted drafts await their replay)
                self.scheduler.snapshots.put(key, snapshots, tag)
        for seq in finished:
            ending.setdefault(seq.seq_id, seq.finish_reason or "length")
        for seq_id, reason in ending.items():
            job = self._jobs.get(seq_id)
            if job is not None:
                job.finish(reason, self._usage(seq_id))
                self._drop(seq_id)

    @contextmanager
    def _grammar_work(self, seq_id: int):
        """A piece of one request's grammar work in this turn, within what is left of its
        budget (MASK_BUDGET_SECONDS per request per turn, over its draft check, masks and
        accepted tokens together). An overrun is swallowed here and marks the request, which
        fails at the end of the turn; the caller checks `seq_id in self._over_budget`."""
        if self._jobs[seq_id].matcher is None:
            yield
            return
        spent = self._grammar_spent.get(seq_id, 0.0)
        started = time.perf_counter()
        try:
            with mask_budget(MASK_BUDGET_SECONDS - spent):
                yield
        except MaskBudgetExceeded:
            self._over_budget.add(seq_id)
        finally:
            self._grammar_spent[seq_id] = spent + time.perf_counter() - started

    def _fail_over_budget(self, seq_id: int) -> None:
        job = self._jobs.get(seq_id)
        if job is not None:
            job.fail(f"the request's grammar took more than {MASK_BUDGET_SECONDS:g} s of one "
                     f"step to compute its token masks; it was stopped so that other requests "
                     f"keep their pace (simplify the grammar)", busy=True)
            self._drop(seq_id)

    def _sync_host_pages(self, plan) -> None:
        """Save pages evicted while planning (still intact on the device) to host memory,
        then copy back the ones the plan restores (a page saved in this same plan too: a
        finished sequence's partial page, reused at once). The restores' data is taken before
        the saves, which could push it out of the host store. The draft model's cache goes
        along."""
        runners = [self.runner] + ([self.drafter.runner] if self.drafter else [])
        saved: dict[bytes, list] = {}
        if plan.evicted and self.scheduler.host is not None:
            pages = [p for p, _ in plan.evicted]
            copies = [r.read_pages(pages) for r in runners]
            for i, (_, key) in enumerate(plan.evicted):
                saved[key] = [a for c in copies for a in c[i]]
            self._counters["pages_to_host"] += len(pages)
        data = [saved[key] if key in saved else self.host_pages.get(key)
                for _, key in plan.restores]
        for key, arrays in saved.items():
            self.host_pages.put(key, arrays)
        if plan.restores:
            pages = [p for p, _ in plan.restores]
            start = 0
            for r in runners:
                n = 2 * len(r.cache)
                r.write_pages(pages, [d[start:start + n] for d in data])
                start += n
            self._counters["pages_from_host"] += len(pages)

    def _count(self, plan, rows, accepted, seconds: float, multi: bool = False) -> None:
        c = self._counters
        decode_rows = sum(len(r) for r in rows.values())
        fill_rows = sum(ch.num_rows for ch in plan.chunks if ch.seq_id in self._prefills)
        prompt_rows = len(plan) - decode_rows - fill_rows
        for seq_id, r in rows.items():
            if not multi:   # decode steps' later rows are not drafts
                c["draft_tokens"] += len(r) - 1
                c["draft_accepted"] += max(0, len(accepted.get(seq_id, [])) - 1)
        c["prompt_tokens"] += prompt_rows
        c["tokens_predicted"] += sum(len(a) for a in accepted.values())
        c["prompt_seconds"] += seconds * prompt_rows / max(len(plan), 1)
        c["prefill_tokens"] += fill_rows
        c["prefill_seconds"] += seconds * fill_rows / max(len(plan), 1)
        c["tokens_predicted_seconds"] += seconds * decode_rows / max(len(plan), 1)
        c["steps"] += max(1, len(next(iter(rows.values())))) if multi else 1
        c["decode_step_calls"] += multi   # device calls that ran several decode steps

    # --- several decode steps per device call ---------------------------------------------

    def _plan_decode_steps(self) -> int:
        """How many decode steps the next device call runs (0: one ordinary step), and if
        more than one, the scheduler is handed placeholder drafts that make it reserve the
        rows and pages of those steps. Only where nothing could happen between them: no
        request waiting, every running sequence caught up without a draft, and every
        request plain greedy (no penalties, DRY or Mirostat), without a grammar, logprobs or
        scored logits, with room for every step's token (max_tokens and the context), and no
        prefill wanting the rows they leave.
        Stop strings and end-of-generation tokens may still come: the tokens after them are
        dropped (Job.take), never sent."""
        running = self.scheduler.running
        if (not running or self.drafter is not None or self.scheduler.waiting
                or self.scheduler.prefilling or not self._inbox.empty()):
            return 0
        n = self.runner.decode_steps_at(len(running))
        if n < 2:
            return 0
        for seq in running:
            job = self._jobs.get(seq.seq_id)
            if (job is None or seq.draft or seq.num_computed != len(seq.tokens) - 1
                    or job.matcher is not None or job.request.logprobs is not None
                    or job.all_logits or not sampler.plain_greedy(job.request.params)):
                return 0
            room = self.max_context - len(seq.tokens)
            if seq.max_tokens is not None:
                room = min(room, seq.max_tokens - seq.n_decoded - 1)
            if room < n - 1:
                return 0
        for seq in running:
            self.scheduler.set_draft(seq.seq_id, [seq.tokens[-1]] * (n - 1))
        return n

    @staticmethod
    def _decode_steps_plan(plan, n: int) -> bool:
        """Whether the scheduler gave every sequence of `plan` its decode row and the n - 1
        placeholder rows (it may not: pages ran short). If not, the plan runs as an ordinary
        step that verifies the placeholders as drafts, which is correct, only slower."""
        return all(c.sampled and c.num_rows == n and c.num_draft == n - 1 for c in plan.chunks)

    def _run_decode_steps(self, plan, rows: dict[int, list[int]], n: int) -> dict:
        """Run `plan` (every sequence: its newest token's row and n - 1 placeholder rows) as n
        decode steps in one device call, each step's token fed to the next. The plan's
        placeholder tokens become the tokens the steps drew, so that Scheduler.complete
        sees them as accepted drafts. Returns _sample's shape of result."""
        order = list(rows.items())
        grid = np.array([r for _, r in order], np.int64).T   # [n, B]: step i's row per seq
        first = grid[0]
        bias = self._bias([(sid, r[0]) for sid, r in order], self.runner.row_bucket(len(order)))
        drawn = np.asarray(self.runner.decode_steps(
            plan.tokens[first], plan.positions[grid], plan.slots[first], plan.write_index[grid],
            plan.page_table, bias))[:, :len(order)]
        out = {}
        for j, (sid, row_ids) in enumerate(order):
            tokens = drawn[:, j].tolist()
            plan.tokens[row_ids[1:]] = tokens[:-1]
            job = self._jobs[sid]
            job.pending_mu = (sampler.initial_mu(job.request.params) if job.mu is None
                              else job.mu)
            out[sid] = (tokens, None)
        return out

    def _image_inputs(self, plan) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(mask [n], embeddings [n, D], ends [n]) of the plan's image rows, or None without
        any: an image that attends both ways gives its rows its last position as their end."""
        found = []
        for c in plan.chunks:
            job = self._jobs.get(c.seq_id)
            for image in job.request.images if job is not None else ():
                lo, hi = max(image.start, c.start), min(image.end, c.start + c.num_rows)
                if lo < hi:
                    found.append((c.first_row + lo - c.start, image.embeddings[lo - image.start:
                                                                               hi - image.start],
                                  image.end - 1 if image.non_causal else None))
        if not found:
            return None
        mask = np.zeros(len(plan), np.int64)
        rows = np.zeros((len(plan), self.model.config.d_model), np.float32)
        ends = plan.positions.astype(np.int64).copy()
        for row, embeddings, end in found:
            mask[row:row + len(embeddings)] = 1
            rows[row:row + len(embeddings)] = embeddings
            if end is not None:
                ends[row:row + len(embeddings)] = end
        return mask, rows, ends

    def _usage(self, seq_id: int):
        usage = self._jobs[seq_id].usage()
        self._counters["prompt_tokens_cached"] += usage.cached_tokens
        return usage

    def _propose_drafts(self) -> None:
        if not self.config.speculative or self.config.max_draft == 0:
            return
        ready = []
        for seq in self.scheduler.running:
            job = self._jobs.get(seq.seq_id)
            if (job is not None and job.request.speculative and not job.request.params.mirostat
                    and seq.num_computed == len(seq.tokens) - 1):
                ready.append(seq)
        if self.drafter is not None and ready:
            drafts = self.drafter.propose(ready, self.scheduler.page_table(),
                                          self.config.max_draft)
        else:
            drafts = {s.seq_id: ngram_draft(s.tokens, self.config.max_draft) for s in ready}
        for seq_id, draft in drafts.items():
            matcher = self._jobs[seq_id].matcher
            if matcher is not None:
                with self._grammar_work(seq_id):
                    draft = _grammar_prefix(matcher, draft)
                if seq_id in self._over_budget:
                    draft = []
            if draft:
                self.scheduler.set_draft(seq_id, draft)

    def _masks(self, plan, rows: dict[int, list[int]]) -> np.ndarray | None:
        """The [n, ceil(V/32)] bitmask of the n sampled rows, in `_sample`'s row order, on the
        host (None when no row has a grammar: all ones): all ones for rows without a grammar;
        for a draft row, the grammar's mask after the drafted tokens before it (drafts were
        cut to what the grammar allows, see `_grammar_prefix`)."""
        if not any(self._jobs[sid].matcher is not None for sid in rows):
            return None
        out = np.full((sum(len(r) for r in rows.values()), (self.vocab_size + 31) // 32), -1,
                      np.int32)
        i = 0
        for sid, row_ids in rows.items():
            matcher = self._jobs[sid].matcher
            if matcher is not None and sid not in self._over_budget:
                words = matcher.vocab.n_words
                draft = plan.tokens[row_ids[1:]].tolist()
                out[i:i + len(row_ids)] = 0
                taken = 0
                with self._grammar_work(sid):
                    matcher.fill_mask(out[i, :words])
                    for t in draft:
                        if not matcher.accept_token(t):
                            break
                        taken += 1
                        matcher.fill_mask(out[i + taken, :words])
                matcher.rollback(taken)
                if sid in self._over_budget:   # its rows are sampled unmasked, then dropped
                    out[i:i + len(row_ids)] = -1
            i += len(row_ids)
        return out

    def _mask_rows(self, masks: np.ndarray | None, lo: int, n: int, T: int) -> jax.Array:
        """Rows lo .. lo + n of _masks' bitmask on the device, padded to T rows."""
        if masks is None:
            return self._full_mask(T)
        out = np.full((T, masks.shape[1]), -1, np.int32)
        out[:n] = masks[lo:lo + n]
        return jax.device_put(out)

    def _sample(self, plan, logits, rows: dict[int, list[int]], masks, at_row=None) -> dict:
        """Sample every wanted row (log-probabilities only for the rows that ask: _logprobs):
        rows that are all plain greedy in one call at the bucket of their count, others
        SAMPLE_CHUNK rows a call (_sample_rows). at_row maps a plan row to its row of logits
        (None: the same); masks as _masks gives them. Returns seq id -> (tokens drawn at its
        rows, per-row logprob entries or None)."""
        order = [(sid, r) for sid, rs in rows.items() for r in rs]
        greedy = all(sampler.plain_greedy(self._jobs[sid].request.params) for sid, _ in order)
        size = len(order) if greedy else SAMPLE_CHUNK
        tokens, new_mu, lp_at = [], [], {}
        for lo in range(0, len(order), size):
            toks, mus, lps = self._sample_rows(plan, logits, order[lo:lo + size], masks, lo,
                                               at_row)
            tokens += toks
            new_mu += mus
            lp_at.update((lo + i, entry) for i, entry in lps.items())
        out: dict[int, tuple[list[int], list | None]] = {}
        for i, (sid, _) in enumerate(order):
            job = self._jobs[sid]
            toks, lps = out.setdefault(sid, ([], [] if job.request.logprobs is not None else None))
            toks.append(tokens[i])
            if lps is not None:
                lps.append(lp_at[i])
            if len(toks) == 1:
                job.pending_mu = new_mu[i]
        return out

    def _sample_rows(self, plan, logits, order, masks, lo: int, at_row) -> tuple:
        """One call of the sampler over `order`'s rows (rows lo.. of the step's sampled rows,
        of masks), at the bucket of their count. Returns (tokens, new mu per row, logprob
        entries by row of `order`)."""
        T = self.sample_bucket(len(order))
        idx = np.zeros(T, np.int32)
        idx[:len(order)] = [r if at_row is None else at_row[r] for _, r in order]
        params = [self._jobs[sid].request.params for sid, _ in order]
        mus = [self._jobs[sid].mu for sid, _ in order]
        bias = self._bias(order, T)
        mask = self._mask_rows(masks, lo, len(order), T)
        # the sampled rows of the logits: often all of them, in order (no copy then)
        same = logits.shape[0] == T and (idx == np.arange(T)).all()
        picked = logits if same else sampler.pick_rows(logits, jax.device_put(idx))
        chain = None   # sample's arguments, for post-sampling probabilities
        if all(sampler.plain_greedy(p) for p in params):   # no row parameters, history or DRY
            tokens = self._greedy(picked, bias, mask)
            new_mu = [sampler.initial_mu(p) if m is None else m for p, m in zip(params, mus)]
        else:
            seeds, positions, histories = [], [], []
            for sid, r in order:
                job, seq = self._jobs[sid], self.scheduler.sequences[sid]
                pos = int(plan.positions[r]) + 1  # the index the drawn token will take
                seeds.append(job.seed)
                positions.append(pos)
                histories.append((seq.tokens + seq.draft)[:pos])
            row_params = sampler.make_row_params(params, seeds, positions, mus,
                                                 n_ctx=self.max_context, pad_to=T)
            # one shape whatever the request asks (no compile on a request): the history at
            # its full width, or none when no row has penalties; DRY pairs at their width
            hist = (jax.device_put(history_rows(histories + [[]] * (T - len(order)),
                                                self._history_width))
                    if any(sampler.penalties_on(p) for p in params) else self._no_history(T))
            chain = (picked, row_params, hist, bias, mask, self._dry(order, histories, T))
            tokens, new_mu = sampler.sample(*chain)
        lp_at = self._logprobs(logits, picked, idx, tokens, order)
        if any(self._jobs[sid].request.post_sampling for sid, _ in order):
            lp_at.update(self._post_sampling(order, tokens, chain))
        n = len(order)
        return ([int(t) for t in np.asarray(tokens)[:n]],
                [float(m) for m in np.asarray(new_mu)[:n]], lp_at)

    def _logprobs(self, logits, picked, idx: np.ndarray, tokens, order) -> dict:
        """The log-probabilities of the sampled rows whose request asks for them, computed
        for those rows alone, at the sampler bucket of their count: when every sampled row
        asks, over `picked` (the sampler's rows) with the tokens still on the device;
        otherwise over their rows picked from the step's `logits` (idx maps a sampled row to
        its row there). Returns sampled row -> (chosen logprob, top ids, top logprobs)."""
        rows = [i for i, (sid, _) in enumerate(order)
                if self._jobs[sid].request.logprobs is not None
                and not self._jobs[sid].request.post_sampling]
        if not rows:
            return {}
        if len(rows) == len(order):   # then at the bucket of `picked` already
            lp_logits, lp_tokens = picked, tokens
        else:
            L = self.sample_bucket(len(rows))
            at = np.zeros(L, np.int32)
            at[:len(rows)] = idx[rows]
            chosen_tokens = np.full(L, -1, np.int32)
            chosen_tokens[:len(rows)] = np.asarray(tokens)[rows]
            lp_logits = sampler.pick_rows(logits, jax.device_put(at))
            lp_tokens = jax.device_put(chosen_tokens)
        chosen, top_ids, top_lp = (np.asarray(a) for a in
                                   sampler.logprobs(lp_logits, lp_tokens, MAX_LOGPROBS))
        return {r: (float(chosen[j]), top_ids[j], top_lp[j]) for j, r in enumerate(rows)}

    def _post_sampling(self, order, tokens, chain) -> dict:
        """_logprobs' entries for the sampled rows whose request asks for post-sampling
        probabilities: the log of the distribution each token was drawn from, after the whole
        chain (sampler.distribution over `chain`, sample's own arguments; -inf for tokens the
        chain dropped). With no chain (every row plain greedy) the draw took the argmax: p 1.
        `distribution` is compiled by prepare_post_sampling, before such a request starts."""
        rows = [i for i, (sid, _) in enumerate(order) if self._jobs[sid].request.post_sampling]
        if chain is None:
            drawn = np.asarray(tokens)
            return {i: (0.0 if drawn[i] >= 0 else float("-inf"), drawn[i:i + 1], np.zeros(1))
                    for i in rows}
        logp = jnp.log(sampler.distribution(*chain))   # logprobs' log-softmax keeps it as it is
        chosen, top_ids, top_lp = (np.asarray(a) for a in
                                   sampler.logprobs(logp, tokens, MAX_LOGPROBS))
        return {i: (float(chosen[i]), top_ids[i], top_lp[i]) for i in rows}

    def _bias(self, order, T: int) -> sampler.Sparse:
        """The sampled rows' logit bias (and ignore_eos bans) as _bias_width pairs a row."""
        rows = [self._jobs[sid].bias_pairs(self.vocab_size) for sid, _ in order]
        if all(r is None for r in rows):
            return self._zero_bias(T)
        last = self._last_bias   # the same rows as the step before (a stream decoding): reuse
        if last and last[0] == T and len(last[1]) == len(rows) and all(
                a is b for a, b in zip(last[1], rows)):
            return last[2]
        ids, values = sampler.pack_pairs(rows, T, self._bias_width)
        bias = sampler.Sparse(jax.device_put(ids), jax.device_put(values))
        self._last_bias = (T, rows, bias)
        return bias

    def _greedy(self, logits, bias, masks) -> jax.Array:
        """sampler.greedy's tokens: from one C++ pass over each row where the C++ kernels
        run (kernel "ffi"; _row_argmax), from sampler.greedy's XLA passes elsewhere."""
        if self.runner.exact_rows and isinstance(bias, sampler.Sparse):
            return _row_argmax(logits, bias.ids, bias.values, masks)
        return sampler.greedy(logits, bias, masks)

    def _zero_bias(self, T: int) -> sampler.Sparse:
        """The bias of rows without logit_bias: no pairs (kept per sampler or row bucket)."""
        if T not in self._zero_biases:
            ids, values = sampler.pack_pairs([], T, self._bias_width)
            self._zero_biases[T] = sampler.Sparse(jax.device_put(ids), jax.device_put(values))
        return self._zero_biases[T]

    @functools.cached_property
    def _bias_width(self) -> int:
        """Bias pairs a sampled row holds: BIAS_WIDTH, or more for a tokenizer with more than
        its 64 eog ids (every request then still fits: bias_pairs gives at most
        MAX_LOGIT_BIAS + the eog ids). Fixed for the engine: one compiled shape."""
        eog = sum(1 for t in self.tokenizer.eog_ids if 0 <= t < self.vocab_size)
        return max(BIAS_WIDTH, MAX_LOGIT_BIAS + eog)

    @property
    def _history_width(self) -> int:
        return min(HISTORY_WIDTH, self.max_context)

    def _no_history(self, T: int) -> jax.Array:
        """[T, width] of -1: the history of rows without penalties (kept per bucket)."""
        if T not in self._no_histories:
            self._no_histories[T] = jnp.asarray(history_rows([[]] * T, self._history_width))
        return self._no_histories[T]

    def _full_mask(self, T: int) -> jax.Array:
        """The token mask of rows without a grammar: every token allowed."""
        if T not in self._full_masks:
            self._full_masks[T] = jnp.asarray(sampler.full_mask(T, self.vocab_size))
        return self._full_masks[T]

    def _dry(self, order, histories, T: int) -> sampler.Sparse:
        """The sampled rows' DRY penalties: DRY_WIDTH pairs a row, and a row with more
        penalised tokens whole in the dense spill (zeros, kept on the device, when none)."""
        if not any(self._jobs[sid].request.params.dry_multiplier > 0 for sid, _ in order):
            return self._zero_dry(T)
        rows = [self._jobs[sid].dry_pairs(histories[i], self.vocab_size, self.max_context)
                for i, (sid, _) in enumerate(order)]
        over = [i for i, r in enumerate(rows) if len(r[0]) > DRY_WIDTH]
        ids, values = sampler.pack_pairs([None if i in over else r for i, r in enumerate(rows)],
                                         T, DRY_WIDTH)
        spill, spilled = self._zero_dry(T).spill, self._zero_dry(T).spilled
        if over:
            dense = np.zeros((T, self.vocab_size), np.float32)
            for i in over:
                dense[i, rows[i][0]] = rows[i][1]
            spill, spilled = jax.device_put(dense), jax.device_put(np.True_)
        return sampler.Sparse(jax.device_put(ids), jax.device_put(values), spill, spilled)

    def _zero_dry(self, T: int) -> sampler.Sparse:
        """The DRY input of steps whose rows have none: no pairs, a zero spill (per bucket)."""
        if T not in self._zero_dries:
            ids, values = sampler.pack_pairs([], T, DRY_WIDTH)
            self._zero_dries[T] = sampler.Sparse(
                jax.device_put(ids), jax.device_put(values),
                jnp.zeros((T, self.vocab_size), jnp.float32), jax.device_put(np.False_))
        return self._zero_dries[T]


def image_keys(images) -> dict[int, int]:
    """Position -> the value a prefix-cache key hashes for each image row: negative (never a
    token id), from the image's digest and the row's index in the image."""
    out = {}
    for image in images:
        base = int.from_bytes(image.digest[:5], "little") << 16   # under 2**56
        for i in range(len(image.embeddings)):
            out[image.start + i] = -1 - (base + i)
    return out


# sampler.greedy's tokens in one C++ pass over each row (kernel "ffi" only;
# kinetic/kernels/csrc/argmax.h): the first index of the row maximum after the mask and the
# bias pairs, with NaN read as -inf, as greedy's
_row_argmax = jax.jit(native.row_argmax)


def drop_staging_caches() -> None:
    """Drop what JAX keeps to trace and lower a function again (its jaxprs and lowered
    modules: about 10 MB per compiled shape, 80 MB of Qwen2.5-Coder-0.5B's serving process).
    The executables stay in each jitted function's own cache, where every call of a compiled
    shape finds them: after Engine.compile no request compiles (tests/test_engine.py counts
    XLA's compiles). A JAX without this private function keeps them."""
    try:
        from jax._src import util
        util.clear_all_caches()
    except (ImportError, AttributeError):
        pass


def _releasing(progress):
    def step(done: int, total: int) -> None:
        release_memory()
        if progress:
            progress(done, total)
    return step


def _grammar_prefix(matcher: Matcher, draft: list[int]) -> list[int]:
    """The longest start of `draft` the grammar accepts from the matcher's state (left as
    it was): a drafted token the grammar rejects could never equal a (masked) sample."""
    taken = 0
    for t in draft:
        if not matcher.accept_token(t):
            break
        taken += 1
    matcher.rollback(taken)
    return draft[:taken]
