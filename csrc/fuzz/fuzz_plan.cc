// libFuzzer target: the Plan JSON loader (csrc/graph/plan_json.cc, plan_validate.cc). Oracle: any input loads or throws IrError
// (the one documented exception type); an accepted Plan saves canonically (save -> load -> save identical).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "graph/ir.h"
#include "graph/plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ce_overlap;
  const std::string text(reinterpret_cast<const char*>(data), size);
  Plan plan;
  try {
    plan = load_plan(text);
  } catch (const IrError&) {
    return 0;
  }
  const std::string saved = save_plan(plan);
  if (save_plan(load_plan(saved)) != saved) {
    std::fprintf(stderr, "Plan save is not canonical: save(load(save(plan))) differs\n");
    std::abort();
  }
  return 0;
}
