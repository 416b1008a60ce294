// Plan JSON (schema ce_overlap.plan/1, docs/plan.md): strict loading with messages that name the
// field by its JSON path, canonical saving, and check_plan, the validator of every docs/plan.md rule.
#include "plan.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <initializer_list>
#include <regex>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "analysis.h"
#include "bucketing.h"

namespace ce_overlap {
namespace {

using json = nlohmann::json;

constexpr int64_t kMaxBytes = int64_t{1} << 50;
constexpr int64_t kMaxBudget = int64_t{1} << 62;
constexpr int kMaxPrefetch = 1024;
constexpr const char* kReduceOps[] = {"sum", "avg", "max", "min", "product"};

std::string describe(const json& v) {
  std::string s;
  try {
    s = v.dump();
  } catch (const json::exception&) {
    s = "a value that is not valid UTF-8";
  }
  constexpr size_t kMaxChars = 60;
  if (s.size() > kMaxChars) {
    size_t cut = kMaxChars;
    while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
    s = s.substr(0, cut) + "...";
  }
  return s;
}

std::string json_quoted(const std::string& s) { return describe(json(s)); }

[[noreturn]] void fail(const std::string& path, const std::string& message) { throw IrError(path + ": " + message); }

std::string at(const std::string& path, const char* key) { return path.empty() ? std::string(key) : path + "." + key; }
std::string at(const std::string& path, size_t i) { return path + "[" + std::to_string(i) + "]"; }

// One JSON object whose keys all come from `keys`; `required` keys must be present.
class ObjectReader {
 public:
  // `keys` are required when all_required; `optional` keys are accepted and never required.
  ObjectReader(const json& j, std::string path, std::initializer_list<const char*> keys, bool all_required = true,
               std::initializer_list<const char*> optional = {})
      : j_(j), path_(std::move(path)) {
    if (!j_.is_object()) fail(path_.empty() ? "document" : path_, "expected an object, got " + describe(j_));
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      bool known = false;
      for (const char* k : keys) known = known || it.key() == k;
      for (const char* k : optional) known = known || it.key() == k;
      if (!known) {
        std::string accepted;
        for (const char* k : keys) accepted += (accepted.empty() ? "" : ", ") + std::string(k);
        for (const char* k : optional) accepted += (accepted.empty() ? "" : ", ") + std::string(k);
        fail(path_.empty() ? "document" : path_, "unknown key " + json_quoted(it.key()) + " (accepted: " + accepted + ")");
      }
    }
    if (all_required) {
      for (const char* k : keys) {
        if (!j_.contains(k)) fail(at(path_, k), "missing required field");
      }
    }
  }
  bool has(const char* key) const { return j_.contains(key); }
  const json& operator[](const char* key) const { return j_.at(key); }
  std::string path(const char* key) const { return at(path_, key); }

 private:
  const json& j_;
  std::string path_;
};

int64_t int_value(const json& v, const std::string& path, int64_t lo, int64_t hi, const char* range) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u <= static_cast<uint64_t>(hi) && static_cast<int64_t>(u) >= lo) return static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i >= lo && i <= hi) return i;
  } else if (v.is_number_float()) {
    fail(path, "expected an integer, got " + describe(v));
  }
  if (!v.is_number()) fail(path, std::string("expected an integer in ") + range + ", got " + describe(v));
  fail(path, std::string("expected an integer in ") + range + ", got " + describe(v));
}

double us_value(const json& v, const std::string& path) {
  if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0) {
    fail(path, "expected a non-negative number of microseconds, got " + describe(v));
  }
  return v.get<double>();
}

std::optional<double> optional_us_value(const json& v, const std::string& path) {
  if (v.is_null()) return std::nullopt;
  return us_value(v, path);
}

std::string string_value(const json& v, const std::string& path, bool non_empty = true) {
  if (!v.is_string()) fail(path, "expected a string, got " + describe(v));
  const auto& s = v.get_ref<const std::string&>();
  if (non_empty && s.empty()) fail(path, "expected a non-empty string");
  return s;
}

std::optional<std::string> optional_string_value(const json& v, const std::string& path) {
  if (v.is_null()) return std::nullopt;
  return string_value(v, path);
}

CeReduction ce_reduction_from_string(const std::string& s, const std::string& path) {
  if (s == "consumer") return CeReduction::Consumer;
  if (s == "kernel") return CeReduction::Kernel;
  fail(path, "expected \"consumer\" or \"kernel\", got " + json_quoted(s));
}

CeMode ce_mode_from_string(const std::string& s, const std::string& path) {
  if (s == "auto") return CeMode::Auto;
  if (s == "on") return CeMode::On;
  if (s == "off") return CeMode::Off;
  fail(path, "expected \"auto\", \"on\" or \"off\", got " + json_quoted(s));
}

void check_pattern(const std::string& pattern, const std::string& path) {
  if (pattern.empty()) fail(path, "expected a non-empty regular expression");
  try {
    std::regex re(pattern, std::regex::ECMAScript);
    (void)re;
  } catch (const std::regex_error& e) {
    fail(path, "invalid regular expression " + json_quoted(pattern) + ": " + e.what());
  }
}

