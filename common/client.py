"""A client of the public API: stream a generation from a running cluster to stdout
(`pdserve client`, `python -m router client`), and the cluster's status."""

from __future__ import annotations

import sys

import grpc

from common.grpc_server import channel
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc


def build_request(prompt: str | None, chat: str | None, max_tokens: int, temperature: float,
                  seed: int | None) -> pb.GenerateRequest:
    sampling = pb.SamplingOptions(max_tokens=max_tokens, temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    if chat is not None:
        return pb.GenerateRequest(chat=pb.ChatMessages(messages=[
            pb.ChatMessage(role="user", content=chat)]), sampling=sampling)
    return pb.GenerateRequest(prompt=prompt or "", sampling=sampling)


def cluster_status(address: str, timeout_s: float = 5.0, root_ca: bytes | None = None
                   ) -> pb.ClusterStatus:
    """The router's view: every registered worker, its health and load."""
    with channel(address, root_ca) as ch:
        return pb_grpc.GenerationStub(ch).GetClusterStatus(pb.ClusterStatusRequest(),
                                                           timeout=timeout_s)


def stream(address: str, request: pb.GenerateRequest, timeout_s: float,
           root_ca: bytes | None = None) -> int:
    with channel(address, root_ca) as ch:
        stub = pb_grpc.GenerationStub(ch)
        try:
            for part in stub.Generate(request, timeout=timeout_s):
                sys.stdout.write(part.text)
                sys.stdout.flush()
                if part.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    t, u = part.timings, part.usage
                    print(f"\n[{pb.FinishReason.Name(part.finish_reason)}; "
                          f"{u.prompt_tokens} prompt + {u.completion_tokens} tokens; "
                          f"TTFT {t.ttft_s * 1000:.0f} ms; total {t.e2e_s:.2f} s; "
                          f"KV moved {t.kv_transfer_bytes / 1e6:.2f} MB in "
                          f"{t.kv_transfer_s * 1000:.0f} ms]", file=sys.stderr)
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0
