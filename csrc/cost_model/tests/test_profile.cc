// Profile loading: the built-in files load, bad input is rejected with a message naming the field.
#include <gtest/gtest.h>

#include <string>

#include "cost_model/cost_model.h"
#include "cost_model/profile.h"
#include "test_util.h"

namespace ce_overlap {
namespace {

using nlohmann::json;
using testing::builtin_profile;
using testing::round_profile;

const char* kBuiltins[] = {"h100-sxm", "h200-sxm", "a100-sxm", "b200", "h100-pcie"};

// The message of the IrError that profile_from_json throws for j, or "" if it accepts j.
std::string error_of(const json& j) {
  try {
    profile_from_json(j);
  } catch (const IrError& e) {
    return e.what();
  }
  return "";
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A two-GPU node in the per-pair (matrix) form, as `ce-overlap topo --json` writes it.
json matrix_topology() {
  return json::parse(R"({
    "gpus_per_node": 2,
    "numa_node": [0, 0],
    "matrix": {
      "kind": [["X", "nvlink4"], ["nvlink4", "X"]],
      "gbps_per_direction": [[0, 478.0], [478.0, 0]],
      "p2p": [[true, true], [true, true]]
    }
  })");
}

json with_topology(const json& topology) {
  json j = profile_to_json(round_profile());
  j["topology"] = topology;
  return j;
}

TEST(Profile, BuiltinFilesLoad) {
  for (const char* name : kBuiltins) {
    SCOPED_TRACE(name);
    Profile p = builtin_profile(name);
    EXPECT_EQ(p.name, name);
    EXPECT_EQ(p.topology.gpus_per_node, 8);
    ASSERT_TRUE(p.topology.intra_node.has_value());
    ASSERT_TRUE(p.topology.inter_node.has_value());
    EXPECT_FALSE(p.topology.inter_node->p2p);
    EXPECT_TRUE(p.curves.empty());  // built-ins use the analytic model
    // Every description says what is measured or from specs, and what is assumed.
    EXPECT_TRUE(contains(p.description, "PUBLIC SPECS")) << p.description;
    EXPECT_TRUE(contains(p.description, "ASSUMED")) << p.description;
    CostModel m(p);  // and passes the model's own checks
  }
  Profile h200 = builtin_profile("h200-sxm");
  EXPECT_EQ(h200.gpu.sms, 132);
  EXPECT_DOUBLE_EQ(h200.gpu.hbm_gbps, 4800.0);
  EXPECT_EQ(h200.gpu.copy_engines, 3);
  EXPECT_DOUBLE_EQ(h200.topology.intra_node->gbps_per_direction, 478.0);
  EXPECT_TRUE(contains(h200.description, "MEASURED"));
  EXPECT_DOUBLE_EQ(builtin_profile("h100-sxm").gpu.hbm_gbps, 3350.0);
  EXPECT_EQ(builtin_profile("a100-sxm").topology.intra_node->kind, "nvlink3");
  EXPECT_EQ(builtin_profile("b200").topology.intra_node->kind, "nvlink5");

  // The PCIe variant: no NVLink anywhere, P2P inside a socket only.
  Profile pcie = builtin_profile("h100-pcie");
  for (int a = 0; a < 8; ++a) {
    for (int b = 0; b < 8; ++b) {
      if (a == b) continue;
      const LinkSpec& l = pcie.topology.link(a, b);
      EXPECT_EQ(l.kind.find("nvlink"), std::string::npos);
      EXPECT_EQ(l.p2p, pcie.topology.numa_node[a] == pcie.topology.numa_node[b]) << a << "-" << b;
    }
  }
}

TEST(Profile, RoundTrip) {
  Profile p = round_profile();
  json j = profile_to_json(p);
  EXPECT_EQ(j["schema"], kProfileSchema);
  Profile q = profile_from_json(j);
  EXPECT_EQ(profile_to_json(q), j);
  for (const char* name : kBuiltins) {
    Profile h = builtin_profile(name);
    EXPECT_EQ(profile_to_json(load_profile(profile_to_json(h).dump())), profile_to_json(h)) << name;
  }
  json m = with_topology(matrix_topology());
  EXPECT_EQ(profile_to_json(profile_from_json(m)), m);
}

TEST(Profile, NcclBusEfficiencyScale) {
  // Lookup: the listed size, linear between listed sizes, the nearest listed size outside them, 1 when none is listed.
  NcclSpec nccl;
  nccl.bus_efficiency_scale = {{CollectiveType::AllGather, 2, 1.0}, {CollectiveType::AllGather, 4, 1.3},
                               {CollectiveType::Broadcast, 3, 1.5}};
  EXPECT_DOUBLE_EQ(nccl.scale(CollectiveType::AllGather, 2), 1.0);
  EXPECT_DOUBLE_EQ(nccl.scale(CollectiveType::AllGather, 3), 1.15);
  EXPECT_DOUBLE_EQ(nccl.scale(CollectiveType::AllGather, 4), 1.3);
  EXPECT_DOUBLE_EQ(nccl.scale(CollectiveType::AllGather, 8), 1.3);
  EXPECT_DOUBLE_EQ(nccl.scale(CollectiveType::Broadcast, 2), 1.5);
  EXPECT_DOUBLE_EQ(nccl.scale(CollectiveType::ReduceScatter, 4), 1.0);
  // It round-trips, and bad entries name their field.
  json j = profile_to_json(round_profile());
  j["nccl"]["bus_efficiency_scale"] = json::parse(R"([{"collective": "all_gather", "group_size": 4, "scale": 1.25}])");
  Profile q = profile_from_json(j);
  ASSERT_EQ(q.nccl.bus_efficiency_scale.size(), 1u);
  EXPECT_DOUBLE_EQ(q.nccl.scale(CollectiveType::AllGather, 4), 1.25);
  EXPECT_EQ(profile_to_json(q), j);
  j["nccl"]["bus_efficiency_scale"][0]["scale"] = 0;
  EXPECT_EQ(error_of(j), "nccl.bus_efficiency_scale[0].scale: expected a positive number, got 0");
  j["nccl"]["bus_efficiency_scale"][0]["scale"] = 1.25;
  j["nccl"]["bus_efficiency_scale"][0]["group_size"] = 1;
  EXPECT_TRUE(starts_with(error_of(j), "nccl.bus_efficiency_scale[0].group_size: expected at least 2")) << error_of(j);
  j["nccl"]["bus_efficiency_scale"] = json::parse(R"([{"collective": "all_gather", "group_size": 4, "scale": 1.2},
                                                      {"collective": "all_gather", "group_size": 4, "scale": 1.3}])");
  EXPECT_TRUE(starts_with(error_of(j), "nccl.bus_efficiency_scale[1]: a second scale for all_gather with 4 ranks"))
      << error_of(j);
  j["nccl"]["bus_efficiency_scale"] = json::parse(R"([{"collective": "all_gathr", "group_size": 4, "scale": 1.2}])");
  EXPECT_TRUE(contains(error_of(j), "all_gathr")) << error_of(j);
  j["nccl"]["bus_efficiency_scale"] = json::parse(R"([{"collective": "all_gather", "ranks": 4, "scale": 1.2}])");
  EXPECT_TRUE(contains(error_of(j), "nccl.bus_efficiency_scale[0].ranks: unknown key")) << error_of(j);
}

TEST(Profile, NcclScaleSpeedsTheRingUp) {
  // A bandwidth-bound NCCL all-gather on 4 ranks takes 1 / scale of the unscaled time; other group sizes and
  // collectives keep theirs.
  Profile p = builtin_profile("h200-sxm");
  p.nccl.bus_efficiency_scale.clear();
  Profile scaled = p;
  scaled.nccl.bus_efficiency_scale = {{CollectiveType::AllGather, 4, 1.25}};
  auto us = [](const Profile& prof, CollectiveType t, int n) {
    CollectiveInfo c;
    c.type = t;
    c.group_size = n;
    c.bytes = int64_t{1} << 34;
    return CostModel(prof).estimate(c, Backend::Nccl).us;
  };
  EXPECT_NEAR(us(p, CollectiveType::AllGather, 4) / us(scaled, CollectiveType::AllGather, 4), 1.25, 0.01);
  EXPECT_NEAR(us(p, CollectiveType::AllGather, 8) / us(scaled, CollectiveType::AllGather, 8), 1.25, 0.01);
  EXPECT_DOUBLE_EQ(us(p, CollectiveType::ReduceScatter, 4), us(scaled, CollectiveType::ReduceScatter, 4));
}

TEST(Profile, NegativeBandwidthNamesField) {
  json j = profile_to_json(round_profile());
  j["gpu"]["hbm_gbps"] = -1;
  EXPECT_EQ(error_of(j), "gpu.hbm_gbps: expected a positive number, got -1");
  j = profile_to_json(round_profile());
  j["topology"]["inter_node"]["gbps_per_direction"] = 0;
  EXPECT_TRUE(starts_with(error_of(j), "topology.inter_node.gbps_per_direction: expected a positive number"))
      << error_of(j);
  j = profile_to_json(round_profile());
  j["topology"]["pairs"] = json::parse(R"([{"gpus": [0, 3], "kind": "pcie5", "gbps_per_direction": -5, "p2p": true}])");
  EXPECT_EQ(error_of(j), "topology.pairs[0].gbps_per_direction: expected a positive number, got -5");
  json t = matrix_topology();
  t["matrix"]["gbps_per_direction"] = json::parse("[[0, -478], [-478, 0]]");
  EXPECT_EQ(error_of(with_topology(t)),
            "topology.matrix.gbps_per_direction[0][1]: expected a positive number, got -478");
  j = profile_to_json(round_profile());
  j["ce"]["engine_gbps"] = -400;
  EXPECT_EQ(error_of(j), "ce.engine_gbps: expected a positive number, got -400");
}

TEST(Profile, MatrixMissingPairNamesIt) {
  json t = matrix_topology();
  t["matrix"]["gbps_per_direction"][0][1] = nullptr;
  EXPECT_EQ(error_of(with_topology(t)), "topology.matrix.gbps_per_direction[0][1]: missing pair (0, 1)");
  t = matrix_topology();
  t["matrix"]["p2p"][0] = json::array({true});  // a short row
  EXPECT_EQ(error_of(with_topology(t)), "topology.matrix.p2p[0][1]: missing pair (0, 1)");
  t = matrix_topology();
  t["matrix"]["kind"].erase(1);
  EXPECT_EQ(error_of(with_topology(t)), "topology.matrix.kind[1][0]: missing pair (1, 0)");
  t = matrix_topology();
  t["gpus_per_node"] = 3;
  t["numa_node"] = {0, 0, 0};
  EXPECT_EQ(error_of(with_topology(t)), "topology.matrix.kind[0][2]: missing pair (0, 2)");
  t = matrix_topology();
  t["matrix"]["kind"].push_back(json::array({"X", "X"}));
  EXPECT_EQ(error_of(with_topology(t)), "topology.matrix.kind: expected 2 rows (topology.gpus_per_node), got 3");
}

TEST(Profile, MatrixAsymmetryRejected) {
  json t = matrix_topology();
  t["matrix"]["gbps_per_direction"][1][0] = 450.0;
  EXPECT_EQ(error_of(with_topology(t)),
            "topology.matrix.gbps_per_direction[1][0]: 450.0 differs from [0][1] = 478.0 (links are symmetric: "
            "the same GB/s each way)");
  t = matrix_topology();
  t["matrix"]["kind"][1][0] = "pcie5";
  EXPECT_TRUE(starts_with(error_of(with_topology(t)), "topology.matrix.kind[1][0]: \"pcie5\" differs from [0][1]"))
      << error_of(with_topology(t));
  t = matrix_topology();
  t["matrix"]["p2p"][1][0] = false;
  EXPECT_TRUE(starts_with(error_of(with_topology(t)), "topology.matrix.p2p[1][0]: false differs from [0][1]"))
      << error_of(with_topology(t));
  t = matrix_topology();
  t["matrix"]["kind"][0][0] = "nvlink4";
  EXPECT_EQ(error_of(with_topology(t)), "topology.matrix.kind[0][0]: expected \"X\" on the diagonal, got \"nvlink4\"");
}

TEST(Profile, PairListedTwiceRejected) {
  json j = profile_to_json(round_profile());
  j["topology"]["pairs"] = json::parse(R"([
      {"gpus": [0, 3], "kind": "pcie5", "gbps_per_direction": 50, "p2p": true},
      {"gpus": [3, 0], "kind": "pcie5", "gbps_per_direction": 50, "p2p": false}])");
  EXPECT_EQ(error_of(j), "topology.pairs[1].gpus: pair (0, 3) listed twice (also at topology.pairs[0])");
  j["topology"]["pairs"][1]["gpus"] = {2, 8};
  EXPECT_EQ(error_of(j),
            "topology.pairs[1].gpus[1]: expected a local GPU index below topology.gpus_per_node = 8, got 8");
  j["topology"]["pairs"][1]["gpus"] = {2, 2};
  EXPECT_EQ(error_of(j), "topology.pairs[1].gpus: expected two different GPUs, got [2,2]");
  j["topology"]["pairs"][1]["gpus"] = {1, 2};
  EXPECT_EQ(error_of(j), "");
  Profile p = profile_from_json(j);
  EXPECT_FALSE(p.topology.link(2, 1).p2p);  // either order finds the override
  EXPECT_TRUE(p.topology.link(1, 3).p2p);   // the default elsewhere
}