PlanConfig read_config(const json& j, const std::string& path, bool all_required) {
  ObjectReader r(j, path,
                 {"bucket_cap_bytes", "memory_budget_bytes", "ce", "min_ce_bytes", "prefetch_blocks", "bucket_patterns"},
                 all_required, {"ce_reduction"});
  PlanConfig c;
  if (r.has("bucket_cap_bytes")) {
    c.bucket_cap_bytes = int_value(r["bucket_cap_bytes"], r.path("bucket_cap_bytes"), 1, kMaxBytes, "1..2^50");
  }
  if (r.has("memory_budget_bytes")) {
    c.memory_budget_bytes =
        int_value(r["memory_budget_bytes"], r.path("memory_budget_bytes"), 0, kMaxBudget, "0..2^62");
  }
  if (r.has("ce")) c.ce = ce_mode_from_string(string_value(r["ce"], r.path("ce"), false), r.path("ce"));
  if (r.has("min_ce_bytes")) {
    c.min_ce_bytes = int_value(r["min_ce_bytes"], r.path("min_ce_bytes"), 0, kMaxBytes, "0..2^50");
  }
  if (r.has("prefetch_blocks")) {
    c.prefetch_blocks =
        static_cast<int>(int_value(r["prefetch_blocks"], r.path("prefetch_blocks"), 0, kMaxPrefetch, "0..1024"));
  }
  if (r.has("bucket_patterns")) {
    const json& p = r["bucket_patterns"];
    const std::string ppath = r.path("bucket_patterns");
    if (!p.is_array()) fail(ppath, "expected an array of regular expressions, got " + describe(p));
    for (size_t i = 0; i < p.size(); ++i) {
      c.bucket_patterns.push_back(string_value(p[i], at(ppath, i), false));
      check_pattern(c.bucket_patterns.back(), at(ppath, i));
    }
  }
  if (r.has("ce_reduction")) {
    c.ce_reduction = ce_reduction_from_string(string_value(r["ce_reduction"], r.path("ce_reduction"), false),
                                              r.path("ce_reduction"));
  }
  return c;
}

void validate_config(const PlanConfig& c, const std::string& path) {
  if (c.bucket_cap_bytes < 1 || c.bucket_cap_bytes > kMaxBytes) {
    fail(at(path, "bucket_cap_bytes"), "expected an integer in 1..2^50, got " + std::to_string(c.bucket_cap_bytes));
  }
  if (c.memory_budget_bytes < 0 || c.memory_budget_bytes > kMaxBudget) {
    fail(at(path, "memory_budget_bytes"),
         "expected an integer in 0..2^62, got " + std::to_string(c.memory_budget_bytes));
  }
  if (c.min_ce_bytes < 0 || c.min_ce_bytes > kMaxBytes) {
    fail(at(path, "min_ce_bytes"), "expected an integer in 0..2^50, got " + std::to_string(c.min_ce_bytes));
  }
  if (c.prefetch_blocks < 0 || c.prefetch_blocks > kMaxPrefetch) {
    fail(at(path, "prefetch_blocks"), "expected an integer in 0..1024, got " + std::to_string(c.prefetch_blocks));
  }
  (void)to_string(c.ce);
  for (size_t i = 0; i < c.bucket_patterns.size(); ++i) check_pattern(c.bucket_patterns[i], at(at(path, "bucket_patterns"), i));
}

bool reduces(CollectiveType t) { return t == CollectiveType::ReduceScatter || t == CollectiveType::AllReduce; }

