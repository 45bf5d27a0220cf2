"""The keyword list and the limits as text, rendered from the keyword table and SchemaLimits.

The package docstring and docs/server.md hold this text between markers, and
tests/test_json_schema.py checks that they still do, so neither can drift from the table.
`python -m kinetic.grammar.json_schema.docs` prints it; with `--write` it rewrites the marked
blocks of docs/server.md (and the package docstring).
"""

from __future__ import annotations

import re
import sys
import textwrap
from dataclasses import fields
from pathlib import Path

from kinetic.grammar.json_schema.keywords import (ANNOTATION, CONTAINER, ENFORCED, PARTIAL,
                                                  REFUSED, TABLE, VALUES)
from kinetic.grammar.json_schema.limits import LIMITS

WIDTH = 96
_GROUPS = (("Any value", None), ("Objects", "object"), ("Arrays", "array"),
           ("Strings", "string"), ("Numbers", "number"))


def _bullet(text: str) -> str:
    return textwrap.fill(text, WIDTH, initial_indent="- ", subsequent_indent="  ",
                         break_long_words=False, break_on_hyphens=False)


def _named(name: str, note: str) -> str:
    return f"`{name}` ({note})" if note else f"`{name}`"


def keyword_list() -> str:
    """What is enforced, refused and narrowed, the values' types, and what is ignored, one
    bullet each (Markdown)."""
    out = []
    for title, type_ in _GROUPS:
        kws = [k for k in TABLE if k.type == type_ and k.kind in (ENFORCED, PARTIAL, CONTAINER)]
        notes = [_named(k.name, k.enforced if k.kind != CONTAINER else "`$ref` targets")
                 for k in kws]
        out.append(_bullet(f"{title}: " + ", ".join(notes) + "."))
    refused = [_named(k.name, k.refused) for k in TABLE if k.kind in (REFUSED, PARTIAL)
               and k.refused]
    out.append(_bullet("Refused, a 400 naming the keyword and its JSON pointer: "
                       + "; ".join(refused) + "."))
    narrowed = [f"`{k.name}`: {k.narrowed}" for k in TABLE if k.narrowed]
    out.append(_bullet("Narrowed (the grammar may accept fewer texts than the schema, never "
                       "more; numbers are written canonically, \"0\" not \"-0\", integers "
                       "without \".0\", and, where no bound needs more, with at most 16 "
                       "digits before the point, after it and in the exponent, as llama.cpp's "
                       "converter writes them): " + "; ".join(narrowed) + "."))
    types = [", ".join(f"`{k.name}`" for k in TABLE if k.value == name) + f": {v.must}"
             for name, v in VALUES.items() if name != "any" and any(
                 k.value == name for k in TABLE)]
    out.append(_bullet("Values, as the meta-schemas of drafts 4 to 2020-12 type them (else a "
                       "400 naming the keyword, what it must be and the JSON pointer of the "
                       "value): " + "; ".join(types) + "; any value for the others."))
    ignored = [f"`{k.name}`" for k in TABLE if k.kind == ANNOTATION]
    out.append(_bullet("Ignored, as JSON Schema ignores them: " + ", ".join(ignored)
                       + ", and every keyword not listed here."))
    return "\n".join(out)


def limit_list() -> str:
    """The SchemaLimits fields, their default values and what they bound (a Markdown table)."""
    rows = ["| limit | value | what it bounds |", "|---|---|---|"]
    for f in fields(LIMITS):
        rows.append(f"| `{f.name}` | {getattr(LIMITS, f.name)} | {f.metadata['doc']} |")
    return "\n".join(rows)


BLOCKS = {"json-schema-keywords": keyword_list, "json-schema-limits": limit_list}


def marked(text: str, block: str) -> str | None:
    """The text between `<!-- block -->` and `<!-- /block -->` in `text`, or None."""
    m = re.search(rf"<!-- {block} -->\n(.*?)<!-- /{block} -->", text, re.S)
    return m.group(1).removesuffix("\n") if m else None


def rewrite(text: str) -> str:
    """`text` with every marked block replaced by its rendering."""
    for block, render in BLOCKS.items():
        text = re.sub(rf"(<!-- {block} -->\n).*?(<!-- /{block} -->)",
                      lambda m, r=render: m.group(1) + r() + "\n" + m.group(2), text,
                      flags=re.S)
    return text


def main(argv: list[str]) -> None:
    if "--write" not in argv:
        print(keyword_list(), limit_list(), sep="\n\n")
        return
    root = Path(__file__).resolve().parents[3]
    for path in (root / "docs" / "server.md", Path(__file__).with_name("__init__.py")):
        old = path.read_text()
        new = rewrite(old)
        if new != old:
            path.write_text(new)
            print(f"rewrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
