// Hardware profiles (schema ce_overlap.profile/1): the one place hardware numbers live.
// Built-in profiles are JSON files in python/ce_overlap/profiles/; `ce-overlap calibrate` will write more.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "../graph/ir.h"

namespace ce_overlap {

inline constexpr const char* kProfileSchema = "ce_overlap.profile/1";

struct GpuSpec {
  std::string name;
  int sms = 0;
  double peak_bf16_tflops = 0;  // dense tensor-core peak, also used for fp16
  double peak_fp32_tflops = 0;  // non-tensor-core fp32 peak
  double hbm_gbps = 0;          // GB/s (1e9 bytes/s)
  int copy_engines = 0;
  double memory_gib = 0;
};

struct LinkSpec {
  std::string kind;                // "nvlink4", "pcie5", "ib-ndr", ...
  double gbps_per_direction = 0;   // GB/s one way, per GPU
  bool p2p = false;                // peers can map each other's memory
};

struct TopologySpec {
  int gpus_per_node = 1;
  LinkSpec intra_node;
  LinkSpec inter_node;
};

// What fraction of peak real kernels reach, and fixed costs.
struct EfficiencySpec {
  double gemm = 0;             // of peak tensor-core FLOP/s, large GEMMs
  double memory = 0;           // of HBM bandwidth, memory-bound kernels
  double kernel_launch_us = 0; // floor per compute kernel
};

// Alpha-beta NCCL model: time = base_latency + (steps) * per_step_latency + bus_bytes / (link * bus_efficiency).
struct NcclSpec {
  double base_latency_us = 0;
  double per_step_latency_us = 0;
  double bus_efficiency = 0;   // busbw / link bandwidth for large messages
};

struct Profile {
  std::string name;
  std::string description;
  GpuSpec gpu;
  TopologySpec topology;
  EfficiencySpec efficiency;
  NcclSpec nccl;
};

// Parse and validate; throws IrError naming the field ("gpu.hbm_gbps: expected a positive number, got -1").
Profile load_profile(const std::string& json_text);
Profile profile_from_json(const nlohmann::json& j);
nlohmann::json profile_to_json(const Profile& p);

}  // namespace ce_overlap
