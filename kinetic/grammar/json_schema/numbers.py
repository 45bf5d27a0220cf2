"""Integers and numbers between bounds, as canonical decimal text.

A bounded number is written without an exponent, an integer without ".0", zero as "0" (never
"-0"); fractional bounds are rounded inward to integers. A range of integers is a union of
same-length digit ranges, each a few character classes ("15".."120" is 15-19 | 2-9 d | 1 0-1 d |
120), so the grammar stays linear in the number of digits.
"""

from __future__ import annotations

import math

from kinetic.grammar.ir import EMPTY, Chars, Ref, Rep, alt, chars, lit, opt, seq
from kinetic.grammar.json_schema.limits import SchemaLimits, Unsatisfiable, too_large


def char_range(a: str, b: str | None = None):
    return Chars(((ord(a), ord(b or a)),))


DIGIT = char_range("0", "9")
NZ_DIGIT = char_range("1", "9")
HEX = chars([(48, 57), (65, 70), (97, 102)])
# Digits a number may run to where no bound says otherwise, as llama.cpp's converter
# bounds them (an integral part of up to 16 digits, a fraction of up to 16): a model that
# keeps writing digits would otherwise run on to max_tokens inside one number.
MAX_DIGITS = 16
INTEGRAL = alt(lit("0"), seq(NZ_DIGIT, Rep(DIGIT, 0, MAX_DIGITS - 1)))
FRAC_ANY = opt(seq(lit("."), Rep(DIGIT, 1, MAX_DIGITS)))
_FRAC_NONZERO = seq(lit("."), Rep(DIGIT, 0, MAX_DIGITS - 1), NZ_DIGIT,
                    Rep(DIGIT, 0, MAX_DIGITS - 1))
_FRAC_ZERO = opt(seq(lit("."), Rep(lit("0"), 1, MAX_DIGITS)))


def _digits(n: int):
    return Rep(DIGIT, n, n)


def same_len_range(a: str, b: str):
    """Digit strings of len(a) == len(b) between a and b (leading zeros allowed)."""
    if not a:
        return EMPTY
    if a[0] == b[0]:
        return seq(lit(a[0]), same_len_range(a[1:], b[1:]))
    rest = len(a) - 1
    out = []
    lo_d, hi_d = int(a[0]), int(b[0])
    if a[1:] == "0" * rest:
        first = lo_d
    else:
        out.append(seq(lit(a[0]), same_len_range(a[1:], "9" * rest)))
        first = lo_d + 1
    if b[1:] == "9" * rest:
        last = hi_d
        tail = None
    else:
        last = hi_d - 1
        tail = seq(lit(b[0]), same_len_range("0" * rest, b[1:]))
    if first <= last:
        out.append(seq(char_range(str(first), str(last)), _digits(rest)))
    if tail is not None:
        out.append(tail)
    return alt(*out)


def _nonneg_int(lo: int, hi: int | None):
    """Canonical decimal integers in lo..hi (hi None: unbounded), lo >= 0."""
    if hi is not None and hi < lo:
        return None
    out = []
    n_lo = len(str(lo))
    top = hi if hi is not None else 10 ** n_lo - 1
    for n in range(n_lo, len(str(top)) + 1):
        a = max(lo, 10 ** (n - 1) if n > 1 else 0)
        b = min(top, 10 ** n - 1)
        if a <= b:
            out.append(same_len_range(str(a).zfill(n), str(b)))
    if hi is None:   # longer than lo, up to MAX_DIGITS (or lo's own length)
        out.append(seq(NZ_DIGIT, Rep(DIGIT, n_lo, max(n_lo, MAX_DIGITS - 1))))
    return alt(*out)


def _int_range(lo: int | None, hi: int | None):
    out = []
    if lo is None or lo <= -1:
        neg_top = -1 if hi is None else min(hi, -1)
        if lo is None or lo <= neg_top:
            body = _nonneg_int(-neg_top, None if lo is None else -lo)
            if body is not None:
                out.append(seq(lit("-"), body))
    if hi is None or hi >= 0:
        body = _nonneg_int(max(lo, 0) if lo is not None else 0, hi)
        if body is not None:
            out.insert(0, body)
    return alt(*out) if out else None


