// Plan JSON (schema ce_overlap.plan/1, docs/plan.md): strict reading with messages that name the field by its
// JSON path (each such error is rule "schema"), and canonical writing. The rules between fields are in
// plan_validate.cc, those against the graph in plan_check.cc.
#include "plan.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <initializer_list>
#include <regex>
#include <set>

#include "plan_rules.h"

namespace ce_overlap {

using json = nlohmann::json;

namespace plan_rules {

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

std::string at(const std::string& path, const char* key) { return path.empty() ? std::string(key) : path + "." + key; }
std::string at(const std::string& path, size_t i) { return path + "[" + std::to_string(i) + "]"; }

std::string bucket_node(size_t index) { return "bucket " + std::to_string(index); }

void fail(const char* rule, const std::optional<std::string>& node, const std::string& path,
          const std::string& message) {
  throw PlanRuleError(rule, node, path + ": " + message);
}

void fail_schema(const std::string& path, const std::string& message) {
  std::optional<std::string> node;
  if (path.rfind("buckets[", 0) == 0) node = path.substr(0, path.find(']') + 1);
  fail("schema", node, path, message);
}

void check_pattern(const std::string& pattern, const std::string& path) {
  if (pattern.empty()) fail_schema(path, "expected a non-empty regular expression");
  try {
    std::regex re(pattern, std::regex::ECMAScript);
    (void)re;
  } catch (const std::regex_error& e) {
    fail_schema(path, "invalid regular expression " + json_quoted(pattern) + ": " + e.what());
  }
}

}  // namespace plan_rules

namespace {

using namespace plan_rules;

// One JSON object whose keys all come from `keys`; `required` keys must be present.
class ObjectReader {
 public:
  // `keys` are required when all_required; `optional` keys are accepted and never required.
  ObjectReader(const json& j, std::string path, std::initializer_list<const char*> keys, bool all_required = true,
               std::initializer_list<const char*> optional = {})
      : j_(j), path_(std::move(path)) {
    if (!j_.is_object()) fail_schema(path_.empty() ? "document" : path_, "expected an object, got " + describe(j_));
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      bool known = false;
      for (const char* k : keys) known = known || it.key() == k;
      for (const char* k : optional) known = known || it.key() == k;
      if (!known) {
        std::string accepted;
        for (const char* k : keys) accepted += (accepted.empty() ? "" : ", ") + std::string(k);
        for (const char* k : optional) accepted += (accepted.empty() ? "" : ", ") + std::string(k);
        fail_schema(path_.empty() ? "document" : path_, "unknown key " + json_quoted(it.key()) + " (accepted: " + accepted + ")");
      }
    }
    if (all_required) {
      for (const char* k : keys) {
        if (!j_.contains(k)) fail_schema(at(path_, k), "missing required field");
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
    fail_schema(path, "expected an integer, got " + describe(v));
  }
  if (!v.is_number()) fail_schema(path, std::string("expected an integer in ") + range + ", got " + describe(v));
  fail_schema(path, std::string("expected an integer in ") + range + ", got " + describe(v));
}

double us_value(const json& v, const std::string& path) {
  if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0) {
    fail_schema(path, "expected a non-negative number of microseconds, got " + describe(v));
  }
  return v.get<double>();
}

std::optional<double> optional_us_value(const json& v, const std::string& path) {
  if (v.is_null()) return std::nullopt;
  return us_value(v, path);
}

std::string string_value(const json& v, const std::string& path, bool non_empty = true) {
  if (!v.is_string()) fail_schema(path, "expected a string, got " + describe(v));
  const auto& s = v.get_ref<const std::string&>();
  if (non_empty && s.empty()) fail_schema(path, "expected a non-empty string");
  return s;
}

std::optional<std::string> optional_string_value(const json& v, const std::string& path) {
  if (v.is_null()) return std::nullopt;
  return string_value(v, path);
}

CeReduction ce_reduction_from_string(const std::string& s, const std::string& path) {
  if (s == "consumer") return CeReduction::Consumer;
  if (s == "kernel") return CeReduction::Kernel;
  fail_schema(path, "expected \"consumer\" or \"kernel\", got " + json_quoted(s));
}

CeMode ce_mode_from_string(const std::string& s, const std::string& path) {
  if (s == "auto") return CeMode::Auto;
  if (s == "on") return CeMode::On;
  if (s == "off") return CeMode::Off;
  fail_schema(path, "expected \"auto\", \"on\" or \"off\", got " + json_quoted(s));
}

PlanConfig read_config(const json& j, const std::string& path, bool all_required) {
  ObjectReader r(j, path,
                 {"bucket_cap_bytes", "memory_budget_bytes", "ce", "min_ce_bytes", "prefetch_blocks", "bucket_patterns"},
                 all_required, {"ce_reduction", "ce_collectives", "copy_pace_fill", "keep_order"});
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
    if (!p.is_array()) fail_schema(ppath, "expected an array of regular expressions, got " + describe(p));
    for (size_t i = 0; i < p.size(); ++i) {
      c.bucket_patterns.push_back(string_value(p[i], at(ppath, i), false));
      check_pattern(c.bucket_patterns.back(), at(ppath, i));
    }
  }
  if (r.has("ce_reduction")) {
    c.ce_reduction = ce_reduction_from_string(string_value(r["ce_reduction"], r.path("ce_reduction"), false),
                                              r.path("ce_reduction"));
  }
  if (r.has("copy_pace_fill")) {
    const json& f = r["copy_pace_fill"];
    if (!f.is_number() || !(f.get<double>() >= 0 && f.get<double>() <= 1)) {
      fail_schema(r.path("copy_pace_fill"), "expected a number in 0..1 (0: no pacing), got " + describe(f));
    }
    c.copy_pace_fill = f.get<double>();
  }
  if (r.has("keep_order")) {
    const json& k = r["keep_order"];
    if (!k.is_boolean()) fail_schema(r.path("keep_order"), "expected true or false, got " + describe(k));
    c.keep_order = k.get<bool>();
  }
  if (r.has("ce_collectives")) {
    const json& k = r["ce_collectives"];
    const std::string kpath = r.path("ce_collectives");
    if (!k.is_array()) fail_schema(kpath, "expected an array of collective types, got " + describe(k));
    c.ce_collectives.clear();
    for (size_t i = 0; i < k.size(); ++i) {
      const std::string name = string_value(k[i], at(kpath, i), false);
      const CollectiveType* hit = nullptr;
      for (const CollectiveType& t : kCeCollectiveTypes) {
        if (name == to_string(t)) hit = &t;
      }
      if (!hit) fail_schema(at(kpath, i), "expected \"all_gather\" or \"reduce_scatter\" (the types CE serves), got " +
                                              json_quoted(name));
      if (ce_allows(c, *hit)) fail_schema(at(kpath, i), json_quoted(name) + " is listed twice");
      c.ce_collectives.push_back(*hit);
    }
  }
  return c;
}

// config.ce_collectives as names, in kCeCollectiveTypes' order (the canonical text), and whether it is the default.
json ce_collective_names(const PlanConfig& c) {
  json names = json::array();
  for (CollectiveType t : kCeCollectiveTypes) {
    if (ce_allows(c, t)) names.push_back(to_string(t));
  }
  return names;
}

bool all_ce_collectives(const PlanConfig& c) {
  for (CollectiveType t : kCeCollectiveTypes) {
    if (!ce_allows(c, t)) return false;
  }
  return true;
}

PlanBucket read_bucket(const json& j, const std::string& path) {
  ObjectReader r(j, path,
                 {"id", "type", "block", "block_path", "group", "group_size", "dtype", "reduce_op", "members", "bytes",
                  "backend", "reason", "predicted"},
                 true, {"copy_rate_gbps", "role", "overlaps"});
  PlanBucket b;
  b.id = static_cast<int>(int_value(r["id"], r.path("id"), 0, INT_MAX, "0..2^31-1"));
  const std::string type = string_value(r["type"], r.path("type"));
  try {
    b.type = collective_type_from_string(type);
  } catch (const IrError& e) {
    fail_schema(r.path("type"), e.what());
  }
  if (!r["block"].is_null()) b.block = static_cast<int>(int_value(r["block"], r.path("block"), 0, INT_MAX, "0..2^31-1 or null"));
  b.block_path = optional_string_value(r["block_path"], r.path("block_path"));
  b.group = string_value(r["group"], r.path("group"));
  b.group_size = static_cast<int>(int_value(r["group_size"], r.path("group_size"), 1, 65536, "1..65536"));
  b.dtype = optional_string_value(r["dtype"], r.path("dtype"));
  b.reduce_op = optional_string_value(r["reduce_op"], r.path("reduce_op"));
  const json& members = r["members"];
  const std::string mpath = r.path("members");
  if (!members.is_array()) fail_schema(mpath, "expected an array, got " + describe(members));
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
                 {"nccl_us", "ce_us", "window_us", "nccl_cost_us", "ce_cost_us", "exposed_us"}, true,
                 {"hier_us", "hier_cost_us"});
  b.predicted.nccl_us = us_value(p["nccl_us"], p.path("nccl_us"));
  b.predicted.ce_us = optional_us_value(p["ce_us"], p.path("ce_us"));
  b.predicted.window_us = us_value(p["window_us"], p.path("window_us"));
  b.predicted.nccl_cost_us = us_value(p["nccl_cost_us"], p.path("nccl_cost_us"));
  b.predicted.ce_cost_us = optional_us_value(p["ce_cost_us"], p.path("ce_cost_us"));
  b.predicted.exposed_us = us_value(p["exposed_us"], p.path("exposed_us"));
  if (p.has("hier_us")) b.predicted.hier_us = optional_us_value(p["hier_us"], p.path("hier_us"));
  if (p.has("hier_cost_us")) b.predicted.hier_cost_us = optional_us_value(p["hier_cost_us"], p.path("hier_cost_us"));
  if (r.has("copy_rate_gbps")) {
    const json& v = r["copy_rate_gbps"];
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() <= 0) {
      fail_schema(r.path("copy_rate_gbps"), "expected a positive number of GB/s, got " + describe(v));
    }
    b.copy_rate_gbps = v.get<double>();
  }
  if (r.has("role")) {
    const std::string role = string_value(r["role"], r.path("role"));
    try {
      b.role = collective_role_from_string(role);
    } catch (const IrError& e) {
      fail_schema(r.path("role"), e.what());
    }
  }
  if (r.has("overlaps")) {
    const json& overlaps = r["overlaps"];
    const std::string opath = r.path("overlaps");
    if (!overlaps.is_array()) fail_schema(opath, "expected an array, got " + describe(overlaps));
    for (size_t k = 0; k < overlaps.size(); ++k) {
      ObjectReader o(overlaps[k], at(opath, k), {"collective", "overlap_us", "collective_added_us", "bucket_added_us"});
      PlanOverlap overlap;
      overlap.collective = string_value(o["collective"], o.path("collective"));
      overlap.overlap_us = us_value(o["overlap_us"], o.path("overlap_us"));
      overlap.collective_added_us = us_value(o["collective_added_us"], o.path("collective_added_us"));
      overlap.bucket_added_us = us_value(o["bucket_added_us"], o.path("bucket_added_us"));
      b.overlaps.push_back(std::move(overlap));
    }
  }
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
    fail_schema(r.path("plan_ms"), "expected a non-negative number of milliseconds, got " + describe(r["plan_ms"]));
  }
  s.plan_ms = r["plan_ms"].get<double>();
  return s;
}

