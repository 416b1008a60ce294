// Strict JSON pull lexer behind load_ir. It accepts exactly what nlohmann::json::parse accepts
// (RFC 8259, UTF-8 checked, no comments, a leading BOM skipped) but builds nothing it is not asked for.
// Why ours and not nlohmann's SAX interface (measured 2026-12-02, bench/results/json-sax-2026-12-02): on a
// 14,792-node IR (5.1 MiB) load_ir takes 17.8-18.7 ms, nlohmann::json::sax_parse with a handler that builds nothing
// 29.8-32.5 ms (1.66-1.83x), json::parse 88-93 ms: a SAX loader would cost at least 1.66x, over the 1.2x allowed.
#include "json_lexer.h"

#include "graph_internal.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace ce_overlap::detail {
namespace {

constexpr int kMaxDepth = 512;  // the IR nests 8 deep; this only guards the stack

constexpr uint64_t kOnes = 0x0101010101010101ull;
constexpr uint64_t kHighs = 0x8080808080808080ull;

// True if any of the 8 bytes of `x` is '"', '\\', a control character or non-ASCII: the bytes a
// string scan has to stop at. Lets the common case (plain ASCII) advance 8 bytes per step.
inline bool needs_attention(uint64_t x) {
  auto has_zero = [](uint64_t v) { return ((v - kOnes) & ~v & kHighs) != 0; };
  const bool quote = has_zero(x ^ (kOnes * '"'));
  const bool backslash = has_zero(x ^ (kOnes * '\\'));
  const bool control = ((x - kOnes * 0x20) & ~x & kHighs) != 0;
  return quote || backslash || control || (x & kHighs) != 0;
}

void append_utf8(std::string& out, unsigned cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

JsonLexer::JsonLexer(std::string_view text)
    : p_(text.data()), begin_(text.data()), end_(text.data() + text.size()) {
  if (text.size() >= 3 && std::memcmp(p_, "\xEF\xBB\xBF", 3) == 0) p_ += 3;
}

void JsonLexer::fail(const std::string& message) const { throw JsonSyntaxError{offset(), message}; }

void JsonLexer::literal(const char* word) {
  const size_t n = std::strlen(word);
  if (static_cast<size_t>(end_ - p_) < n || std::memcmp(p_, word, n) != 0) fail("invalid literal");
  p_ += n;
}

// Validates one multi-byte UTF-8 sequence at p_ (Unicode Table 3-7) and steps over it.
void JsonLexer::skip_utf8_sequence() {
  const size_t len = utf8_sequence_length(reinterpret_cast<const unsigned char*>(p_), static_cast<size_t>(end_ - p_));
  if (len == 0) fail("invalid UTF-8 in a string");
  p_ += len;
}

size_t utf8_sequence_length(const unsigned char* p, size_t available) {
  const unsigned char c = p[0];
  size_t extra;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    extra = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    extra = 2;
    if (c == 0xE0) lo = 0xA0;  // overlong
    if (c == 0xED) hi = 0x9F;  // surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    extra = 3;
    if (c == 0xF0) lo = 0x90;  // overlong
    if (c == 0xF4) hi = 0x8F;  // beyond U+10FFFF
  } else {
    return 0;
  }
  if (available <= extra) return 0;
  if (p[1] < lo || p[1] > hi) return 0;
  for (size_t k = 2; k <= extra; ++k) {
    if (p[k] < 0x80 || p[k] > 0xBF) return 0;
  }
  return extra + 1;
}

unsigned JsonLexer::read_hex4() {
  if (end_ - p_ < 4) fail("invalid \\u escape; expected 4 hex digits");
  unsigned value = 0;
  for (int k = 0; k < 4; ++k) {
    const int digit = hex_digit(p_[k]);
    if (digit < 0) fail("invalid \\u escape; expected 4 hex digits");
    value = value * 16 + static_cast<unsigned>(digit);
  }
  p_ += 4;
  return value;
}

std::string_view JsonLexer::string(std::string& scratch) {
  if (peek() != '"') fail("expected a string");
  ++p_;
  const char* start = p_;
  // Fast path: no escapes, so the string is a slice of the input.
  while (true) {
    while (end_ - p_ >= 8) {
      uint64_t chunk;
      std::memcpy(&chunk, p_, 8);
      if (needs_attention(chunk)) break;
      p_ += 8;
    }
    if (p_ == end_) fail("unterminated string");
    const auto c = static_cast<unsigned char>(*p_);
    if (c == '"') {
      const std::string_view s(start, static_cast<size_t>(p_ - start));
      ++p_;
      return s;
    }
    if (c == '\\') break;
    if (c < 0x20) fail("control character in a string; it must be escaped");
    if (c < 0x80) {
      ++p_;
    } else {
      skip_utf8_sequence();
    }
  }
  // Slow path: unescape into scratch.
  scratch.assign(start, static_cast<size_t>(p_ - start));
  while (true) {
    if (p_ == end_) fail("unterminated string");
    const auto c = static_cast<unsigned char>(*p_);
    if (c == '"') {
      ++p_;
      return scratch;
    }
    if (c < 0x20) fail("control character in a string; it must be escaped");
    if (c >= 0x80) {
      const char* seq = p_;
      skip_utf8_sequence();
      scratch.append(seq, static_cast<size_t>(p_ - seq));
      continue;
    }
    if (c != '\\') {
      scratch += static_cast<char>(c);
      ++p_;
      continue;
    }
    ++p_;
    if (p_ == end_) fail("unterminated string");
    switch (*p_++) {
      case '"': scratch += '"'; break;
      case '\\': scratch += '\\'; break;
      case '/': scratch += '/'; break;
      case 'b': scratch += '\b'; break;
      case 'f': scratch += '\f'; break;
      case 'n': scratch += '\n'; break;
      case 'r': scratch += '\r'; break;
      case 't': scratch += '\t'; break;
      case 'u': {
        unsigned cp = read_hex4();
        if (cp >= 0xDC00 && cp <= 0xDFFF) fail("invalid \\u escape; a low surrogate without a high one");
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          if (end_ - p_ < 2 || p_[0] != '\\' || p_[1] != 'u') {
            fail("invalid \\u escape; a high surrogate must be followed by a low one");
          }
          p_ += 2;
          const unsigned low = read_hex4();
          if (low < 0xDC00 || low > 0xDFFF) fail("invalid \\u escape; a high surrogate must be followed by a low one");
          cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
        }
        append_utf8(scratch, cp);
        break;
      }
      default:
        --p_;
        fail("invalid escape in a string");
    }
  }
}