TEST(Profile, TopologyFormsAreExclusive) {
  json t = matrix_topology();
  t["intra_node"] = {{"kind", "nvlink4"}, {"gbps_per_direction", 478}, {"p2p", true}};
  EXPECT_TRUE(starts_with(error_of(with_topology(t)),
                          "topology.matrix: not allowed together with topology.intra_node"));
  t = matrix_topology();
  t.erase("matrix");
  EXPECT_TRUE(starts_with(error_of(with_topology(t)), "topology.intra_node: missing")) << error_of(with_topology(t));
  t = matrix_topology();
  t["pairs"] = json::array();
  EXPECT_TRUE(starts_with(error_of(with_topology(t)), "topology.pairs: not allowed with topology.matrix"));
  t = matrix_topology();
  t["numa_node"] = {0};
  EXPECT_EQ(error_of(with_topology(t)),
            "topology.numa_node: expected 2 entries (one per GPU of a node, topology.gpus_per_node), got 1");
  t = matrix_topology();
  t["gpus_per_node"] = 2048;
  EXPECT_EQ(error_of(with_topology(t)), "topology.gpus_per_node: expected at most 1024, got 2048");
  // The matrix form needs no inter_node link; topology_from_json reads it alone.
  TopologySpec spec = topology_from_json(matrix_topology());
  EXPECT_FALSE(spec.inter_node.has_value());
  EXPECT_DOUBLE_EQ(spec.link(1, 0).gbps_per_direction, 478.0);
  EXPECT_EQ(topology_to_json(spec), matrix_topology());
}

