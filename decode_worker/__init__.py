"""Decode worker: reserves blocks, receives a prompt's KV, and decodes it in its own
continuous-batching loop (the engine's step loop). Also runs the colocated baseline."""
