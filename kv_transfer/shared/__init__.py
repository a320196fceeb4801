"""The shared transport: one-sided copies into a peer's KV cache on the same host, end to
end: `mapping` (the socket handshake that hands a writer the cache), `exporter` (the decode side),
`sender` (the prefill side), `copy` (the copy itself) and `connector` (both sides behind
kv_transfer.connector).

Protocol (decode worker D exports, prefill worker P writes):
1. D allocates its whole cache as one buffer (engine.kv_memory: a memfd on CPU, any CUDA
   allocation on a GPU) and listens on a Unix socket with an abstract name (no file to leak; it
   vanishes with the process), which its transfer descriptors carry (the `shared` endpoint's
   `export` address).
2. P connects once per D (a *mapping*): it sends its worker id; D answers with a header (mapping
   id, layout, dtype, device) and the cache itself — the memfd as an SCM_RIGHTS file descriptor,
   or the CUDA IPC handle torch.multiprocessing builds. P maps it; no staging buffer, no NCCL, no
   per-pair rendezvous. Only a process of the same user may connect (SO_PEERCRED).
3. Per request, over the same socket (one JSON frame each way, microseconds on one host): P asks
   D to admit a write into the request's reserved blocks (`begin`); D marks the reservation as
   being written by this mapping, or refuses. P copies the blocks (contiguous runs of block ids,
   all layers per run, device to device on GPUs), waits for the copy to complete, then reports the
   end (`finish`, ok or not); D answers whether it still holds the request. Between `begin` and
   `finish` P may copy in several pieces (a long prompt's chunks as they are computed: the
   prefill worker's KV streaming); the blocks stay RECEIVING, so D frees none of them meanwhile.
4. The socket stays open while P may write through it: it is also D's liveness signal. P closes
   it only when none of its writes through the mapping is in flight, saying `bye` first; if P
   dies the kernel closes it, and D waits until P has finished exiting (its pid gone or a zombie:
   a dying process's queued GPU copies end with its CUDA context, not its socket). Either way D
   then ends every write the mapping had begun as failed and frees the blocks — never before
   (decode_worker.reservations states and enforces the invariant). One thread per mapping on D
   handles its begin, finish and close in order, so a write can never begin on a closed mapping.
"""