// The rules of one bucket that need no graph.
void validate_bucket(const PlanBucket& b, size_t index, const PlanConfig& config, const std::string& path) {
  if (b.id != static_cast<int>(index)) {
    fail(at(path, "id"), "expected " + std::to_string(index) + " (ids equal the position), got " + std::to_string(b.id));
  }
  const char* type_name = nullptr;
  try {
    type_name = to_string(b.type);
  } catch (const IrError& e) {
    fail(at(path, "type"), e.what());
  }
  if (b.block && *b.block < 0) fail(at(path, "block"), "expected null or a block id >= 0, got " + std::to_string(*b.block));
  if (b.block_path && b.block_path->empty()) fail(at(path, "block_path"), "expected null or a non-empty string");
  if (b.group.empty()) fail(at(path, "group"), "expected a non-empty string");
  if (b.group_size < 1 || b.group_size > 65536) {
    fail(at(path, "group_size"), "expected an integer in 1..65536, got " + std::to_string(b.group_size));
  }
  if (b.dtype) {
    try {
      dtype_itemsize(*b.dtype);
    } catch (const IrError& e) {
      fail(at(path, "dtype"), e.what());
    }
  }
  if (reduces(b.type)) {
    bool known = false;
    for (const char* op : kReduceOps) known = known || (b.reduce_op && *b.reduce_op == op);
    if (!known) {
      fail(at(path, "reduce_op"), std::string("expected one of sum, avg, max, min, product for ") + type_name +
                                      ", got " + (b.reduce_op ? json_quoted(*b.reduce_op) : std::string("null")));
    }
  } else if (b.reduce_op) {
    fail(at(path, "reduce_op"), std::string("must be null for ") + type_name + ", got " + json_quoted(*b.reduce_op));
  }
  const std::string members_path = at(path, "members");
  if (b.members.empty()) fail(members_path, "expected at least one member");
  int64_t sum = 0;
  for (size_t k = 0; k < b.members.size(); ++k) {
    const PlanMember& m = b.members[k];
    const std::string mpath = at(members_path, k);
    if (m.collective.empty()) fail(at(mpath, "collective"), "expected a non-empty string");
    if (m.wait && m.wait->empty()) fail(at(mpath, "wait"), "expected null or a non-empty string");
    if (m.bytes < 0 || m.bytes > kMaxBytes) {
      fail(at(mpath, "bytes"), "expected an integer in 0..2^50, got " + std::to_string(m.bytes));
    }
    sum += m.bytes;
  }
  if (b.bytes != sum) {
    fail(at(path, "bytes"), "expected the sum of the members' bytes, " + std::to_string(sum) + ", got " +
                                std::to_string(b.bytes));
  }
  if (b.members.size() > 1 && b.bytes > config.bucket_cap_bytes) {
    fail(at(path, "bytes"), std::to_string(b.bytes) + " exceeds config.bucket_cap_bytes = " +
                                std::to_string(config.bucket_cap_bytes) + " (only a single collective may)");
  }
  if (b.backend != "nccl" && b.backend != "ce") {
    fail(at(path, "backend"), "expected \"nccl\" or \"ce\", got " + json_quoted(b.backend));
  }
  if (b.reason.rfind(b.backend + ": ", 0) != 0) {
    fail(at(path, "reason"), "expected one line starting with \"" + b.backend + ": \", got " + json_quoted(b.reason));
  }
  if (b.reason.find_first_of("\r\n") != std::string::npos) fail(at(path, "reason"), "expected one line");
  const std::string ppath = at(path, "predicted");
  const PlanPrediction& p = b.predicted;
  auto check_us = [&](double us, const char* key) {
    if (!std::isfinite(us) || us < 0) fail(at(ppath, key), "expected a non-negative number of microseconds");
  };
  check_us(p.nccl_us, "nccl_us");
  check_us(p.window_us, "window_us");
  check_us(p.nccl_cost_us, "nccl_cost_us");
  check_us(p.exposed_us, "exposed_us");
  if (p.ce_us) check_us(*p.ce_us, "ce_us");
  if (p.ce_cost_us) check_us(*p.ce_cost_us, "ce_cost_us");
  if (p.ce_us.has_value() != p.ce_cost_us.has_value()) {
    fail(at(ppath, "ce_cost_us"), "must be null exactly when ce_us is (CE cannot serve the group)");
  }
  if (b.backend == "ce" && !p.ce_us) fail(at(ppath, "ce_us"), "a bucket on CE needs a CE prediction, got null");
}

PlanBucket read_bucket(const json& j, const std::string& path) {
  ObjectReader r(j, path,
                 {"id", "type", "block", "block_path", "group", "group_size", "dtype", "reduce_op", "members", "bytes",
                  "backend", "reason", "predicted"});
  PlanBucket b;
  b.id = static_cast<int>(int_value(r["id"], r.path("id"), 0, INT_MAX, "0..2^31-1"));
  const std::string type = string_value(r["type"], r.path("type"));
  try {
    b.type = collective_type_from_string(type);
  } catch (const IrError& e) {
    fail(r.path("type"), e.what());
  }
  if (!r["block"].is_null()) b.block = static_cast<int>(int_value(r["block"], r.path("block"), 0, INT_MAX, "0..2^31-1 or null"));
  b.block_path = optional_string_value(r["block_path"], r.path("block_path"));
  b.group = string_value(r["group"], r.path("group"));
  b.group_size = static_cast<int>(int_value(r["group_size"], r.path("group_size"), 1, 65536, "1..65536"));
  b.dtype = optional_string_value(r["dtype"], r.path("dtype"));
  b.reduce_op = optional_string_value(r["reduce_op"], r.path("reduce_op"));
  const json& members = r["members"];
  const std::string mpath = r.path("members");
  if (!members.is_array()) fail(mpath, "expected an array, got " + describe(members));
  for (size_t k = 0; k < members.size(); ++k) {
    const std::string p = at(mpath, k);
    ObjectReader m(members[k], p, {"collective", "wait", "bytes"});
    PlanMember member;
    member.collective = string_value(m["collective"], m.path("collective"));
    member.wait = optional_string_value(m["wait"], m.path("wait"));
    member.bytes = int_value(m["bytes"], m.path("bytes"), 0, kMaxBytes, "0..2^50");
    b.members.push_back(std::move(member));
  }
  b.bytes = int_value(r["bytes"], r.path("bytes"), 0, INT64_MAX, "0..2^63-1");
  b.backend = string_value(r["backend"], r.path("backend"));
  b.reason = string_value(r["reason"], r.path("reason"));
  ObjectReader p(r["predicted"], r.path("predicted"),
                 {"nccl_us", "ce_us", "window_us", "nccl_cost_us", "ce_cost_us", "exposed_us"});
  b.predicted.nccl_us = us_value(p["nccl_us"], p.path("nccl_us"));
  b.predicted.ce_us = optional_us_value(p["ce_us"], p.path("ce_us"));
  b.predicted.window_us = us_value(p["window_us"], p.path("window_us"));
  b.predicted.nccl_cost_us = us_value(p["nccl_cost_us"], p.path("nccl_cost_us"));
  b.predicted.ce_cost_us = optional_us_value(p["ce_cost_us"], p.path("ce_cost_us"));
  b.predicted.exposed_us = us_value(p["exposed_us"], p.path("exposed_us"));
  return b;
}

