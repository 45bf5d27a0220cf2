"""What JSONSchemaBench needs of each SchemaLimits field: the smallest value with which the
sample (tests/data/jsonschemabench) compiles exactly as with the defaults, the same schemas
compiled and the same refusals. These are the sample's maxima that docs/server.md quotes;
for the narrowing side of a limit (a long `maximum`, a large `maxLength`), which never refuses,
the smallest value is only where a refusal would start (number_digits reads 4: the sample's
longest bound, 16 digits, is an upper bound, which a smaller limit narrows instead).

    python scripts/schema_limits.py              # every limit (a few minutes)
    python scripts/schema_limits.py enum_values  # some
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import sys

from kinetic.grammar.json_schema import LIMITS, UnsupportedSchema, compile_json_schema

BENCH = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "jsonschemabench")


def outcome(schemas, limits) -> dict[str, str]:
    out = {}
    for name, schema in schemas:
        try:
            compile_json_schema(schema, limits)
            out[name] = "compiled"
        except UnsupportedSchema as e:
            out[name] = str(e)
    return out


def needed(schemas, field: str, base: dict) -> int:
    lo, hi = 1, getattr(LIMITS, field)
    while lo < hi:
        mid = (lo + hi) // 2
        if outcome(schemas, dataclasses.replace(LIMITS, **{field: mid})) == base:
            hi = mid
        else:
            lo = mid + 1
    return lo


def main(names: list[str]) -> None:
    schemas = []
    for path in sorted(glob.glob(os.path.join(BENCH, "*.json"))):
        with open(path) as f:
            schemas.append((os.path.basename(path), json.load(f)))
    base = outcome(schemas, LIMITS)
    done = sum(v == "compiled" for v in base.values())
    print(f"{done} of {len(schemas)} schemas compile with the default limits")
    for field in names or [f.name for f in dataclasses.fields(LIMITS)]:
        print(f"{field:14} needs {needed(schemas, field, base):>7}   "
              f"(default {getattr(LIMITS, field)})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