TEST(Profile, MissingFieldNamesField) {
  json j = profile_to_json(round_profile());
  j["nccl"]["protocols"][0].erase("bus_efficiency");
  EXPECT_TRUE(starts_with(error_of(j), "nccl.protocols[0].bus_efficiency: missing")) << error_of(j);
  j = profile_to_json(round_profile());
  j.erase("topology");
  EXPECT_TRUE(starts_with(error_of(j), "topology: missing")) << error_of(j);
  j = profile_to_json(round_profile());
  j.erase("ce");
  EXPECT_TRUE(starts_with(error_of(j), "ce: missing")) << error_of(j);
  j = profile_to_json(round_profile());
  j["contention"]["memory_bound"].erase("hbm_sensitivity");
  EXPECT_TRUE(starts_with(error_of(j), "contention.memory_bound.hbm_sensitivity: missing")) << error_of(j);
}

TEST(Profile, UnknownKeyNamesField) {
  json j = profile_to_json(round_profile());
  j["gpu"]["hbm_gbs"] = 1000;  // a typo must not pass as a default
  EXPECT_TRUE(starts_with(error_of(j), "gpu.hbm_gbs: unknown key")) << error_of(j);
  j = profile_to_json(round_profile());
  j["extra"] = 1;
  EXPECT_TRUE(starts_with(error_of(j), "extra: unknown key")) << error_of(j);
  j = profile_to_json(round_profile());
  j["ce"]["latency_us"] = 1;
  EXPECT_TRUE(starts_with(error_of(j), "ce.latency_us: unknown key")) << error_of(j);
}