PlanSummary read_summary(const json& j, const std::string& path) {
  ObjectReader r(j, path,
                 {"collectives", "buckets", "ce_buckets", "exposed_comm_us_before", "exposed_comm_us_after",
                  "peak_memory_bytes_before", "peak_memory_bytes_after", "memory_budget_bytes", "plan_ms"},
                 true, {"makespan_us_before", "makespan_us_after"});
  PlanSummary s;
  s.collectives = int_value(r["collectives"], r.path("collectives"), 0, INT64_MAX, "0..2^63-1");
  s.buckets = int_value(r["buckets"], r.path("buckets"), 0, INT64_MAX, "0..2^63-1");
  s.ce_buckets = int_value(r["ce_buckets"], r.path("ce_buckets"), 0, INT64_MAX, "0..2^63-1");
  s.exposed_comm_us_before = us_value(r["exposed_comm_us_before"], r.path("exposed_comm_us_before"));
  s.exposed_comm_us_after = us_value(r["exposed_comm_us_after"], r.path("exposed_comm_us_after"));
  if (r.has("makespan_us_before")) s.makespan_us_before = us_value(r["makespan_us_before"], r.path("makespan_us_before"));
  if (r.has("makespan_us_after")) s.makespan_us_after = us_value(r["makespan_us_after"], r.path("makespan_us_after"));
  s.peak_memory_bytes_before =
      int_value(r["peak_memory_bytes_before"], r.path("peak_memory_bytes_before"), 0, INT64_MAX, "0..2^63-1");
  s.peak_memory_bytes_after =
      int_value(r["peak_memory_bytes_after"], r.path("peak_memory_bytes_after"), 0, INT64_MAX, "0..2^63-1");
  s.memory_budget_bytes = int_value(r["memory_budget_bytes"], r.path("memory_budget_bytes"), 0, kMaxBudget, "0..2^62");
  if (!r["plan_ms"].is_number() || !std::isfinite(r["plan_ms"].get<double>()) || r["plan_ms"].get<double>() < 0) {
    fail(r.path("plan_ms"), "expected a non-negative number of milliseconds, got " + describe(r["plan_ms"]));
  }
  s.plan_ms = r["plan_ms"].get<double>();
  return s;
}

// --- canonical writer ---

void put(std::string& out, const json& v) {
  try {
    out += v.dump();
  } catch (const json::exception& e) {
    throw IrError(std::string("plan: cannot be written as JSON: ") + e.what());
  }
}
void key(std::string& out, const char* k) {
  out += '"';
  out += k;
  out += "\": ";
}
json opt(const std::optional<std::string>& s) { return s ? json(*s) : json(nullptr); }
json opt(const std::optional<double>& d) { return d ? json(*d) : json(nullptr); }
json num(double d) { return json(d); }  // shortest text that reads back to the same double

void write_config(std::string& out, const PlanConfig& c) {
  out += '{';
  key(out, "bucket_cap_bytes");
  out += std::to_string(c.bucket_cap_bytes) + ", ";
  key(out, "memory_budget_bytes");
  out += std::to_string(c.memory_budget_bytes) + ", ";
  key(out, "ce");
  put(out, to_string(c.ce));
  out += ", ";
  key(out, "min_ce_bytes");
  out += std::to_string(c.min_ce_bytes) + ", ";
  key(out, "prefetch_blocks");
  out += std::to_string(c.prefetch_blocks) + ", ";
  key(out, "bucket_patterns");
  out += '[';
  for (size_t i = 0; i < c.bucket_patterns.size(); ++i) {
    if (i) out += ", ";
    put(out, c.bucket_patterns[i]);
  }
  out += "]}";
}

void write_bucket(std::string& out, const PlanBucket& b) {
  out += '{';
  key(out, "id");
  out += std::to_string(b.id) + ", ";
  key(out, "type");
  put(out, to_string(b.type));
  out += ", ";
  key(out, "block");
  out += b.block ? std::to_string(*b.block) : "null";
  out += ", ";
  key(out, "block_path");
  put(out, opt(b.block_path));
  out += ", ";
  key(out, "group");
  put(out, b.group);
  out += ", ";
  key(out, "group_size");
  out += std::to_string(b.group_size) + ", ";
  key(out, "dtype");
  put(out, opt(b.dtype));
  out += ", ";
  key(out, "reduce_op");
  put(out, opt(b.reduce_op));
  out += ", ";
  key(out, "members");
  out += '[';
  for (size_t k = 0; k < b.members.size(); ++k) {
    const PlanMember& m = b.members[k];
    if (k) out += ", ";
    out += '{';
    key(out, "collective");
    put(out, m.collective);
    out += ", ";
    key(out, "wait");
    put(out, opt(m.wait));
    out += ", ";
    key(out, "bytes");
    out += std::to_string(m.bytes) + "}";
  }
  out += "], ";
  key(out, "bytes");
  out += std::to_string(b.bytes) + ", ";
  key(out, "backend");
  put(out, b.backend);
  out += ", ";
  key(out, "reason");
  put(out, b.reason);
  out += ", ";
  key(out, "predicted");
  const PlanPrediction& p = b.predicted;
  out += '{';
  key(out, "nccl_us");
  put(out, num(p.nccl_us));
  out += ", ";
  key(out, "ce_us");
  put(out, opt(p.ce_us));
  out += ", ";
  key(out, "window_us");
  put(out, num(p.window_us));
  out += ", ";
  key(out, "nccl_cost_us");
  put(out, num(p.nccl_cost_us));
  out += ", ";
  key(out, "ce_cost_us");
  put(out, opt(p.ce_cost_us));
  out += ", ";
  key(out, "exposed_us");
  put(out, num(p.exposed_us));
  out += "}}";
}

