// Shared fixtures for the cost-model tests: a round-number profile and the built-in profile files.
#pragma once

#include <fstream>
#include <sstream>
#include <string>

#include "cost_model/profile.h"

namespace ce_overlap::testing {

// Round numbers so expected times can be written by hand: 100 TFLOP/s at efficiency 1 (no GEMM ramp),
// 1000 GB/s HBM, a 5 us launch floor, one NCCL line of 10 us + 2 us/step over a 100 GB/s link at
// efficiency 0.5 (50 GB/s), 10 GB/s x 0.5 between nodes; CE 10 us signalling + 2 us per copy.
inline Profile round_profile() {
  Profile p;
  p.name = "test-round";
  p.description = "round numbers for hand-computed expectations";
  p.gpu = {"TestGPU", 100, 100.0, 10.0, 1000.0, 3, 80.0};
  p.topology.gpus_per_node = 8;
  p.topology.numa_node = {0, 0, 0, 0, 1, 1, 1, 1};
  p.topology.intra_node = LinkSpec{"nvlink4", 100.0, true};
  p.topology.inter_node = LinkSpec{"ib-ndr", 10.0, false};
  p.efficiency = {1.0, 0.0, 1.0, 5.0};
  p.nccl.channels = 20;
  p.nccl.protocols = {{"simple", 10.0, 2.0, 0.5}};
  p.nccl.reduction_bandwidth_factor = 1.0;
  p.nccl.inter_node_step_latency_us = 0.0;
  p.nccl.inter_node_bus_efficiency = 0.5;
  p.ce = {2.0, 10.0, 0.8, 0.5, 100.0, 10, 10.0};
  p.contention.compute_bound = {1.0, 0.1};
  p.contention.memory_bound = {0.2, 1.0};
  p.contention.nccl_beside_compute = {0.05, 0.1};
  p.contention.ce_beside_compute = {0.0, 0.1};
  return p;
}

// A collective on group "0"; reductions sum.
inline CollectiveInfo coll(CollectiveType type, int group_size, int64_t bytes) {
  CollectiveInfo c;
  c.type = type;
  c.group = "0";
  c.group_size = group_size;
  if (type == CollectiveType::ReduceScatter || type == CollectiveType::AllReduce) c.reduce_op = "sum";
  c.bytes = bytes;
  return c;
}

inline std::string read_text(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot open " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

inline Profile builtin_profile(const std::string& name) {
  return load_profile(read_text(std::string(CE_OVERLAP_PROFILE_DIR) + "/" + name + ".json"));
}

}  // namespace ce_overlap::testing
