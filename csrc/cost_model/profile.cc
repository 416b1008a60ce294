// Loading, validating and saving hardware profiles (schema ce_overlap.profile/1).
// Every field is required and checked, unknown keys are rejected: a typo must not become a default.
#include "profile.h"

#include <climits>
#include <cmath>
#include <initializer_list>
#include <string>

namespace ce_overlap {

namespace {

using nlohmann::json;

// A short rendering of a JSON value for error messages; long values are cut so a message stays one line.
std::string describe(const json& v) {
  std::string s = v.dump();
  constexpr size_t kMaxChars = 60;
  if (s.size() > kMaxChars) s = s.substr(0, kMaxChars) + "...";
  return s;
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

  int positive_int(const char* key) const {
    const json& v = field(key, "a positive integer");
    bool ok = false;
    if (v.is_number_unsigned()) {
      ok = v.get<uint64_t>() >= 1 && v.get<uint64_t>() <= static_cast<uint64_t>(INT_MAX);
    } else if (v.is_number_integer()) {
      ok = v.get<int64_t>() >= 1 && v.get<int64_t>() <= INT_MAX;
    }
    if (!ok) throw IrError(child(key) + ": expected a positive integer, got " + describe(v));
    return static_cast<int>(v.get<int64_t>());
  }

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

 private:
  template <typename Pred>
  double number(const char* key, const char* what, Pred ok) const {
    const json& v = field(key, what);
    if (!v.is_number() || !std::isfinite(v.get<double>()) || !ok(v.get<double>())) {
      throw IrError(child(key) + ": expected " + what + ", got " + describe(v));
    }
    return v.get<double>();
  }

  const json& j_;
  std::string path_;
};

LinkSpec read_link(const ObjectReader& topo, const char* key) {
  ObjectReader r = topo.object(key, {"kind", "gbps_per_direction", "p2p"});
  LinkSpec l;
  l.kind = r.string("kind", true);
  l.gbps_per_direction = r.positive_number("gbps_per_direction");
  l.p2p = r.boolean("p2p");
  return l;
}

json link_to_json(const LinkSpec& l) {
  return json{{"kind", l.kind}, {"gbps_per_direction", l.gbps_per_direction}, {"p2p", l.p2p}};
}

}  // namespace

Profile profile_from_json(const json& j) {
  ObjectReader root(j, "", {"schema", "name", "description", "gpu", "topology", "efficiency", "nccl"});
  const json& schema = root.field("schema", "\"ce_overlap.profile/1\"");
  if (!schema.is_string() || schema.get_ref<const std::string&>() != kProfileSchema) {
    throw IrError("schema: expected \"" + std::string(kProfileSchema) + "\", got " + describe(schema));
  }

  Profile p;
  p.name = root.string("name", true);
  p.description = root.string("description", false);

  ObjectReader gpu = root.object(
      "gpu", {"name", "sms", "peak_bf16_tflops", "peak_fp32_tflops", "hbm_gbps", "copy_engines", "memory_gib"});
  p.gpu.name = gpu.string("name", true);
  p.gpu.sms = gpu.positive_int("sms");
  p.gpu.peak_bf16_tflops = gpu.positive_number("peak_bf16_tflops");
  p.gpu.peak_fp32_tflops = gpu.positive_number("peak_fp32_tflops");
  p.gpu.hbm_gbps = gpu.positive_number("hbm_gbps");
  p.gpu.copy_engines = gpu.positive_int("copy_engines");
  p.gpu.memory_gib = gpu.positive_number("memory_gib");

  ObjectReader topo = root.object("topology", {"gpus_per_node", "intra_node", "inter_node"});
  p.topology.gpus_per_node = topo.positive_int("gpus_per_node");
  p.topology.intra_node = read_link(topo, "intra_node");
  p.topology.inter_node = read_link(topo, "inter_node");

  ObjectReader eff = root.object("efficiency", {"gemm", "memory", "kernel_launch_us"});
  p.efficiency.gemm = eff.fraction("gemm");
  p.efficiency.memory = eff.fraction("memory");
  p.efficiency.kernel_launch_us = eff.non_negative_number("kernel_launch_us");

  ObjectReader nccl = root.object("nccl", {"base_latency_us", "per_step_latency_us", "bus_efficiency"});
  p.nccl.base_latency_us = nccl.non_negative_number("base_latency_us");
  p.nccl.per_step_latency_us = nccl.non_negative_number("per_step_latency_us");
  p.nccl.bus_efficiency = nccl.fraction("bus_efficiency");
  return p;
}

Profile load_profile(const std::string& json_text) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::parse_error& e) {
    throw IrError(std::string("malformed JSON: ") + e.what());
  }
  return profile_from_json(j);
}

json profile_to_json(const Profile& p) {
  return json{
      {"schema", kProfileSchema},
      {"name", p.name},
      {"description", p.description},
      {"gpu",
       {{"name", p.gpu.name},
        {"sms", p.gpu.sms},
        {"peak_bf16_tflops", p.gpu.peak_bf16_tflops},
        {"peak_fp32_tflops", p.gpu.peak_fp32_tflops},
        {"hbm_gbps", p.gpu.hbm_gbps},
        {"copy_engines", p.gpu.copy_engines},
        {"memory_gib", p.gpu.memory_gib}}},
      {"topology",
       {{"gpus_per_node", p.topology.gpus_per_node},
        {"intra_node", link_to_json(p.topology.intra_node)},
        {"inter_node", link_to_json(p.topology.inter_node)}}},
      {"efficiency",
       {{"gemm", p.efficiency.gemm},
        {"memory", p.efficiency.memory},
        {"kernel_launch_us", p.efficiency.kernel_launch_us}}},
      {"nccl",
       {{"base_latency_us", p.nccl.base_latency_us},
        {"per_step_latency_us", p.nccl.per_step_latency_us},
        {"bus_efficiency", p.nccl.bus_efficiency}}},
  };
}

}  // namespace ce_overlap