void write_summary(std::string& out, const PlanSummary& s) {
  out += '{';
  key(out, "collectives");
  out += std::to_string(s.collectives) + ", ";
  key(out, "buckets");
  out += std::to_string(s.buckets) + ", ";
  key(out, "ce_buckets");
  out += std::to_string(s.ce_buckets) + ", ";
  key(out, "exposed_comm_us_before");
  put(out, num(s.exposed_comm_us_before));
  out += ", ";
  key(out, "exposed_comm_us_after");
  put(out, num(s.exposed_comm_us_after));
  out += ", ";
  if (s.makespan_us_before) {
    key(out, "makespan_us_before");
    put(out, num(*s.makespan_us_before));
    out += ", ";
  }
  if (s.makespan_us_after) {
    key(out, "makespan_us_after");
    put(out, num(*s.makespan_us_after));
    out += ", ";
  }
  key(out, "peak_memory_bytes_before");
  out += std::to_string(s.peak_memory_bytes_before) + ", ";
  key(out, "peak_memory_bytes_after");
  out += std::to_string(s.peak_memory_bytes_after) + ", ";
  key(out, "memory_budget_bytes");
  out += std::to_string(s.memory_budget_bytes) + ", ";
  key(out, "plan_ms");
  put(out, num(s.plan_ms));
  out += '}';
}

const Graph& graph_named(const Document& doc, const std::string& name) {
  std::string names;
  for (const Graph& g : doc.graphs) {
    if (g.name == name) return g;
    names += (names.empty() ? "" : ", ") + g.name;
  }
  fail("graph", "no graph named " + json_quoted(name) + " in the IR (it has: " + names + ")");
}

std::string label(const Graph& g, int id) { return "node " + std::to_string(id) + " (" + json_quoted(g.nodes[id].name) + ")"; }

}  // namespace

const char* to_string(CeReduction reduction) {
  switch (reduction) {
    case CeReduction::Consumer: return "consumer";
    case CeReduction::Kernel: return "kernel";
  }
  throw IrError("invalid CeReduction value " + std::to_string(static_cast<int>(reduction)));
}

const char* to_string(CeMode mode) {
  switch (mode) {
    case CeMode::Auto: return "auto";
    case CeMode::On: return "on";
    case CeMode::Off: return "off";
  }
  throw IrError("invalid CeMode value " + std::to_string(static_cast<int>(mode)));
}

PlanConfig plan_config_from_json(const json& j, const std::string& path) { return read_config(j, path, false); }

json plan_config_to_json(const PlanConfig& c) {
  return json{{"bucket_cap_bytes", c.bucket_cap_bytes}, {"memory_budget_bytes", c.memory_budget_bytes},
              {"ce", to_string(c.ce)},                  {"min_ce_bytes", c.min_ce_bytes},
              {"prefetch_blocks", c.prefetch_blocks},   {"bucket_patterns", c.bucket_patterns},
              {"ce_reduction", to_string(c.ce_reduction)}};
}

