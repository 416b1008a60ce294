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

TEST(Profile, BuiltinFilesLoad) {
  for (const char* name : {"h100-sxm", "h200-sxm"}) {
    SCOPED_TRACE(name);
    Profile p = builtin_profile(name);
    EXPECT_EQ(p.name, name);
    EXPECT_EQ(p.gpu.sms, 132);
    EXPECT_DOUBLE_EQ(p.gpu.peak_bf16_tflops, 989.0);
    EXPECT_EQ(p.topology.gpus_per_node, 8);
    EXPECT_TRUE(p.topology.intra_node.p2p);
    EXPECT_FALSE(p.topology.inter_node.p2p);
    EXPECT_GT(p.topology.intra_node.gbps_per_direction, p.topology.inter_node.gbps_per_direction);
  }
  EXPECT_DOUBLE_EQ(builtin_profile("h100-sxm").gpu.hbm_gbps, 3350.0);
  EXPECT_DOUBLE_EQ(builtin_profile("h200-sxm").gpu.hbm_gbps, 4800.0);
  EXPECT_DOUBLE_EQ(builtin_profile("h200-sxm").topology.intra_node.gbps_per_direction, 478.0);
}

TEST(Profile, RoundTrip) {
  Profile p = round_profile();
  json j = profile_to_json(p);
  EXPECT_EQ(j["schema"], kProfileSchema);
  Profile q = profile_from_json(j);
  EXPECT_EQ(profile_to_json(q), j);
  Profile h = builtin_profile("h200-sxm");
  EXPECT_EQ(profile_to_json(load_profile(profile_to_json(h).dump())), profile_to_json(h));
}

TEST(Profile, NegativeBandwidthNamesField) {
  json j = profile_to_json(round_profile());
  j["gpu"]["hbm_gbps"] = -1;
  EXPECT_EQ(error_of(j), "gpu.hbm_gbps: expected a positive number, got -1");
  j = profile_to_json(round_profile());
  j["topology"]["inter_node"]["gbps_per_direction"] = 0;
  EXPECT_TRUE(starts_with(error_of(j), "topology.inter_node.gbps_per_direction: expected a positive number"))
      << error_of(j);
}

TEST(Profile, MissingFieldNamesField) {
  json j = profile_to_json(round_profile());
  j["nccl"].erase("bus_efficiency");
  EXPECT_TRUE(starts_with(error_of(j), "nccl.bus_efficiency: missing")) << error_of(j);
  j = profile_to_json(round_profile());
  j.erase("topology");
  EXPECT_TRUE(starts_with(error_of(j), "topology: missing")) << error_of(j);
}

TEST(Profile, UnknownKeyNamesField) {
  json j = profile_to_json(round_profile());
  j["gpu"]["hbm_gbs"] = 1000;  // a typo must not pass as a default
  EXPECT_TRUE(starts_with(error_of(j), "gpu.hbm_gbs: unknown key")) << error_of(j);
  j = profile_to_json(round_profile());
  j["extra"] = 1;
  EXPECT_TRUE(starts_with(error_of(j), "extra: unknown key")) << error_of(j);
}

TEST(Profile, EfficiencyMustBeFraction) {
  for (double bad : {0.0, 1.5, -0.2}) {
    json j = profile_to_json(round_profile());
    j["efficiency"]["gemm"] = bad;
    EXPECT_TRUE(starts_with(error_of(j), "efficiency.gemm: expected a number in (0, 1]")) << error_of(j);
  }
  json j = profile_to_json(round_profile());
  j["nccl"]["bus_efficiency"] = 1.01;
  EXPECT_TRUE(starts_with(error_of(j), "nccl.bus_efficiency: expected a number in (0, 1]")) << error_of(j);
  j["nccl"]["bus_efficiency"] = 1.0;  // the bound itself is allowed
  EXPECT_EQ(error_of(j), "");
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
  j["gpu"]["peak_bf16_tflops"] = true;
  EXPECT_EQ(error_of(j), "gpu.peak_bf16_tflops: expected a positive number, got true");
  j = profile_to_json(round_profile());
  j["name"] = "";
  EXPECT_EQ(error_of(j), "name: expected a non-empty string, got \"\"");
  j = profile_to_json(round_profile());
  j["efficiency"] = json::array();
  EXPECT_EQ(error_of(j), "efficiency: expected an object, got []");
  j = profile_to_json(round_profile());
  j["nccl"]["base_latency_us"] = -3;
  EXPECT_EQ(error_of(j), "nccl.base_latency_us: expected a non-negative number, got -3");
  j = profile_to_json(round_profile());
  j["schema"] = "ce_overlap.profile/2";
  EXPECT_EQ(error_of(j), "schema: expected \"ce_overlap.profile/1\", got \"ce_overlap.profile/2\"");
  EXPECT_TRUE(starts_with(error_of(json::array()), "profile: expected an object")) << error_of(json::array());
}

TEST(Profile, MalformedJson) {
  try {
    load_profile("{\"schema\": \"ce_overlap.profile/1\", ");
    FAIL() << "accepted malformed JSON";
  } catch (const IrError& e) {
    EXPECT_TRUE(starts_with(e.what(), "malformed JSON: ")) << e.what();
  }
}

TEST(Profile, CostModelRejectsInvalidProfileBuiltInMemory) {
  Profile p = round_profile();
  p.gpu.hbm_gbps = 0;
  EXPECT_THROW(CostModel{p}, IrError);
}

}  // namespace
}  // namespace ce_overlap