// --- canonical writer ---
// A Plan is written one bucket per line, each object on that line as {"key": value, "key": value}: diffs of two plans
// read bucket by bucket, and save -> load -> save is byte-identical (the fuzzer's oracle).

void put(std::string& out, const json& v) {
  try {
    out += v.dump();
  } catch (const json::exception& e) {
    throw IrError(std::string("plan: cannot be written as JSON: ") + e.what());
  }
}
json opt(const std::optional<std::string>& s) { return s ? json(*s) : json(nullptr); }
json opt(const std::optional<double>& d) { return d ? json(*d) : json(nullptr); }
json opt(const std::optional<int>& i) { return i ? json(*i) : json(nullptr); }
json num(double d) { return json(d); }  // shortest text that reads back to the same double

// One JSON object written in place: Line(out).field("a", 1).field("b", "x").close() appends {"a": 1, "b": "x"}.
class Line {
 public:
  explicit Line(std::string& out) : out_(out) { out_ += '{'; }
  Line& field(const char* name, const json& value) {
    key(name);
    put(out_, value);
    return *this;
  }
  // A field whose value the caller appends: returns the string to append it to.
  std::string& raw(const char* name) {
    key(name);
    return out_;
  }
  void close() { out_ += '}'; }

 private:
  void key(const char* name) {
    if (!first_) out_ += ", ";
    first_ = false;
    out_ += '"';
    out_ += name;
    out_ += "\": ";
  }
  std::string& out_;
  bool first_ = true;
};