void validate_plan(const Plan& plan) {
  if (plan.graph.empty()) fail("graph", "expected a non-empty string");
  if (plan.profile.empty()) fail("profile", "expected a non-empty string");
  validate_config(plan.config, "config");
  std::unordered_map<std::string_view, size_t> position;
  position.reserve(plan.order.size());
  for (size_t i = 0; i < plan.order.size(); ++i) {
    if (plan.order[i].empty()) fail(at("order", i), "expected a non-empty node name");
    auto [it, inserted] = position.emplace(plan.order[i], i);
    if (!inserted) {
      fail(at("order", i), json_quoted(plan.order[i]) + " appears twice (also order[" + std::to_string(it->second) + "])");
    }
  }
  std::unordered_map<std::string_view, std::string> owner;  // collective or wait name -> where it is listed
  int64_t members = 0, ce_buckets = 0;
  for (size_t i = 0; i < plan.buckets.size(); ++i) {
    const PlanBucket& b = plan.buckets[i];
    const std::string path = at("buckets", i);
    validate_bucket(b, i, plan.config, path);
    if (b.backend == "ce") ++ce_buckets;
    members += static_cast<int64_t>(b.members.size());
    // Contiguity in `order`: collectives together, waits together, and the waits after the collectives.
    size_t first_c = SIZE_MAX, last_c = 0, first_w = SIZE_MAX, last_w = 0, waits = 0;
    for (size_t k = 0; k < b.members.size(); ++k) {
      const PlanMember& m = b.members[k];
      const std::string mpath = at(at(path, "members"), k);
      for (const std::string* name : {&m.collective, m.wait ? &*m.wait : nullptr}) {
        if (!name) continue;
        const std::string field = at(mpath, name == &m.collective ? "collective" : "wait");
        auto [it, inserted] = owner.emplace(*name, field);
        if (!inserted) fail(field, json_quoted(*name) + " is listed twice (also " + it->second + ")");
        auto pos = position.find(*name);
        if (pos == position.end()) fail(field, json_quoted(*name) + " is not in order");
        if (name == &m.collective) {
          first_c = std::min(first_c, pos->second);
          last_c = std::max(last_c, pos->second);
        } else {
          first_w = std::min(first_w, pos->second);
          last_w = std::max(last_w, pos->second);
          ++waits;
        }
      }
    }
    if (last_c - first_c + 1 != b.members.size()) {
      fail(at(path, "members"), "member collectives are not contiguous in order (they span order[" +
                                    std::to_string(first_c) + "..." + std::to_string(last_c) + "])");
    }
    if (waits > 0 && last_w - first_w + 1 != waits) {
      fail(at(path, "members"), "member waits are not contiguous in order (they span order[" +
                                    std::to_string(first_w) + "..." + std::to_string(last_w) + "])");
    }
    if (waits > 0 && first_w < last_c) {
      fail(at(path, "members"), "a member wait (order[" + std::to_string(first_w) +
                                    "]) comes before the last member collective (order[" + std::to_string(last_c) + "])");
    }
  }
  const PlanSummary& s = plan.summary;
  if (s.collectives != members) {
    fail("summary.collectives", "expected " + std::to_string(members) + " (the members of all buckets), got " +
                                    std::to_string(s.collectives));
  }
  if (s.buckets != static_cast<int64_t>(plan.buckets.size())) {
    fail("summary.buckets", "expected " + std::to_string(plan.buckets.size()) + ", got " + std::to_string(s.buckets));
  }
  if (s.ce_buckets != ce_buckets) {
    fail("summary.ce_buckets", "expected " + std::to_string(ce_buckets) + " (buckets on ce), got " +
                                   std::to_string(s.ce_buckets));
  }
  if (s.memory_budget_bytes != plan.config.memory_budget_bytes) {
    fail("summary.memory_budget_bytes", "expected config.memory_budget_bytes = " +
                                            std::to_string(plan.config.memory_budget_bytes) + ", got " +
                                            std::to_string(s.memory_budget_bytes));
  }
  for (double us : {s.exposed_comm_us_before, s.exposed_comm_us_after, s.plan_ms,
                    s.makespan_us_before.value_or(0.0), s.makespan_us_after.value_or(0.0)}) {
    if (!std::isfinite(us) || us < 0) fail("summary", "times must be finite and non-negative");
  }
  if (s.peak_memory_bytes_before < 0 || s.peak_memory_bytes_after < 0) {
    fail("summary", "peak memory must be non-negative");
  }
  if (s.peak_memory_bytes_after - s.peak_memory_bytes_before > s.memory_budget_bytes) {
    fail("summary.peak_memory_bytes_after",
         std::to_string(s.peak_memory_bytes_after) + " exceeds peak_memory_bytes_before + memory_budget_bytes = " +
             std::to_string(s.peak_memory_bytes_before) + " + " + std::to_string(s.memory_budget_bytes));
  }
}

Plan plan_from_json(const json& j) {
  ObjectReader r(j, "", {"schema", "graph", "profile", "config", "buckets", "order", "summary"}, false);
  if (!r.has("schema")) fail("schema", "missing required field");
  if (!r["schema"].is_string() || r["schema"].get_ref<const std::string&>() != kPlanSchema) {
    fail("schema", std::string("expected \"") + kPlanSchema + "\", got " + describe(r["schema"]));
  }
  ObjectReader all(j, "", {"schema", "graph", "profile", "config", "buckets", "order", "summary"});
  Plan plan;
  plan.graph = string_value(all["graph"], "graph");
  plan.profile = string_value(all["profile"], "profile");
  plan.config = read_config(all["config"], "config", true);
  const json& buckets = all["buckets"];
  if (!buckets.is_array()) fail("buckets", "expected an array, got " + describe(buckets));
  for (size_t i = 0; i < buckets.size(); ++i) plan.buckets.push_back(read_bucket(buckets[i], at("buckets", i)));
  const json& order = all["order"];
  if (!order.is_array()) fail("order", "expected an array of node names, got " + describe(order));
  plan.order.reserve(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    if (!order[i].is_string()) fail(at("order", i), "expected a node name, got " + describe(order[i]));
    plan.order.push_back(order[i].get<std::string>());
  }
  plan.summary = read_summary(all["summary"], "summary");
  validate_plan(plan);
  return plan;
}

