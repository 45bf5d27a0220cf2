#include "float_json.h"

#include <charconv>
#include <cmath>
#include <cstring>

namespace kn {

namespace {

// One value as Python's repr(float) writes it; returns the characters written (at most 25).
// std::to_chars gives the shortest digits that round-trip, the closest to the value when
// several do (as Python's dtoa mode 0 does); the layout around them is Python's.
size_t write_double(double v, char* out) {
  char sci[32];
  const auto res = std::to_chars(sci, sci + sizeof sci, v, std::chars_format::scientific);
  const char* p = sci;
  char* o = out;
  if (*p == '-') *o++ = *p++;
  // the scientific text is d[.ddd]e(+|-)XX: gather the digits and the exponent
  char digits[20];
  size_t nd = 0;
  for (; *p != 'e'; ++p)
    if (*p != '.') digits[nd++] = *p;
  ++p;   // past 'e'
  const bool negative_exp = *p++ == '-';
  int exp = 0;
  for (; p < res.ptr; ++p) exp = exp * 10 + (*p - '0');
  if (negative_exp) exp = -exp;
  const int point = exp + 1;   // digits before the decimal point (Python's decpt)
  if (point > -4 && point <= 16) {   // fixed notation
    if (point <= 0) {
      *o++ = '0';
      *o++ = '.';
      for (int i = 0; i < -point; ++i) *o++ = '0';
      std::memcpy(o, digits, nd);
      o += nd;
    } else if (size_t(point) < nd) {
      std::memcpy(o, digits, size_t(point));
      o += point;
      *o++ = '.';
      std::memcpy(o, digits + point, nd - size_t(point));
      o += nd - size_t(point);
    } else {
      std::memcpy(o, digits, nd);
      o += nd;
      for (size_t i = nd; i < size_t(point); ++i) *o++ = '0';
      *o++ = '.';
      *o++ = '0';
    }
  } else {   // d[.ddd]e(+|-)XX, at least two exponent digits
    *o++ = digits[0];
    if (nd > 1) {
      *o++ = '.';
      std::memcpy(o, digits + 1, nd - 1);
      o += nd - 1;
    }
    *o++ = 'e';
    *o++ = exp < 0 ? '-' : '+';
    const int mag = exp < 0 ? -exp : exp;
    if (mag < 10) *o++ = '0';
    o = std::to_chars(o, o + 4, mag).ptr;
  }
  return size_t(o - out);
}

}  // namespace

int64_t json_floats(const float* x, size_t n, char* out) {
  char* o = out;
  *o++ = '[';
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return -1;
    if (i) *o++ = ',';
    o += write_double(double(x[i]), o);
  }
  *o++ = ']';
  return int64_t(o - out);
}

}  // namespace kn
