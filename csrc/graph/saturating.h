#pragma once
// Byte and FLOP counts saturate instead of wrapping: the IR allows 2^50 bytes and 10^18 FLOPs per node, so sums
// over many nodes (or a shard x a group's size) can exceed int64. INT64_MAX reads as "more than can be counted".

#include <cstdint>
#include <limits>

namespace ce_overlap {

inline int64_t sat_add(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::numeric_limits<int64_t>::max();
  return r;
}

inline int64_t sat_mul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::numeric_limits<int64_t>::max();
  return r;
}

}  // namespace ce_overlap