Plan load_plan(const std::string& json_text) {
  // Repeated keys are rejected (nlohmann would keep the last one silently).
  std::vector<std::set<std::string>> keys_seen;
  std::string duplicate;
  json::parser_callback_t on_event = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      keys_seen.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      keys_seen.pop_back();
    } else if (event == json::parse_event_t::key && duplicate.empty()) {
      if (!keys_seen.back().insert(parsed.get<std::string>()).second) duplicate = parsed.get<std::string>();
    }
    return true;
  };
  json j;
  try {
    j = json::parse(json_text, on_event);
  } catch (const json::parse_error& e) {
    std::string message = e.what();
    const auto tag_end = message.find("] ");
    if (message.rfind("[json.exception.", 0) == 0 && tag_end != std::string::npos) message.erase(0, tag_end + 2);
    throw IrError("malformed JSON: " + message + " (byte " + std::to_string(e.byte) + ")");
  } catch (const json::exception& e) {  // out_of_range: a number beyond a double
    std::string message = e.what();
    const auto tag_end = message.find("] ");
    if (message.rfind("[json.exception.", 0) == 0 && tag_end != std::string::npos) message.erase(0, tag_end + 2);
    throw IrError("malformed JSON: " + message);
  }
  if (!duplicate.empty()) throw IrError("malformed plan: duplicate key " + json_quoted(duplicate) + " in an object");
  return plan_from_json(j);
}

std::string save_plan(const Plan& plan) {
  validate_plan(plan);
  std::string out;
  out.reserve(512 + 600 * plan.buckets.size() + 40 * plan.order.size());
  out += "{\n  \"schema\": ";
  put(out, kPlanSchema);
  out += ",\n  \"graph\": ";
  put(out, plan.graph);
  out += ",\n  \"profile\": ";
  put(out, plan.profile);
  out += ",\n  \"config\": ";
  write_config(out, plan.config);
  out += ",\n  \"buckets\": [";
  for (size_t i = 0; i < plan.buckets.size(); ++i) {
    out += i ? ",\n    " : "\n    ";
    write_bucket(out, plan.buckets[i]);
  }
  out += plan.buckets.empty() ? "],\n" : "\n  ],\n";
  out += "  \"order\": [";
  for (size_t i = 0; i < plan.order.size(); ++i) {
    out += i ? ",\n    " : "\n    ";
    put(out, plan.order[i]);
  }
  out += plan.order.empty() ? "],\n" : "\n  ],\n";
  out += "  \"summary\": ";
  write_summary(out, plan.summary);
  out += "\n}\n";
  return out;
}

nlohmann::ordered_json plan_to_json(const Plan& plan) { return nlohmann::ordered_json::parse(save_plan(plan)); }