TEST(Profile, EfficiencyMustBeFraction) {
  for (double bad : {0.0, 1.5, -0.2}) {
    json j = profile_to_json(round_profile());
    j["efficiency"]["gemm"] = bad;
    EXPECT_TRUE(starts_with(error_of(j), "efficiency.gemm: expected a number in (0, 1]")) << error_of(j);
  }
  json j = profile_to_json(round_profile());
  j["nccl"]["protocols"][0]["bus_efficiency"] = 1.01;
  EXPECT_TRUE(starts_with(error_of(j), "nccl.protocols[0].bus_efficiency: expected a number in (0, 1]"))
      << error_of(j);
  j["nccl"]["protocols"][0]["bus_efficiency"] = 1.0;  // the bound itself is allowed
  EXPECT_EQ(error_of(j), "");
  j["ce"]["bidirectional_efficiency"] = 0;
  EXPECT_TRUE(starts_with(error_of(j), "ce.bidirectional_efficiency: expected a number in (0, 1]")) << error_of(j);
}

TEST(Profile, OptionalEfficiencies) {
  // Absent: not written back (the defaults apply); present: fractions, round-tripped.
  json j = profile_to_json(round_profile());
  EXPECT_FALSE(j["efficiency"].contains("attention"));
  EXPECT_FALSE(j["efficiency"].contains("optimizer"));
  j["efficiency"]["attention"] = 0.5;
  j["efficiency"]["attention_backward"] = 0.4;
  j["efficiency"]["optimizer"] = 0.7;
  EXPECT_EQ(profile_from_json(j).efficiency.flex_attention_or_attention(true), 0.4);  // absent: attention's
  j["efficiency"]["flex_attention"] = 0.3;
  j["efficiency"]["flex_attention_backward"] = 0.2;
  Profile p = profile_from_json(j);
  EXPECT_EQ(p.efficiency.attention, 0.5);
  EXPECT_EQ(p.efficiency.attention_or_gemm(true), 0.4);
  EXPECT_EQ(p.efficiency.optimizer, 0.7);
  EXPECT_EQ(p.efficiency.flex_attention_or_attention(false), 0.3);
  EXPECT_EQ(p.efficiency.flex_attention_or_attention(true), 0.2);
  EXPECT_EQ(profile_to_json(p)["efficiency"], j["efficiency"]);
  for (const char* key :
       {"attention", "attention_backward", "optimizer", "flex_attention", "flex_attention_backward"}) {
    for (double bad : {0.0, 1.2, -1.0}) {
      json k = j;
      k["efficiency"][key] = bad;
      EXPECT_TRUE(starts_with(error_of(k), std::string("efficiency.") + key + ": expected a number in (0, 1]"))
          << error_of(k);
    }
  }
}

