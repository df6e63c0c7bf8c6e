"""The layout vocabulary: how a dim is cut (split), how a value is sharded and read (shard), node facts, placements."""
