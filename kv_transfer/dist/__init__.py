"""The dist transport: a request's KV across hosts over torch.distributed pair groups, end to end:
`pair` (one two-rank process group per (sender, receiver) pair, gloo for CPU tensors, NCCL for
CUDA), `transfer` (send and receive packed layers, every wait bounded), `packing` (a request's
blocks gathered into one tensor per layer), `endpoints` (the two ends of a transfer over a pair),
`integrity` (the MAC of each piece), `pieces` (the sender's piece thread) and `connector` (both
sides behind kv_transfer.connector, with the `KVReceiver.ReceiveKV` gRPC service and its client).

Protocol (decode worker D receives, prefill worker P sends):
1. D hosts a TCPStore for rendezvous and serves `KVReceiver.ReceiveKV` on its gRPC server (an
   internal service: the cluster token is required); its transfer descriptors carry both (the
   `dist` endpoint's `store` and `control` addresses).
2. Per piece (the whole transfer, or a streamed prompt's chunk: `first_block`, `more`), P packs
   the blocks, computes their MAC under a key derived from the reservation's transfer secret and
   calls ReceiveKV with it, naming the pair's generation and a fresh tag; D admits the write
   through its ReservationBook (the secret, the block range, the dtype) and answers in its store
   (`ready/...` = ok, or why not), so a refused P stops waiting at once.
3. On ok, both rendezvous (a new pair only) and P sends each packed layer; D checks the bytes
   against the MAC before anything is written (a mismatch: refused, nothing written, the
   reservation RESERVED again), writes them into the reserved blocks and completes the write;
   ReceiveKV's answer is the acknowledgement (the last piece's: P may free its blocks).
4. Pieces go one at a time per pair, in order, each starting where the previous one ended;
   between pieces the reservation is RESERVED under its lease, so a sender that vanishes between
   pieces costs a lease, not a leak. Any failure on a pair tears it down on that side; both
   rebuild it under the next generation.
"""