JsonNumber JsonLexer::number() {
  const char c0 = peek();
  if (c0 != '-' && (c0 < '0' || c0 > '9')) fail("expected a number");
  const char* start = p_;
  if (*p_ == '-') ++p_;
  if (p_ == end_ || *p_ < '0' || *p_ > '9') fail("invalid number; expected a digit");
  if (*p_ == '0') {
    ++p_;
  } else {
    while (p_ != end_ && *p_ >= '0' && *p_ <= '9') ++p_;
  }
  bool is_integer = true;
  if (p_ != end_ && *p_ == '.') {
    is_integer = false;
    ++p_;
    if (p_ == end_ || *p_ < '0' || *p_ > '9') fail("invalid number; expected a digit after '.'");
    while (p_ != end_ && *p_ >= '0' && *p_ <= '9') ++p_;
  }
  if (p_ != end_ && (*p_ == 'e' || *p_ == 'E')) {
    is_integer = false;
    ++p_;
    if (p_ != end_ && (*p_ == '+' || *p_ == '-')) ++p_;
    if (p_ == end_ || *p_ < '0' || *p_ > '9') fail("invalid number; expected a digit in the exponent");
    while (p_ != end_ && *p_ >= '0' && *p_ <= '9') ++p_;
  }
  JsonNumber n;
  if (is_integer) {
    // As nlohmann: non-negative integers unsigned, negative signed, beyond 64 bits a float.
    if (*start == '-') {
      if (std::from_chars(start, p_, n.i).ec == std::errc()) {
        n.type = JsonNumber::Type::Int;
        return n;
      }
    } else if (std::from_chars(start, p_, n.u).ec == std::errc()) {
      n.type = JsonNumber::Type::UInt;
      return n;
    }
  }
  n.type = JsonNumber::Type::Float;
  if (std::from_chars(start, p_, n.d).ec == std::errc::result_out_of_range) {
    // from_chars leaves the value alone when out of range; strtod tells overflow (inf, refused
    // below as nlohmann does) from underflow (0 or a denormal, accepted).
    n.d = std::strtod(std::string(start, p_).c_str(), nullptr);
  }
  if (!std::isfinite(n.d)) {
    p_ = start;
    fail("number overflow");
  }
  return n;
}

nlohmann::json JsonLexer::value() { return value_at_depth(0); }

nlohmann::json JsonLexer::value_at_depth(int depth) {
  if (depth > kMaxDepth) fail("nesting deeper than 512 levels");
  switch (peek()) {
    case '{': {
      nlohmann::json out = nlohmann::json::object();
      object([&](std::string_view key) {
        std::string k(key);
        out[std::move(k)] = value_at_depth(depth + 1);  // a repeated key keeps the last value, as nlohmann does
      });
      return out;
    }
    case '[': {
      nlohmann::json out = nlohmann::json::array();
      array([&](size_t) { out.push_back(value_at_depth(depth + 1)); });
      return out;
    }
    case '"': {
      std::string scratch;
      return std::string(string(scratch));
    }
    case 't': literal("true"); return true;
    case 'f': literal("false"); return false;
    case 'n': literal("null"); return nullptr;
    default: {
      const JsonNumber n = number();
      if (n.type == JsonNumber::Type::Int) return n.i;
      if (n.type == JsonNumber::Type::UInt) return n.u;
      return n.d;
    }
  }
}

void JsonLexer::skip_value() { skip_value_at_depth(0); }

void JsonLexer::skip_value_at_depth(int depth) {
  if (depth > kMaxDepth) fail("nesting deeper than 512 levels");
  switch (peek()) {
    case '{': object([&](std::string_view) { skip_value_at_depth(depth + 1); }); return;
    case '[': array([&](size_t) { skip_value_at_depth(depth + 1); }); return;
    case '"': string(skip_scratch_); return;
    case 't': literal("true"); return;
    case 'f': literal("false"); return;
    case 'n': literal("null"); return;
    default: number(); return;
  }
}

bool JsonLexer::seek_member(std::string_view key) {
  expect('{');
  if (peek() == '}') {
    ++p_;
    return false;
  }
  while (true) {
    if (peek() != '"') fail("expected a string as an object key");
    const std::string_view k = string(key_scratch_);
    expect(':');
    if (k == key) return true;
    skip_value();
    const char c = peek();
    if (c != ',' && c != '}') fail("expected ',' or '}' after an object member");
    ++p_;
    if (c == '}') return false;
  }
}

}  // namespace ce_overlap::detail
