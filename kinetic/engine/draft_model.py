"""Speculative drafts from a smaller model of the same vocabulary (`-md`).

The draft model keeps its own KV cache with exactly the target's page geometry, indexed by
the same page ids: it runs every row the target runs (`follow`), so wherever the target's
cache is valid, the draft's is too, prefix-cache hits included. To propose, it decodes
greedily from each caught-up sequence's newest token for up to `max_draft` tokens, writing
into that sequence's own pages (positions past its allocated pages go to the reserved page
and only make later drafts worse, never answers wrong: verification is exact).
"""

from __future__ import annotations

import numpy as np

from kinetic.engine.runner import RESERVED_PAGE, Runner, RunnerConfig
from kinetic.model.loader import LoadedModel


class DraftModelError(ValueError):
    """The draft model cannot draft for this target (different vocabulary)."""


class DraftModel:
    def __init__(self, model: LoadedModel, target: LoadedModel, runner_config: RunnerConfig):
        mine = model.file.get("tokenizer.ggml.tokens") or []
        theirs = target.file.get("tokenizer.ggml.tokens") or []
        n = min(len(mine), len(theirs))
        if n == 0 or mine[:n] != theirs[:n] or model.config.vocab_size > target.config.vocab_size:
            raise DraftModelError(f"the draft model {model.file.path} does not share the "
                                  f"target's vocabulary")
        self.runner = Runner(model, runner_config, role="draft")

    def follow(self, plan) -> None:
        """Run the target step's rows, so the draft cache holds what the target's holds."""
        self.runner.step_device(plan.tokens, plan.positions, plan.slots, plan.write_index,
                                plan.page_table, [] if self.runner.exact_rows else None,
                                plan.draft_rows)

    def propose(self, sequences: list, page_table: np.ndarray, max_draft: int) -> dict[int, list[int]]:
        """Greedy drafts for caught-up sequences (scheduler Sequences with a slot and pages):
        seq id -> up to max_draft tokens, capped by each sequence's room in the context."""
        cfg = self.runner.config
        T, ps = cfg.step_tokens, cfg.page_size
        seqs = sequences[:T]
        # a recurrent draft model: its states are put back as they were after proposing (the
        # proposals are guesses; the next step's rows continue from the newest token)
        kept = ({s.slot: self.runner.save_state(s.slot) for s in seqs}
                if self.runner.state is not None else {})
        drafts: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
        last = {s.seq_id: s.tokens[-1] for s in seqs}
        for i in range(max_draft):
            live = [s for s in seqs if len(s.tokens) - 1 + i < cfg.max_context - 1]
            if not live:
                break
            pos = np.array([len(s.tokens) - 1 + i for s in live])
            page_idx = pos // ps
            pages = np.array([s.pages[p] if p < len(s.pages) else RESERVED_PAGE
                              for s, p in zip(live, page_idx)])
            write = pages * ps + pos % ps
            logits = self.runner.step_device(
                np.array([last[s.seq_id] for s in live]), pos,
                np.array([s.slot for s in live]), write, page_table)
            picks = self.runner.argmax_rows(logits, len(live))
            for s, t in zip(live, picks):
                drafts[s.seq_id].append(int(t))
                last[s.seq_id] = int(t)
        for slot, snapshot in kept.items():   # (proposing wrote no pending inputs)
            self.runner.load_state(slot, snapshot, pending=True)
        return {k: v for k, v in drafts.items() if v}
