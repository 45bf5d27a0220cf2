"""The `format` values a grammar enforces, each a subset of its syntax (every text it accepts
is valid; not every valid text is accepted): dates without 29 February, ipv6 in full form,
hostnames of up to 4 labels of up to 62 characters, URIs whose host is a registered name."""

from __future__ import annotations

from kinetic.grammar.ir import Rep, alt, chars, lit, opt, seq, star
from kinetic.grammar.json_schema.numbers import (DIGIT, HEX, NZ_DIGIT, char_range,
                                                 same_len_range)

_two = same_len_range   # two digits between lo and hi

_DATE = seq(same_len_range("0001", "9999"), lit("-"), alt(
    seq(alt(*(lit(m) for m in ("01", "03", "05", "07", "08", "10", "12"))), lit("-"),
        _two("01", "31")),
    seq(alt(*(lit(m) for m in ("04", "06", "09", "11"))), lit("-"), _two("01", "30")),
    seq(lit("02-"), _two("01", "28"))))
_TIME = seq(_two("00", "23"), lit(":"), _two("00", "59"), lit(":"), _two("00", "59"),
            opt(seq(lit("."), Rep(DIGIT, 1, 9))),
            alt(lit("Z"), seq(chars([(43, 43), (45, 45)]), _two("00", "23"), lit(":"),
                              _two("00", "59"))))
_ALNUM = chars([(48, 57), (65, 90), (97, 122)])
_LABEL = seq(_ALNUM, opt(seq(Rep(chars([(45, 45), (48, 57), (65, 90), (97, 122)]), 0, 60),
                             _ALNUM)))   # 1 to 62 characters
_HOSTNAME = seq(_LABEL, Rep(seq(lit("."), _LABEL), 0, 3))   # at most 251 characters
_LOCAL = Rep(chars([(48, 57), (65, 90), (97, 122), (95, 95), (37, 37), (43, 43), (45, 45)]), 1,
             None)
_EMAIL = seq(_LOCAL, star(seq(lit("."), _LOCAL)), lit("@"), _LABEL,
             Rep(seq(lit("."), _LABEL), 1, None))
_OCTET = alt(seq(lit("25"), char_range("0", "5")),
             seq(lit("2"), char_range("0", "4"), DIGIT), seq(lit("1"), DIGIT, DIGIT),
             seq(NZ_DIGIT, DIGIT), DIGIT)
_IPV4 = seq(_OCTET, Rep(seq(lit("."), _OCTET), 3, 3))
_H16 = Rep(HEX, 1, 4)
_IPV6 = seq(_H16, Rep(seq(lit(":"), _H16), 7, 7))
_UUID = seq(Rep(HEX, 8, 8), lit("-"), Rep(HEX, 4, 4), lit("-"), Rep(HEX, 4, 4), lit("-"),
            Rep(HEX, 4, 4), lit("-"), Rep(HEX, 12, 12))
# URIs (RFC 3986), a subset: a host is a registered name (no user or port)
_SUB = [(48, 57), (65, 90), (97, 122)] + [(ord(c), ord(c)) for c in "-._~!$&'()*+,;="]
_PCT = seq(lit("%"), HEX, HEX)
_PCHAR_NC = alt(chars(_SUB + [(64, 64)]), _PCT)               # no ':'
_PCHAR = alt(chars(_SUB + [(58, 58), (64, 64)]), _PCT)
_SEGMENTS = star(seq(lit("/"), star(_PCHAR)))
_AUTHORITY_PATH = seq(lit("//"), star(alt(chars(_SUB), _PCT)), _SEGMENTS)
_ABSOLUTE_PATH = seq(lit("/"), opt(seq(Rep(_PCHAR, 1, None), _SEGMENTS)))
_QUERY_FRAGMENT = seq(opt(seq(lit("?"), star(alt(_PCHAR, chars([(47, 47), (63, 63)]))))),
                      opt(seq(lit("#"), star(alt(_PCHAR, chars([(47, 47), (63, 63)]))))))
_SCHEME = seq(chars([(65, 90), (97, 122)]), star(chars([(48, 57), (65, 90), (97, 122),
                                                         (43, 43), (45, 46)])))
_URI = seq(_SCHEME, lit(":"), alt(_AUTHORITY_PATH, _ABSOLUTE_PATH,
                                  opt(seq(Rep(_PCHAR, 1, None), _SEGMENTS))), _QUERY_FRAGMENT)
_URI_REF = alt(_URI, seq(alt(_AUTHORITY_PATH, _ABSOLUTE_PATH,
                             opt(seq(Rep(_PCHAR_NC, 1, None), _SEGMENTS))), _QUERY_FRAGMENT))
FORMATS = {"date": _DATE, "time": _TIME, "date-time": seq(_DATE, lit("T"), _TIME),
           "uuid": _UUID, "email": _EMAIL, "hostname": _HOSTNAME, "ipv4": _IPV4,
           "ipv6": _IPV6, "uri": _URI, "uri-reference": _URI_REF}
