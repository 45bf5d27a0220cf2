"""Structured output: grammars (GBNF, JSON Schema) compiled to byte-level rules, and per-step
token masks computed along a token trie.

    grammar = compile_json_schema({"type": "object", ...})    # or compile_gbnf(text)
    vocab = TokenVocab.from_tokenizer(tokenizer)             # once per tokenizer
    m = Matcher(grammar, vocab)
    m.fill_mask(bitmask[row])    # int32 (ceil(vocab / 32)); bit i set: token i allowed
    m.accept_token(token_id)     # False if the grammar rejects it
    m.rollback(n)                # undo n accepted tokens (speculative drafts)
    m.can_end()                  # EOS/EOG allowed now

GrammarError (GBNF syntax, with line and column) and UnsupportedSchema (naming the keyword and
its JSON pointer) are ValueErrors: the API answers them with 400. Grammar work runs under a
time budget set with `mask_budget(seconds)` (MaskBudgetExceeded past it); GrammarTooCostly is
the engine's 400 for a grammar whose first mask overruns it (Engine.prepare_grammar).
"""

from kinetic.grammar.gbnf import compile_gbnf
from kinetic.grammar.ir import Grammar, GrammarError
from kinetic.grammar.json_schema import UnsupportedSchema, compile_json_schema
from kinetic.grammar.matcher import (GrammarTooCostly, MaskBudgetExceeded, Matcher, TokenVocab,
                                     mask_budget)

__all__ = ["compile_gbnf", "compile_json_schema", "Grammar", "GrammarError", "GrammarTooCostly",
           "MaskBudgetExceeded", "Matcher", "TokenVocab", "UnsupportedSchema", "mask_budget"]
