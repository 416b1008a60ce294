// libFuzzer target: the IR JSON loader (csrc/graph/ir_json.cc) and the analyses every loaded graph goes
// through. Oracle: any input either loads or throws IrError (the one documented exception type); a document
// that loads saves canonically (save -> load -> save is byte-identical) and survives the graph analyses.
// Sanitizers (ASan, UBSan) catch memory and UB errors. Built by scripts/check_native.sh (clang).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "graph/analysis.h"
#include "graph/ir.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ce_overlap;
  const std::string text(reinterpret_cast<const char*>(data), size);
  Document doc;
  try {
    doc = load_ir(text);
  } catch (const IrError&) {
    return 0;  // a clean rejection
  }
  const std::string saved = save_ir(doc);
  const std::string again = save_ir(load_ir(saved));
  if (saved != again) {
    std::fprintf(stderr, "IR save is not canonical: save(load(save(doc))) differs\n");
    std::abort();
  }
  try {
    detect_blocks(doc);
    for (const Graph& g : doc.graphs) {
      const std::vector<int> order = topological_order(g);
      check_order(g, order);
      (void)peak_memory(g, order);
      const std::vector<double> durations(g.nodes.size(), 1.0);
      (void)critical_path(g, durations);
      (void)simulate(g, order, durations);
    }
  } catch (const IrError&) {
    // a cycle (topological_order) or another graph-level rejection, reported with a message
  }
  return 0;
}
