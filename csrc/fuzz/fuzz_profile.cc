// libFuzzer target: the hardware/topology profile loader (csrc/cost_model/profile.cc) and the cost model
// built from what it accepts. Oracle: any input loads or throws IrError (the one documented exception
// type); an accepted profile gives finite, non-negative estimates for a few collectives and kernels.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "cost_model/cost_model.h"
#include "cost_model/profile.h"

namespace {

void require_finite(double v, const char* what) {
  if (!std::isfinite(v) || v < 0) {
    std::fprintf(stderr, "profile accepted but %s = %g\n", what, v);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ce_overlap;
  const std::string text(reinterpret_cast<const char*>(data), size);
  Profile profile;
  try {
    profile = load_profile(text);
  } catch (const IrError&) {
    return 0;
  }
  const CostModel model(profile);
  for (const int64_t bytes : {int64_t{1} << 10, int64_t{1} << 20, int64_t{1} << 28}) {
    for (const CollectiveType type : {CollectiveType::AllGather, CollectiveType::ReduceScatter}) {
      CollectiveInfo c;
      c.type = type;
      c.group = "0";
      c.group_size = 2;
      c.bytes = bytes;
      if (type == CollectiveType::ReduceScatter) c.reduce_op = "sum";
      try {
        require_finite(model.collective_us(c), "NCCL time");
        if (!model.ce_blocker(c.group_size)) require_finite(model.estimate(c, Backend::Ce).us, "CE time");
      } catch (const IrError&) {
      }
    }
  }
  return 0;
}