TEST(Profile, HostSection) {
  // Optional: absent, none (and none written back); present, every term a non-negative number, round-tripped.
  json j = profile_to_json(round_profile());
  EXPECT_FALSE(j.contains("host"));
  EXPECT_FALSE(profile_from_json(j).host.has_value());
  j["host"] = {{"launch_us", 12.5}, {"graph_input_us", 3.0}, {"collective_us", 40.0}, {"step_us", 900.0},
               {"source", "bench/results/x"}};
  Profile p = profile_from_json(j);
  ASSERT_TRUE(p.host.has_value());
  EXPECT_EQ(p.host->launch_us, 12.5);
  EXPECT_EQ(p.host->collective_us, 40.0);
  EXPECT_EQ(p.host->source, "bench/results/x");
  EXPECT_EQ(profile_to_json(p)["host"], j["host"]);
  json bad = j;
  bad["host"]["launch_us"] = -1.0;
  EXPECT_TRUE(starts_with(error_of(bad), "host.launch_us: expected a non-negative number")) << error_of(bad);
  bad = j;
  bad["host"].erase("step_us");
  EXPECT_TRUE(contains(error_of(bad), "host.step_us")) << error_of(bad);
  bad = j;
  bad["host"]["per_kernel_us"] = 1.0;
  EXPECT_TRUE(contains(error_of(bad), "per_kernel_us")) << error_of(bad);
}

