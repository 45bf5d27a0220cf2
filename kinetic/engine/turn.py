"""One turn of the engine's loop, on the engine thread: schedule, run, hand tokens back.

    Stepper.turn():
        drafts      n-gram (or draft model) proposals for sequences that are caught up,
                    cut where a grammar rejects them (grammar_step.py)
        schedule    Scheduler.schedule packs decode rows, draft rows and prompt chunks of any
                    sequences into one step (or decode_steps.plan: several greedy steps)
        run         the runner computes the step's logits at its row bucket
        sample      each sampled row becomes a SampleRow (sample_batch.py: its job's
                    parameters, pairs, history, grammar mask), the rows become sampler calls,
                    and Runner.sample draws them, every row keyed by its own (seed, position)
        finish      drafts are accepted while they equal the samples; each request's new
                    tokens go through end-of-generation, stop-string and UTF-8 handling and
                    out to its sink (Job.take); Scheduler.complete advances the sequences
                    and frees the pages of finished ones at once.

The Stepper holds what only the engine thread touches: the running jobs, the prefills'
sinks, the scored logits of scoring requests, the counters. The Engine (engine.py) feeds it
from its inbox.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from kinetic.engine import decode_steps
from kinetic.engine.grammar_step import GrammarWork
from kinetic.engine.job import Job
from kinetic.engine.sample_batch import SampleShape, sample_batches, sample_row
from kinetic.engine.scheduler import Prefilled, Sequence
from kinetic.engine.speculative import accept, ngram_draft

COUNTERS = ("requests", "prompt_tokens", "prompt_tokens_cached", "prompt_seconds",
            "tokens_predicted", "tokens_predicted_seconds", "draft_tokens", "draft_accepted",
            "steps", "pages_to_host", "pages_from_host", "decode_step_calls",
            "prefills", "prefill_tokens", "prefill_seconds")


class Stepper:
    """The engine thread's state and its turn."""

    def __init__(self, engine):
        """engine: the Engine whose runner, drafter, scheduler, host pages, config and
        sampler shape (Engine.sample_shape) the turns use."""
        self.engine = engine
        self.runner, self.drafter = engine.runner, engine.drafter
        self.scheduler, self.host_pages = engine.scheduler, engine.host_pages
        self.config = engine.config
        self.grammar = GrammarWork(engine.tokenizer, engine.vocab_size)
        # the runners with recurrent layers (the target's, the draft model's): each keeps its
        # slots' states, and a snapshot of the prefix for each
        self.stateful = [r for r in (self.runner, self.drafter and self.drafter.runner)
                         if r is not None and r.state is not None]
        self.jobs: dict[int, Job] = {}
        self.prefills: dict[int, Callable[[Prefilled], None]] = {}   # prefill id -> its sink
        self.scored: dict[int, np.ndarray] = {}  # all-logits jobs: [len(prompt), V]
        self.counters = dict.fromkeys(COUNTERS, 0.0)

    @property
    def shape(self) -> SampleShape:
        return self.engine.sample_shape

    # --- what the inbox brings ------------------------------------------------------------

    def add(self, job: Job) -> None:
        self.jobs[job.seq_id] = job
        self.counters["requests"] += 1
        if job.all_logits:
            self.scored[job.seq_id] = np.zeros((len(job.request.prompt), self.shape.vocab_size),
                                               np.float32)
        seq = Sequence(job.seq_id, job.request.prompt, job.request.max_tokens)
        seq.use_prefix_cache = not job.all_logits  # scoring needs every row
        seq.image_keys = image_keys(job.request.images)
        seq.blocks = [(i.start, i.end) for i in job.request.images if i.non_causal]
        seq.group = job.request.group
        self.scheduler.add(seq)

    def add_prefill(self, seq_id: int, tokens: list[int], sink) -> None:
        self.prefills[seq_id] = sink
        self.scheduler.add_prefill(seq_id, tokens)

    def cancel(self, seq_id: int) -> None:
        if seq_id in self.jobs:
            self.jobs[seq_id].finish("cancelled", self.usage(seq_id))
            self.drop(seq_id)
        elif seq_id in self.prefills and seq_id in self.scheduler.sequences:
            self.scheduler.cancel(seq_id)

    def answer_prefills(self) -> None:
        """Hand each prefill that ended its Prefilled."""
        for result in self.scheduler.take_prefilled():
            sink = self.prefills.pop(result.seq_id, None)
            if sink is not None:
                self.counters["prefills"] += 1
                answer(sink, result)

    def drop(self, seq_id: int) -> None:
        self.jobs.pop(seq_id, None)
        if seq_id in self.scheduler.sequences:
            self.scheduler.cancel(seq_id)

    def usage(self, seq_id: int):
        usage = self.jobs[seq_id].usage()
        self.counters["prompt_tokens_cached"] += usage.cached_tokens
        return usage

    # --- the turn -------------------------------------------------------------------------

    def turn(self, quiet: bool) -> None:
        """One turn (module docstring). quiet: no request or cancel waits in the inbox (the
        only case several decode steps may run in one call)."""
        self.grammar.new_turn()
        self._propose_drafts()
        n_steps = (decode_steps.plan(self.scheduler, self.runner, self.jobs, quiet)
                   if self.drafter is None else 0)
        plan = self.scheduler.schedule(n_steps * len(self.scheduler.running) or None)
        self.answer_prefills()   # those a request's arrival ended: before the step runs
        self._sync_host_pages(plan)
        for slot, snapshots in plan.state_loads:
            for runner, snapshot in zip(self.stateful, snapshots):
                runner.load_state(slot, snapshot)
        if not len(plan):
            return
        started = time.perf_counter()
        rows = plan.sample_rows
        if n_steps and decode_steps.planned(plan, n_steps):
            samples = decode_steps.run(self.runner, plan, rows, self.jobs, self.shape)
            self._finish(plan, rows, samples, started, multi=True)
            return
        # A step computes only the logits it samples (ffi kernel: the output projection is
        # the largest matrix of a small model), unless a job scores every row; at_row maps a
        # plan row to its row of the logits (one sampled row: its logits alone).
        sampled = [r for rs in rows.values() for r in rs]
        only = self.runner.exact_rows and not any(c.seq_id in self.scored for c in plan.chunks)
        logits = self.runner.step_device(plan.tokens, plan.positions, plan.slots,
                                         plan.write_index, plan.page_table,
                                         sampled if only else None, plan.draft_rows,
                                         self._image_inputs(plan))
        at_row = ({r: 0 for r in sampled} if only and len(sampled) == 1 and logits.shape[0] == 1
                  else None)
        for c in plan.chunks:
            if c.seq_id in self.prefills:
                continue
            self.jobs[c.seq_id].cached = self.scheduler.sequences[c.seq_id].num_cached
            if c.seq_id in self.scored:  # by position: a preempted sequence recomputes rows
                self.scored[c.seq_id][c.start:c.start + c.num_rows] = self.runner.host_rows(
                    logits, c.first_row, c.num_rows)
        samples = self._sample(plan, logits, rows, at_row) if rows else {}
        self._finish(plan, rows, samples, started)

    def _sample(self, plan, logits, rows: dict[int, list[int]], at_row) -> dict:
        """Draw every sampled row (SampleRows in the order of `rows`; their grammar masks
        are host work done while the device runs the step). at_row maps a plan row to its row
        of logits (None: the same). Returns seq id -> (tokens drawn at its rows, per-row
        logprob entries or None)."""
        order = []
        for sid, row_ids in rows.items():
            job, seq = self.jobs[sid], self.scheduler.sequences[sid]
            drafts = plan.tokens[row_ids[1:]].tolist()
            masks = self.grammar.masks(job, drafts)
            for i, r in enumerate(row_ids):
                pos = int(plan.positions[r]) + 1  # the index the drawn token will take
                order.append((sid, sample_row(
                    job, r if at_row is None else at_row[r], pos, _History(seq, pos),
                    None if masks is None else masks[i], self.shape)))
        tokens, mus, entries = [], [], []
        for batch in sample_batches([row for _, row in order], self.shape):
            drawn = self.runner.sample(logits, batch)
            tokens += drawn.tokens
            mus += drawn.mus
            entries += [drawn.logprobs.get(i) for i in range(batch.n)]
        out: dict[int, tuple[list[int], list | None]] = {}
        for i, (sid, _) in enumerate(order):
            job = self.jobs[sid]
            toks, lps = out.setdefault(sid, ([], [] if job.request.logprobs is not None else None))
            toks.append(tokens[i])
            if lps is not None:
                lps.append(entries[i])
            if len(toks) == 1:
                job.pending_mu = mus[i]
        return out

    def _finish(self, plan, rows: dict[int, list[int]], samples: dict, started: float,
                multi: bool = False) -> None:
        """Hand out a step's tokens (samples: seq id -> (tokens drawn at its rows, logprob
        entries or None)), advance the scheduler, end the requests that ended. multi: the
        step ran as decode steps, whose later rows took the drawn tokens."""
        accepted: dict[int, list[int]] = {}
        ending: dict[int, str] = {}
        over = self.grammar.over_budget
        for seq_id, row_ids in rows.items():
            job, (tokens, lps) = self.jobs[seq_id], samples[seq_id]
            if seq_id in over:
                continue
            draft = plan.tokens[row_ids[1:]].tolist() if len(row_ids) > 1 else []
            new = tokens if multi else accept(draft, tokens)
            seq = self.scheduler.sequences.get(seq_id)
            if seq is not None and seq.max_tokens is not None:   # decode steps' rows may pass it
                new = new[:max(1, seq.max_tokens - seq.n_decoded)]
            with self.grammar.work(job):
                keep, reason = job.take(new, lps[:len(new)] if lps else None)
            if seq_id in over:
                continue
            accepted[seq_id] = new[:keep] if reason is None else new[:max(keep, 1)]
            if reason is not None:
                ending[seq_id] = reason
        for seq_id in over:   # before complete(), which then skips them
            job = self.jobs.get(seq_id)
            if job is not None:
                job.fail(self.grammar.overrun_message(), busy=True)
                self.drop(seq_id)
        over.clear()
        if self.drafter is not None:
            self.drafter.follow(plan)
        self._count(plan, rows, accepted, time.perf_counter() - started, multi)
        finished = self.scheduler.complete(plan, accepted)
        released = self.scheduler.take_window_releases()   # a batch of them at a time
        for runner in (self.runner, self.drafter and self.drafter.runner):
            if runner is not None and released:
                runner.release_window_rows(released)
        for slot, key, position, tag in self.scheduler.take_state_saves():
            snapshots = tuple(runner.save_state(slot) for runner in self.stateful)
            if snapshots[0].position == position:   # (else accepted drafts await their replay)
                self.scheduler.snapshots.put(key, snapshots, tag)
        for seq in finished:
            ending.setdefault(seq.seq_id, seq.finish_reason or "length")
        for seq_id, reason in ending.items():
            job = self.jobs.get(seq_id)
            if job is not None:
                job.finish(reason, self.usage(seq_id))
                self.drop(seq_id)

    def _propose_drafts(self) -> None:
        if not self.config.speculative or self.config.max_draft == 0:
            return
        ready = []
        for seq in self.scheduler.running:
            job = self.jobs.get(seq.seq_id)
            if (job is not None and job.request.speculative and not job.request.params.mirostat
                    and seq.num_computed == len(seq.tokens) - 1):
                ready.append(seq)
        if self.drafter is not None and ready:
            drafts = self.drafter.propose(ready, self.scheduler.page_table(),
                                          self.config.max_draft)
        else:
            drafts = {s.seq_id: ngram_draft(s.tokens, self.config.max_draft) for s in ready}
        for seq_id, draft in drafts.items():
            job = self.jobs[seq_id]
            if job.matcher is not None:
                draft = self.grammar.draft_prefix(job, draft)
            if draft:
                self.scheduler.set_draft(seq_id, draft)

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
            self.counters["pages_to_host"] += len(pages)
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
            self.counters["pages_from_host"] += len(pages)

    def _count(self, plan, rows, accepted, seconds: float, multi: bool = False) -> None:
        c = self.counters
        decode_rows = sum(len(r) for r in rows.values())
        fill_rows = sum(ch.num_rows for ch in plan.chunks if ch.seq_id in self.prefills)
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

    def _image_inputs(self, plan) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(mask [n], embeddings [n, D], ends [n]) of the plan's image rows, or None without
        any: an image that attends both ways gives its rows its last position as their end."""
        found = []
        for c in plan.chunks:
            job = self.jobs.get(c.seq_id)
            for image in job.request.images if job is not None else ():
                lo, hi = max(image.start, c.start), min(image.end, c.start + c.num_rows)
                if lo < hi:
                    found.append((c.first_row + lo - c.start,
                                  image.embeddings[lo - image.start:hi - image.start],
                                  image.end - 1 if image.non_causal else None))
        if not found:
            return None
        mask = np.zeros(len(plan), np.int64)
        rows = np.zeros((len(plan), self.runner.model.config.d_model), np.float32)
        ends = plan.positions.astype(np.int64).copy()
        for row, embeddings, end in found:
            mask[row:row + len(embeddings)] = 1
            rows[row:row + len(embeddings)] = embeddings
            if end is not None:
                ends[row:row + len(embeddings)] = end
        return mask, rows, ends


class _History:
    """A sequence's tokens before position n, drafts included, copied only when read (a
    row's history is read only for penalties and DRY: sample_row)."""

    def __init__(self, seq: Sequence, n: int):
        self.seq, self.n = seq, n

    def __iter__(self):
        return iter((self.seq.tokens + self.seq.draft)[:self.n])


def answer(sink: Callable[[Prefilled], None], result: Prefilled) -> None:
    """Hand a prefill its result; a consumer that has gone (a closed event loop) is nobody
    to tell."""
    try:
        sink(result)
    except Exception:
        pass


def image_keys(images) -> dict[int, int]:
    """Position -> the value a prefix-cache key hashes for each image row: negative (never a
    token id), from the image's digest and the row's index in the image."""
    out = {}
    for image in images:
        base = int.from_bytes(image.digest[:5], "little") << 16   # under 2**56
        for i in range(len(image.embeddings)):
            out[image.start + i] = -1 - (base + i)
    return out
