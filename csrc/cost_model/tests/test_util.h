// Shared fixtures for the cost-model tests: a round-number profile and the built-in profile files.
#pragma once

#include <fstream>
#include <sstream>
#include <string>

#include "cost_model/profile.h"

namespace ce_overlap::testing {

// Round numbers so expected times can be written by hand: 100 TFLOP/s at efficiency 1, 1000 GB/s HBM,
// a 5 us launch floor, NCCL 10 us + 2 us/step over a 100 GB/s link at efficiency 0.5 (50 GB/s).
inline Profile round_profile() {
  Profile p;
  p.name = "test-round";
  p.description = "round numbers for hand-computed expectations";
  p.gpu = {"TestGPU", 100, 100.0, 10.0, 1000.0, 3, 80.0};
  p.topology.gpus_per_node = 8;
  p.topology.intra_node = {"nvlink4", 100.0, true};
  p.topology.inter_node = {"ib-ndr", 10.0, false};
  p.efficiency = {1.0, 1.0, 5.0};
  p.nccl = {10.0, 2.0, 0.5};
  return p;
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
