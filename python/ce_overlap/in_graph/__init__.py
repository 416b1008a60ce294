"""In-graph FSDP: `ce_overlap.fully_shard` (fully_shard.py) and the fused AdamW over its DTensor parameters on the
local shards (fused_optim.py). docs/fully_shard.md."""
