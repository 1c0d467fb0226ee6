// ml4-tiny (H 4, hidden 512, 8 experts of 128, shared 128, vocab 512) as TP rank 1 of 2 with
// experts 4..7 (an EP shard): the shard the weight-loading tests bind.
#pragma once

#include "model/weight_shard.h"

namespace ml4::testing {

inline WeightShard tiny_rank_shard() {
  WeightShard s;
  s.head_begin = 2, s.heads = 2;
  s.vocab_begin = 256, s.vocab = 256;
  s.dense_begin = 256, s.dense = 256;
  s.shared_begin = 64, s.shared = 64;
  s.expert_begin = 4, s.experts = 4;
  return s;
}

}  // namespace ml4::testing
