// Reading a JSON object field by field with messages that name the field (profile.cc, shapes.cc): every key known,
// every value checked. Internal to the cost model's loaders.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>

#include <nlohmann/json.hpp>

#include "../graph/ir.h"

namespace ce_overlap {
namespace json_reader {

using nlohmann::json;

// A short rendering of a JSON value for error messages; long values are cut so a message stays one line.
inline std::string describe(const json& v) {
  std::string s = v.dump();
  constexpr size_t kMaxChars = 60;
  if (s.size() > kMaxChars) s = s.substr(0, kMaxChars) + "...";
  return s;
}

inline std::string num(double x) {
  json j = x;
  return j.dump();
}

inline std::string index_path(const std::string& path, size_t i) { return path + "[" + std::to_string(i) + "]"; }

// Checks on single JSON values; `path` names the value in messages.
inline int positive_int_value(const json& v, const std::string& path) {
  bool ok = false;
  if (v.is_number_unsigned()) {
    ok = v.get<uint64_t>() >= 1 && v.get<uint64_t>() <= static_cast<uint64_t>(INT_MAX);
  } else if (v.is_number_integer()) {
    ok = v.get<int64_t>() >= 1 && v.get<int64_t>() <= INT_MAX;
  }
  if (!ok) throw IrError(path + ": expected a positive integer, got " + describe(v));
  return static_cast<int>(v.get<int64_t>());
}

inline int non_negative_int_value(const json& v, const std::string& path) {
  bool ok = v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(INT_MAX)
                                   : v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= INT_MAX;
  if (!ok) throw IrError(path + ": expected a non-negative integer, got " + describe(v));
  return static_cast<int>(v.get<int64_t>());
}

template <typename Pred>
double number_value(const json& v, const std::string& path, const char* what, Pred ok) {
  if (!v.is_number() || !std::isfinite(v.get<double>()) || !ok(v.get<double>())) {
    throw IrError(path + ": expected " + what + ", got " + describe(v));
  }
  return v.get<double>();
}

inline double positive_value(const json& v, const std::string& path) {
  return number_value(v, path, "a positive number", [](double x) { return x > 0; });
}

// Reads one JSON object whose keys are all known; `path` is the object's JSON path ("" for the root).
class ObjectReader {
 public:
  ObjectReader(const json& j, std::string path, std::initializer_list<const char*> keys)
      : j_(j), path_(std::move(path)) {
    if (!j_.is_object()) {
      throw IrError((path_.empty() ? std::string("profile") : path_) + ": expected an object, got " +
                    describe(j_));
    }
    // Unknown keys first: a misspelt key then reads "unknown key" rather than "missing".
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      bool known = false;
      for (const char* k : keys) known = known || it.key() == k;
      if (!known) {
        std::string expected;
        for (const char* k : keys) expected += (expected.empty() ? "" : ", ") + std::string(k);
        throw IrError(child(it.key()) + ": unknown key (expected one of: " + expected + ")");
      }
    }
  }

  std::string child(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

  bool has(const char* key) const { return j_.contains(key); }

  const json& field(const char* key, const char* what) const {
    auto it = j_.find(key);
    if (it == j_.end()) throw IrError(child(key) + ": missing (expected " + what + ")");
    return *it;
  }

  std::string string(const char* key, bool non_empty) const {
    const char* what = non_empty ? "a non-empty string" : "a string";
    const json& v = field(key, what);
    if (!v.is_string() || (non_empty && v.get_ref<const std::string&>().empty())) {
      throw IrError(child(key) + ": expected " + what + ", got " + describe(v));
    }
    return v.get<std::string>();
  }

  bool boolean(const char* key) const {
    const json& v = field(key, "a boolean");
    if (!v.is_boolean()) throw IrError(child(key) + ": expected a boolean, got " + describe(v));
    return v.get<bool>();
  }

  int positive_int(const char* key) const { return positive_int_value(field(key, "a positive integer"), child(key)); }

  double positive_number(const char* key) const {
    return number(key, "a positive number", [](double x) { return x > 0; });
  }
  double non_negative_number(const char* key) const {
    return number(key, "a non-negative number", [](double x) { return x >= 0; });
  }
  // Efficiencies: a fraction of a peak; 0 would make every estimate infinite.
  double fraction(const char* key) const {
    return number(key, "a number in (0, 1]", [](double x) { return x > 0 && x <= 1; });
  }

  ObjectReader object(const char* key, std::initializer_list<const char*> keys) const {
    return ObjectReader(field(key, "an object"), child(key), keys);
  }

  const json& array(const char* key, const char* what) const {
    const json& v = field(key, what);
    if (!v.is_array()) throw IrError(child(key) + ": expected " + what + ", got " + describe(v));
    return v;
  }

 private:
  template <typename Pred>
  double number(const char* key, const char* what, Pred ok) const {
    return number_value(field(key, what), child(key), what, ok);
  }

  const json& j_;
  std::string path_;
};

}  // namespace json_reader
}  // namespace ce_overlap