TEST(Profile, NcclAndCeSmsChecked) {
  json j = profile_to_json(round_profile());
  j["nccl"]["channels"] = 100;
  EXPECT_EQ(error_of(j), "nccl.channels: expected fewer than gpu.sms = 100, got 100");
  j = profile_to_json(round_profile());
  j["ce"]["reduce_sms"] = 0;
  EXPECT_EQ(error_of(j), "ce.reduce_sms: expected a positive integer, got 0");
  j = profile_to_json(round_profile());
  j["nccl"]["protocols"] = json::array();
  EXPECT_EQ(error_of(j), "nccl.protocols: expected at least one protocol line, got []");
  j = profile_to_json(round_profile());
  j["nccl"]["protocols"].push_back(j["nccl"]["protocols"][0]);
  EXPECT_EQ(error_of(j), "nccl.protocols[1].name: \"simple\" listed twice");
}

json with_curve(const json& curve) {
  json j = profile_to_json(round_profile());
  j["curves"] = json::array({curve});
  return j;
}

json good_curve() {
  return json::parse(R"({"collective": "all_gather", "backend": "ce", "group_size": 2,
                         "points": [[1048576, 20.0], [4194304, 30.0], [16777216, 60.0]]})");
}

TEST(Profile, CurvesValidated) {
  EXPECT_EQ(error_of(with_curve(good_curve())), "");
  json c = good_curve();
  c["points"][2][0] = 4194304;
  EXPECT_EQ(error_of(with_curve(c)),
            "curves[0].points[2][0]: bytes must increase from point to point, got 4194304.0 after 4194304.0");
  c = good_curve();
  c["points"][2][1] = 10.0;
  EXPECT_EQ(error_of(with_curve(c)),
            "curves[0].points[2][1]: time must not decrease with bytes, got 10.0 us after 30.0 us");
  c = good_curve();
  c["points"][1][1] = -1;
  EXPECT_EQ(error_of(with_curve(c)), "curves[0].points[1][1]: expected a positive number, got -1");
  c = good_curve();
  c["points"] = json::array({json::array({1, 2})});
  EXPECT_EQ(error_of(with_curve(c)), "curves[0].points: expected at least 2 [bytes, us] points, got 1");
  c = good_curve();
  c["collective"] = "allgather";
  EXPECT_TRUE(starts_with(error_of(with_curve(c)), "curves[0].collective: ")) << error_of(with_curve(c));
  EXPECT_TRUE(contains(error_of(with_curve(c)), "all_gather")) << error_of(with_curve(c));  // lists the names
  c = good_curve();
  c["backend"] = "nvshmem";
  EXPECT_EQ(error_of(with_curve(c)), "curves[0].backend: unknown backend \"nvshmem\" (accepted: nccl, ce, hier)");
  c = good_curve();
  c["group_size"] = 1;
  EXPECT_TRUE(starts_with(error_of(with_curve(c)), "curves[0].group_size: expected at least 2"));
  json j = with_curve(good_curve());
  j["curves"].push_back(good_curve());
  EXPECT_TRUE(
      starts_with(error_of(j), "curves[1]: a second curve for all_gather on ce with 2 ranks (also at curves[0])"))
      << error_of(j);
}

