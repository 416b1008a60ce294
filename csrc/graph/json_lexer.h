// A strict (RFC 8259) pull lexer that load_ir reads the IR through, straight into a Document.
// Internal to ce_graph: going through nlohmann's DOM (a std::map per object) took 130-240 ms for a
// 15k-node file, this path ~30 ms.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace ce_overlap::detail {

// Malformed text at `byte` (0-based); load_ir turns it into IrError("malformed JSON: ...").
struct JsonSyntaxError {
  size_t byte = 0;
  std::string message;
};

struct JsonNumber {
  enum class Type { Int, UInt, Float } type = Type::Int;  // like nlohmann: integers >= 0 are UInt
  int64_t i = 0;
  uint64_t u = 0;
  double d = 0;
};

class JsonLexer {
 public:
  explicit JsonLexer(std::string_view text);

  // The first non-whitespace character, or '\0' at the end of the text.
  char peek() {
    skip_ws();
    return p_ == end_ ? '\0' : *p_;
  }
  bool at_end() { return peek() == '\0' && p_ == end_; }
  size_t offset() const { return static_cast<size_t>(p_ - begin_); }
  void seek(size_t offset) { p_ = begin_ + offset; }

  // Each reads one value of that type at the current position (after whitespace).
  // The view points into the text, or into `scratch` when the string had escapes.
  std::string_view string(std::string& scratch);
  JsonNumber number();
  nlohmann::json value();  // any value, for free-form meta and for describing a wrongly typed one
  void skip_value();       // checks syntax, builds nothing

  // At an object: skips members until `key`, leaving the position at its value (true), or
  // consumes the whole object (false).
  bool seek_member(std::string_view key);

  // Calls on_member(std::string_view key) for each member; the callback must consume the value.
  // The key view may point into a scratch buffer: use it before reading the value.
  template <class F>
  void object(F&& on_member) {
    expect('{');
    if (peek() == '}') {
      ++p_;
      return;
    }
    while (true) {
      if (peek() != '"') fail("expected a string as an object key");
      const std::string_view key = string(key_scratch_);
      expect(':');
      on_member(key);
      const char c = peek();
      if (c != ',' && c != '}') fail("expected ',' or '}' after an object member");
      ++p_;
      if (c == '}') return;
    }
  }

  // Calls on_element(size_t index) for each element; the callback must consume the element.
  template <class F>
  void array(F&& on_element) {
    expect('[');
    if (peek() == ']') {
      ++p_;
      return;
    }
    for (size_t i = 0;; ++i) {
      on_element(i);
      const char c = peek();
      if (c != ',' && c != ']') fail("expected ',' or ']' after an array element");
      ++p_;
      if (c == ']') return;
    }
  }

  [[noreturn]] void fail(const std::string& message) const;

 private:
  void skip_ws() {
    while (p_ != end_ && (*p_ == ' ' || *p_ == '\n' || *p_ == '\r' || *p_ == '\t')) ++p_;
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++p_;
  }
  void literal(const char* word);
  void skip_utf8_sequence();
  unsigned read_hex4();
  nlohmann::json value_at_depth(int depth);
  void skip_value_at_depth(int depth);

  const char* p_;
  const char* begin_;
  const char* end_;
  std::string key_scratch_;
  std::string skip_scratch_;
};

}  // namespace ce_overlap::detail
