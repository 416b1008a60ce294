// Helpers shared by the validator (ir.cc) and the algorithms (analysis.cc); not part of the API.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "analysis.h"
#include "ir.h"

namespace ce_overlap::detail {

// A JSON path such as graphs[0].nodes[3].outputs[0].bytes, assembled only when an error needs it:
// almost every field passes, and 20k nodes x a dozen eager strings would dominate load time.
class JsonPath {
 public:
  JsonPath() = default;  // the document root
  JsonPath(const JsonPath& parent, const char* key) : parent_(&parent), key_(key) {}
  JsonPath(const JsonPath& parent, size_t index) : parent_(&parent), index_(index) {}
  std::string str() const;

 private:
  const JsonPath* parent_ = nullptr;
  const char* key_ = nullptr;
  size_t index_ = 0;
};

// Throws IrError("<path>: <message>").
[[noreturn]] void fail_at(const JsonPath& path, const std::string& message);

// Inputs must already be in range. Fills `order` (stable Kahn, smallest id first) and returns true,
// or returns false with `cycle` holding node ids of one real cycle in data-flow order (each feeds
// the next, the last feeds the first), starting at its smallest id.
bool stable_topological_order(const Graph& g, std::vector<int>& order, std::vector<int>& cycle);

// "a -> b -> a" from node names; long cycles are elided in the middle so messages stay readable.
std::string describe_cycle(const Graph& g, const std::vector<int>& cycle);

// Length (2..4) of the well-formed multi-byte UTF-8 sequence at p, whose first byte is >= 0x80, or 0 if it
// is ill-formed (Unicode Table 3-7: no overlongs, surrogates or code points past U+10FFFF).
// `available` counts the bytes from p to the end of the text.
size_t utf8_sequence_length(const unsigned char* p, size_t available);

// `name` quoted for messages, e.g. node 3 ("mm_1").
std::string node_label(const Graph& g, int id);

// Storage items in run order for the liveness estimate: item i allocates alloc_bytes[i] (0 for an
// alias), lives in the storage of item owner[i] (owner[i] <= i; i itself when it allocates) and
// reads the items inputs[input_offsets[i] .. input_offsets[i + 1]). An item with is_output set keeps
// everything it reads live to the end. peak_memory builds one item per node; the planner adds the
// bucket buffers (csrc/graph/schedule.cc).
struct LivenessItems {
  std::vector<int64_t> alloc_bytes;
  std::vector<int> owner;
  std::vector<int> input_offsets{0};
  std::vector<int> inputs;
  std::vector<char> is_output;

  size_t size() const { return alloc_bytes.size(); }
};

// The liveness rule of peak_memory over items: fills peak_bytes, peak_node (an item index) and
// live_bytes_after; leaves input_bytes alone.
void liveness_peak(const LivenessItems& items, MemoryEstimate& result);

}  // namespace ce_overlap::detail