// A JSON list on one line: ["a", "b"] (nlohmann's compact dump writes ["a","b"]).
void write_list(std::string& out, const std::vector<std::string>& items) {
  out += '[';
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += ", ";
    put(out, items[i]);
  }
  out += ']';
}

void write_config(std::string& out, const PlanConfig& c) {
  Line line(out);
  line.field("bucket_cap_bytes", c.bucket_cap_bytes)
      .field("memory_budget_bytes", c.memory_budget_bytes)
      .field("ce", to_string(c.ce))
      .field("min_ce_bytes", c.min_ce_bytes)
      .field("prefetch_blocks", c.prefetch_blocks);
  write_list(line.raw("bucket_patterns"), c.bucket_patterns);
  // The optional keys, only where they differ from the default: plans made before they existed read back the same.
  if (c.ce_reduction != CeReduction::Consumer) line.field("ce_reduction", to_string(c.ce_reduction));
  if (!all_ce_collectives(c)) line.field("ce_collectives", ce_collective_names(c));
  if (c.copy_pace_fill != 0) line.field("copy_pace_fill", num(c.copy_pace_fill));
  if (c.keep_order) line.field("keep_order", true);
  line.close();
}

void write_bucket(std::string& out, const PlanBucket& b) {
  Line line(out);
  line.field("id", b.id)
      .field("type", to_string(b.type))
      .field("block", opt(b.block))
      .field("block_path", opt(b.block_path))
      .field("group", b.group)
      .field("group_size", b.group_size)
      .field("dtype", opt(b.dtype))
      .field("reduce_op", opt(b.reduce_op));
  std::string& members = line.raw("members");
  members += '[';
  for (size_t k = 0; k < b.members.size(); ++k) {
    const PlanMember& m = b.members[k];
    if (k) members += ", ";
    Line(members).field("collective", m.collective).field("wait", opt(m.wait)).field("bytes", m.bytes).close();
  }
  members += ']';
  const PlanPrediction& p = b.predicted;
  line.field("bytes", b.bytes).field("backend", b.backend).field("reason", b.reason);
  Line predicted(line.raw("predicted"));
  predicted.field("nccl_us", num(p.nccl_us))
      .field("ce_us", opt(p.ce_us))
      .field("window_us", num(p.window_us))
      .field("nccl_cost_us", num(p.nccl_cost_us))
      .field("ce_cost_us", opt(p.ce_cost_us))
      .field("exposed_us", num(p.exposed_us));
  if (p.hier_us) predicted.field("hier_us", num(*p.hier_us)).field("hier_cost_us", opt(p.hier_cost_us));
  predicted.close();
  if (b.copy_rate_gbps) line.field("copy_rate_gbps", num(*b.copy_rate_gbps));
  if (b.role != CollectiveRole::Unknown) line.field("role", to_string(b.role));
  if (!b.overlaps.empty()) {
    std::string& overlaps = line.raw("overlaps");
    overlaps += '[';
    for (size_t k = 0; k < b.overlaps.size(); ++k) {
      const PlanOverlap& o = b.overlaps[k];
      if (k) overlaps += ", ";
      Line(overlaps)
          .field("collective", o.collective)
          .field("overlap_us", num(o.overlap_us))
          .field("collective_added_us", num(o.collective_added_us))
          .field("bucket_added_us", num(o.bucket_added_us))
          .close();
    }
    overlaps += ']';
  }
  line.close();
}

