"""Prefill worker: chunked, batched prefill of many prompts per forward; samples the first token
and ships each prompt's KV blocks to the decode worker the router chose."""