void check_plan(const Document& doc, const Plan& plan) {
  validate_plan(plan);
  const Graph& g = graph_named(doc, plan.graph);
  const int n = static_cast<int>(g.nodes.size());
  std::unordered_map<std::string_view, int> id_of;
  id_of.reserve(g.nodes.size());
  for (const Node& node : g.nodes) id_of.emplace(node.name, node.id);
  auto lookup = [&](const std::string& name, const std::string& path) {
    auto it = id_of.find(name);
    if (it == id_of.end()) fail(path, "no node named " + json_quoted(name) + " in graph " + json_quoted(g.name));
    return it->second;
  };

  // order: every node once, topological, placeholders first, output last.
  std::vector<int> order;
  order.reserve(plan.order.size());
  for (size_t i = 0; i < plan.order.size(); ++i) order.push_back(lookup(plan.order[i], at("order", i)));
  if (static_cast<int>(order.size()) != n) {
    std::vector<char> seen(n, 0);
    for (int v : order) seen[v] = 1;
    int missing = 0;
    while (missing < n && seen[missing]) ++missing;
    fail("order", "names " + std::to_string(order.size()) + " of the " + std::to_string(n) + " nodes of graph " +
                      json_quoted(g.name) + (missing < n ? "; missing " + label(g, missing) : std::string()));
  }
  check_order(g, order);
  std::vector<int> pos(n);
  for (int i = 0; i < n; ++i) pos[order[i]] = i;
  int first_other = -1;
  for (int i = 0; i < n; ++i) {
    const std::string& op = g.nodes[order[i]].op;
    if (op != "placeholder" && first_other < 0) first_other = i;
    if (op == "placeholder" && first_other >= 0) {
      fail(at("order", i), "placeholder " + json_quoted(plan.order[i]) + " comes after " +
                               json_quoted(plan.order[first_other]) + " (placeholders go first)");
    }
    if (op == "output" && i != n - 1) fail(at("order", i), "output must be last");
  }

  // Buckets against the nodes.
  const std::vector<CollectiveUse> uses = collective_uses(g);
  std::vector<int> user_offsets(n + 1, 0), users;
  for (const Node& node : g.nodes) {
    for (int input : node.inputs) ++user_offsets[input + 1];
  }
  for (int v = 0; v < n; ++v) user_offsets[v + 1] += user_offsets[v];
  users.resize(user_offsets[n]);
  {
    std::vector<int> fill(user_offsets.begin(), user_offsets.end() - 1);
    for (const Node& node : g.nodes) {
      for (int input : node.inputs) users[fill[input]++] = node.id;
    }
  }
  std::vector<char> in_bucket(n, 0);
  for (size_t i = 0; i < plan.buckets.size(); ++i) {
    const PlanBucket& b = plan.buckets[i];
    const std::string path = at("buckets", i);
    if (b.block && *b.block >= static_cast<int>(doc.blocks.size())) {
      fail(at(path, "block"), "expected null or a block id in [0, " + std::to_string(doc.blocks.size()) + "), got " +
                                  std::to_string(*b.block));
    }
    int first_c = n, last_c = -1, first_w = n, last_w = -1;
    for (size_t k = 0; k < b.members.size(); ++k) {
      const PlanMember& m = b.members[k];
      const std::string mpath = at(at(path, "members"), k);
      const int c = lookup(m.collective, at(mpath, "collective"));
      const Node& node = g.nodes[c];
      if (node.kind != NodeKind::Collective || !node.collective) {
        fail(at(mpath, "collective"), label(g, c) + " is not a collective (kind " + to_string(node.kind) + ")");
      }
      in_bucket[c] = 1;
      const CollectiveInfo& info = *node.collective;
      auto mismatch = [&](const char* field, const std::string& want, const std::string& got) {
        fail(at(path, field), "expected " + want + " (as " + label(g, c) + " has), got " + got);
      };
      auto show = [](const std::optional<std::string>& s) { return s ? json_quoted(*s) : std::string("null"); };
      if (info.type != b.type) mismatch("type", json_quoted(to_string(info.type)), json_quoted(to_string(b.type)));
      if (info.group != b.group) mismatch("group", json_quoted(info.group), json_quoted(b.group));
      if (info.group_size != b.group_size) {
        mismatch("group_size", std::to_string(info.group_size), std::to_string(b.group_size));
      }
      if (info.reduce_op != b.reduce_op) mismatch("reduce_op", show(info.reduce_op), show(b.reduce_op));
      std::optional<std::string> dtype;
      if (!node.outputs.empty()) {
        dtype = node.outputs[0].dtype;
      } else {
        for (int input : node.inputs) {
          if (!dtype && !g.nodes[input].outputs.empty()) dtype = g.nodes[input].outputs[0].dtype;
        }
      }
      if (dtype != b.dtype) mismatch("dtype", show(dtype), show(b.dtype));
      if (info.bytes != m.bytes) {
        fail(at(mpath, "bytes"), "expected " + std::to_string(info.bytes) + " (collective.bytes of " + label(g, c) +
                                     "), got " + std::to_string(m.bytes));
      }
      const CollectiveUse& use = uses[c];
      const std::optional<std::string> want_wait =
          use.wait >= 0 ? std::optional<std::string>(g.nodes[use.wait].name) : std::nullopt;
      if (m.wait != want_wait) {
        fail(at(mpath, "wait"), "expected " + show(want_wait) + " (the wait that consumes " + label(g, c) +
                                    "), got " + show(m.wait));
      }
      if (use.bucketable && !use.mergeable && b.members.size() > 1) {
        fail(at(path, "members"), label(g, c) + " (" + node.op +
                                      ") cannot be merged: only the functional all_gather_into_tensor, "
                                      "reduce_scatter_tensor and all_reduce of a tensor with a dim 0 (divisible by "
                                      "the group size for a reduce-scatter) share buckets");
      }
      if (!use.bucketable) {
        if (b.members.size() > 1) {
          fail(at(path, "members"), label(g, c) + " is read by " + std::to_string(use.num_waits) +
                                        " waits or besides its wait: it can only be a bucket of its own");
        }
        if (b.backend != "nccl") fail(at(path, "backend"), label(g, c) + " cannot be rewritten: expected \"nccl\"");
      }
      first_c = std::min(first_c, pos[c]);
      last_c = std::max(last_c, pos[c]);
      if (use.wait >= 0) {
        first_w = std::min(first_w, pos[use.wait]);
        last_w = std::max(last_w, pos[use.wait]);
      }
    }
    // Inputs before the first member collective; users of member waits after the last member wait.
    for (size_t k = 0; k < b.members.size(); ++k) {
      const int c = id_of.at(b.members[k].collective);
      for (int input : g.nodes[c].inputs) {
        if (pos[input] > first_c) {
          fail(at(at(at(path, "members"), k), "collective"),
               "input " + label(g, input) + " at order[" + std::to_string(pos[input]) +
                   "] comes after the bucket's first collective at order[" + std::to_string(first_c) + "]");
        }
      }
    }
    if (last_w >= 0) {
      for (size_t k = 0; k < b.members.size(); ++k) {
        if (!b.members[k].wait) continue;
        const int w = id_of.at(*b.members[k].wait);
        for (int e = user_offsets[w]; e < user_offsets[w + 1]; ++e) {
          const int user = users[e];
          if (pos[user] < last_w) {
            fail(at(at(at(path, "members"), k), "wait"),
                 "user " + label(g, user) + " at order[" + std::to_string(pos[user]) +
                     "] comes before the bucket's last wait at order[" + std::to_string(last_w) + "]");
          }
        }
      }
    }
    (void)first_w;
  }
  for (const Node& node : g.nodes) {
    if (node.kind == NodeKind::Collective && !in_bucket[node.id]) {
      fail("buckets", "collective " + label(g, node.id) + " is in no bucket");
    }
  }
}

}  // namespace ce_overlap