void write_summary(std::string& out, const PlanSummary& s) {
  Line line(out);
  line.field("collectives", s.collectives)
      .field("buckets", s.buckets)
      .field("ce_buckets", s.ce_buckets)
      .field("exposed_comm_us_before", num(s.exposed_comm_us_before))
      .field("exposed_comm_us_after", num(s.exposed_comm_us_after));
  if (s.makespan_us_before) line.field("makespan_us_before", num(*s.makespan_us_before));
  if (s.makespan_us_after) line.field("makespan_us_after", num(*s.makespan_us_after));
  line.field("peak_memory_bytes_before", s.peak_memory_bytes_before)
      .field("peak_memory_bytes_after", s.peak_memory_bytes_after)
      .field("memory_budget_bytes", s.memory_budget_bytes)
      .field("plan_ms", num(s.plan_ms))
      .close();
}

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
              {"ce_reduction", to_string(c.ce_reduction)}, {"ce_collectives", ce_collective_names(c)},
              {"copy_pace_fill", c.copy_pace_fill}, {"keep_order", c.keep_order}};
}

bool ce_allows(const PlanConfig& config, CollectiveType type) {
  return std::find(config.ce_collectives.begin(), config.ce_collectives.end(), type) != config.ce_collectives.end();
}

namespace {

Plan read_plan(const json& j) {
  ObjectReader r(j, "", {"schema", "graph", "profile", "config", "buckets", "order", "summary"}, false);
  if (!r.has("schema")) fail_schema("schema", "missing required field");
  if (!r["schema"].is_string() || r["schema"].get_ref<const std::string&>() != kPlanSchema) {
    fail_schema("schema", std::string("expected \"") + kPlanSchema + "\", got " + describe(r["schema"]));
  }
  ObjectReader all(j, "", {"schema", "graph", "profile", "config", "buckets", "order", "summary"});
  Plan plan;
  plan.graph = string_value(all["graph"], "graph");
  plan.profile = string_value(all["profile"], "profile");
  plan.config = read_config(all["config"], "config", true);
  const json& buckets = all["buckets"];
  if (!buckets.is_array()) fail_schema("buckets", "expected an array, got " + describe(buckets));
  for (size_t i = 0; i < buckets.size(); ++i) plan.buckets.push_back(read_bucket(buckets[i], at("buckets", i)));
  const json& order = all["order"];
  if (!order.is_array()) fail_schema("order", "expected an array of node names, got " + describe(order));
  plan.order.reserve(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    if (!order[i].is_string()) fail_schema(at("order", i), "expected a node name, got " + describe(order[i]));
    plan.order.push_back(order[i].get<std::string>());
  }
  plan.summary = read_summary(all["summary"], "summary");
  return plan;
}

json parse_json(const std::string& json_text) {
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
    throw PlanRuleError("schema", std::nullopt, "malformed JSON: " + message + " (byte " + std::to_string(e.byte) + ")");
  } catch (const json::exception& e) {  // out_of_range: a number beyond a double
    std::string message = e.what();
    const auto tag_end = message.find("] ");
    if (message.rfind("[json.exception.", 0) == 0 && tag_end != std::string::npos) message.erase(0, tag_end + 2);
    throw PlanRuleError("schema", std::nullopt, "malformed JSON: " + message);
  }
  if (!duplicate.empty()) {
    throw PlanRuleError("schema", std::nullopt, "malformed plan: duplicate key " + json_quoted(duplicate) + " in an object");
  }
  return j;
}

}  // namespace

Plan plan_from_json(const json& j) {
  Plan plan = read_plan(j);
  validate_plan(plan);
  return plan;
}

Plan parse_plan(const std::string& json_text) { return read_plan(parse_json(json_text)); }

Plan load_plan(const std::string& json_text) { return plan_from_json(parse_json(json_text)); }

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

}  // namespace ce_overlap
