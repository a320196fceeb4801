"""The gRPC front door (no torch): registry, placement, detokenization, deadlines."""