TEST(Profile, WrongTypesAndCounts) {
  json j = profile_to_json(round_profile());
  j["gpu"]["sms"] = 132.5;
  EXPECT_EQ(error_of(j), "gpu.sms: expected a positive integer, got 132.5");
  j["gpu"]["sms"] = 0;
  EXPECT_EQ(error_of(j), "gpu.sms: expected a positive integer, got 0");
  j = profile_to_json(round_profile());
  j["topology"]["gpus_per_node"] = "8";
  EXPECT_EQ(error_of(j), "topology.gpus_per_node: expected a positive integer, got \"8\"");
  j = profile_to_json(round_profile());
  j["topology"]["intra_node"]["p2p"] = 1;
  EXPECT_EQ(error_of(j), "topology.intra_node.p2p: expected a boolean, got 1");
  j = profile_to_json(round_profile());
  j["topology"]["numa_node"][2] = -1;
  EXPECT_EQ(error_of(j), "topology.numa_node[2]: expected a non-negative integer, got -1");
  j = profile_to_json(round_profile());
  j["gpu"]["peak_bf16_tflops"] = true;
  EXPECT_EQ(error_of(j), "gpu.peak_bf16_tflops: expected a positive number, got true");
  j = profile_to_json(round_profile());
  j["name"] = "";
  EXPECT_EQ(error_of(j), "name: expected a non-empty string, got \"\"");
  j = profile_to_json(round_profile());
  j["efficiency"] = json::array();
  EXPECT_EQ(error_of(j), "efficiency: expected an object, got []");
  j = profile_to_json(round_profile());
  j["nccl"]["protocols"][0]["base_latency_us"] = -3;
  EXPECT_EQ(error_of(j), "nccl.protocols[0].base_latency_us: expected a non-negative number, got -3");
  j = profile_to_json(round_profile());
  j["schema"] = "ce_overlap.profile/3";
  EXPECT_EQ(error_of(j), "schema: expected \"ce_overlap.profile/2\", got \"ce_overlap.profile/3\"");
  j["schema"] = "ce_overlap.profile/1";  // the previous layout gets a pointer to what changed
  EXPECT_TRUE(starts_with(error_of(j), "schema: expected \"ce_overlap.profile/2\", got \"ce_overlap.profile/1\" ("))
      << error_of(j);
  EXPECT_TRUE(starts_with(error_of(json::array()), "profile: expected an object")) << error_of(json::array());
}

TEST(Profile, MalformedJson) {
  try {
    load_profile("{\"schema\": \"ce_overlap.profile/2\", ");
    FAIL() << "accepted malformed JSON";
  } catch (const IrError& e) {
    EXPECT_TRUE(starts_with(e.what(), "malformed JSON: ")) << e.what();
  }
}

TEST(Profile, CostModelRejectsInvalidProfileBuiltInMemory) {
  Profile p = round_profile();
  p.gpu.hbm_gbps = 0;
  EXPECT_THROW(CostModel{p}, IrError);
  p = round_profile();
  p.topology.pairs.push_back({0, 1, {"pcie5", 10, true}});
  p.topology.pairs.push_back({0, 1, {"pcie5", 10, true}});
  EXPECT_THROW(CostModel{p}, IrError);
}

TEST(Profile, OptionalReductionKernelContention) {
  // Absent in a profile: absent after loading (the SM/HBM formula prices the reduction kernel).
  Profile p = round_profile();
  EXPECT_FALSE(profile_from_json(profile_to_json(p)).contention.ce_reduction.has_value());
  EXPECT_FALSE(profile_to_json(p)["contention"].contains("ce_reduction"));
  // Present: round-trips; a negative or missing value, or an unknown key, is refused naming the field.
  p.contention.ce_reduction = KernelClassSlowdown{0.1, 0.6};
  json j = profile_to_json(p);
  const Profile back = profile_from_json(j);
  ASSERT_TRUE(back.contention.ce_reduction.has_value());
  EXPECT_DOUBLE_EQ(back.contention.ce_reduction->compute_bound, 0.1);
  EXPECT_DOUBLE_EQ(back.contention.ce_reduction->memory_bound, 0.6);
  j["contention"]["ce_reduction"]["compute_bound"] = -0.1;
  EXPECT_TRUE(starts_with(error_of(j), "contention.ce_reduction.compute_bound:")) << error_of(j);
  j = profile_to_json(p);
  j["contention"]["ce_reduction"].erase("memory_bound");
  EXPECT_TRUE(starts_with(error_of(j), "contention.ce_reduction.memory_bound: missing")) << error_of(j);
  j = profile_to_json(p);
  j["contention"]["ce_reduction"]["sms"] = 32;
  EXPECT_TRUE(starts_with(error_of(j), "contention.ce_reduction")) << error_of(j);
}

}  // namespace
}  // namespace ce_overlap