def _nonneg_real(lo: int, lo_excl: bool, hi: int | None, hi_excl: bool):
    """Decimal numbers x >= 0 (no exponent) with lo <(=) x <(=) hi, lo and hi integers."""
    out = []
    start = lo
    if lo_excl:
        if hi is None or lo < hi:
            out.append(seq(lit(str(lo)), _FRAC_NONZERO))
        start = lo + 1
    if hi is None:
        out.append(seq(_nonneg_int(start, None), FRAC_ANY))
    else:
        if start <= hi - 1:
            out.append(seq(_nonneg_int(start, hi - 1), FRAC_ANY))
        if not hi_excl and hi >= start and hi >= lo:
            out.append(seq(lit(str(hi)), _FRAC_ZERO))
    return alt(*out) if out else None


def _real_range(lo, lo_excl, hi, hi_excl):
    out = []
    # x >= 0 part
    if hi is None or hi > 0 or (hi == 0 and not hi_excl):
        if lo is None or lo < 0:
            part = _nonneg_real(0, False, hi, hi_excl)
        else:
            part = _nonneg_real(lo, lo_excl, hi, hi_excl)
        if part is not None:
            out.append(part)
    # x < 0 part, as -y with y > 0
    if lo is None or lo < 0:
        if hi is None or hi >= 0:
            y_lo, y_lo_excl = 0, True
        else:
            y_lo, y_lo_excl = -hi, hi_excl
        part = _nonneg_real(y_lo, y_lo_excl, None if lo is None else -lo, lo_excl)
        if part is not None:
            out.append(seq(lit("-"), part))
    return alt(*out) if out else None


def number(s: dict, path: str, integer: bool, limits: SchemaLimits):
    """The grammar of an integer or number schema's values: minimum, maximum and the exclusive
    bounds (a number, or draft 4's flag on minimum/maximum; check.py saw their types)."""
    lo, lo_excl, lo_key = s.get("minimum"), False, "minimum"
    hi, hi_excl, hi_key = s.get("maximum"), False, "maximum"
    emin, emax = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    if isinstance(emin, bool):   # draft 4: a flag on minimum
        lo_excl = emin and lo is not None
    elif emin is not None and (lo is None or emin >= lo):
        lo, lo_excl, lo_key = emin, True, "exclusiveMinimum"
    if isinstance(emax, bool):
        hi_excl = emax and hi is not None
    elif emax is not None and (hi is None or emax <= hi):
        hi, hi_excl, hi_key = emax, True, "exclusiveMaximum"
    if lo is None and hi is None:
        return Ref("json-integer" if integer else "json-number")
    # Bounds past number_digits digits: an outer one is narrowed to the largest number of that
    # many digits (sound: fewer values; 1.8e308, a double's maximum, is a common bound); an
    # inner one would need numbers that long, and is refused.
    big = 10 ** limits.number_digits - 1
    if hi is not None and hi > big:
        hi, hi_excl = big, False
    if lo is not None and lo < -big:
        lo, lo_excl = -big, False
    for v, k in ((lo, lo_key), (hi, hi_key)):
        if v is not None and abs(v) > big:
            raise too_large(limits, "number_digits", k, f"{path}/{k}",
                            f"has {len(str(int(abs(v))))} digits")
    if integer:
        ilo = None if lo is None else (math.floor(lo) + 1 if lo_excl else math.ceil(lo))
        ihi = None if hi is None else (math.ceil(hi) - 1 if hi_excl else math.floor(hi))
        r = _int_range(ilo, ihi)
        if r is None:
            raise Unsatisfiable("integer bounds that admit no value", path)
        return r
    # fractional bounds are narrowed inward to integers: every answer stays valid
    if lo is not None and not float(lo).is_integer():
        lo, lo_excl = math.ceil(lo), False
    if hi is not None and not float(hi).is_integer():
        hi, hi_excl = math.floor(hi), False
    r = _real_range(None if lo is None else int(lo), lo_excl,
                    None if hi is None else int(hi), hi_excl)
    if r is None:
        raise Unsatisfiable("number bounds that admit no value", path)
    return r
