"""proto <-> engine domain objects. Torch-free and grpc-free, so the router uses it too."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from engine.request import SamplingParams, StructuredOutput
from pdserve_proto import pdserve_pb2 as pb

DEFAULT_MAX_TOKENS = 16

_FINISH_TO_PROTO = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def sampling_from_proto(options: Any, default_max_tokens: int = DEFAULT_MAX_TOKENS
                        ) -> SamplingParams:
    """SamplingOptions -> SamplingParams; ValueError names the bad field and its limit.
    Absent max_tokens -> 16 (an explicit 0 is an error); absent top_p -> 1.0 (disabled); top_p 0
    keeps only the most likely token, which is greedy (OpenAI's meaning); top_k 0 -> disabled."""
    for i, stop in enumerate(options.stop):
        if "\ufffd" in stop:  # protobuf replaced invalid UTF-8 (or the caller sent U+FFFD)
            raise ValueError(f"sampling.stop[{i}] is not valid UTF-8 text")
    top_p = options.top_p if options.HasField("top_p") else 1.0
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"sampling.top_p must be in [0, 1], got {top_p:g}")
    params = SamplingParams(
        max_tokens=(options.max_tokens if options.HasField("max_tokens")
                    else default_max_tokens),
        temperature=options.temperature,  # validated even when top_p 0 makes it greedy
        top_k=options.top_k if options.top_k != 0 else -1,
        top_p=top_p or 1.0,
        seed=options.seed if options.HasField("seed") else None,
        stop=tuple(options.stop),
        stop_token_ids=tuple(options.stop_token_ids),
        ignore_eos=options.ignore_eos,
        logprobs=options.logprobs if options.HasField("logprobs") else None,
        logit_bias=tuple(options.logit_bias.items()),
        min_tokens=options.min_tokens,
        repetition_penalty=(options.repetition_penalty if options.HasField("repetition_penalty")
                            else 1.0),
        frequency_penalty=options.frequency_penalty,
        presence_penalty=options.presence_penalty,
        prompt_logprobs=(options.prompt_logprobs if options.HasField("prompt_logprobs")
                         else None),
        structured_output=(structured_from_proto(options.structured_output)
                           if options.HasField("structured_output") else None),
        continued_tokens=options.continued_tokens,
        skip_special_tokens=(options.skip_special_tokens
                             if options.HasField("skip_special_tokens") else True),
        include_stop_str_in_output=options.include_stop_str_in_output,
    )
    return dataclasses.replace(params, temperature=0.0) if top_p == 0.0 else params


def sampling_to_proto(params: SamplingParams) -> pb.SamplingOptions:
    options = pb.SamplingOptions(
        max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k,
        top_p=params.top_p, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens, frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty, continued_tokens=params.continued_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output)
    if not params.skip_special_tokens:
        options.skip_special_tokens = False
    if params.repetition_penalty != 1.0:
        options.repetition_penalty = params.repetition_penalty
    if params.seed is not None:
        options.seed = params.seed
    if params.logprobs is not None:
        options.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        options.prompt_logprobs = params.prompt_logprobs
    if params.structured_output is not None:
        options.structured_output.CopyFrom(structured_to_proto(params.structured_output))
    return options


def structured_from_proto(message: Any) -> StructuredOutput:
    kind = message.WhichOneof("constraint")
    if kind is None:
        raise ValueError("structured_output must set one of json_schema, json_object, regex or "
                         "choice")
    if kind == "json_object":
        if not message.json_object:
            raise ValueError("structured_output.json_object must be true when set")
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput("choice", json.dumps(list(message.choice.choices)))
    return StructuredOutput(kind, getattr(message, kind))


def structured_to_proto(constraint: StructuredOutput) -> pb.StructuredOutput:
    if constraint.kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if constraint.kind == "choice":
        return pb.StructuredOutput(choice=pb.Choices(choices=json.loads(constraint.spec)))
    return pb.StructuredOutput(**{constraint.kind: constraint.spec})


def prompt_logprobs_to_proto(prompt_token_ids: list[int],
                             entries: list[dict[int, float] | None] | None
                             ) -> list[pb.TokenLogprob]:
    """A request's prompt logprobs as the wire carries them: one per prompt token after the
    first (the first has none). Empty when none were computed."""
    if not entries or any(e is None for e in entries[1:]):
        return []
    return [logprob_to_proto(t, e) for t, e in zip(prompt_token_ids[1:], entries[1:])
            if e is not None]


def logprob_to_proto(token_id: int, logprobs: dict[int, float]) -> pb.TokenLogprob:
    top = {t: lp for t, lp in logprobs.items() if t != token_id}
    return pb.TokenLogprob(token_id=token_id, logprob=logprobs.get(token_id, 0.0), top=top)


def logprob_from_proto(message: pb.TokenLogprob) -> dict[int, float]:
    logprobs = dict(message.top)
    logprobs[message.token_id] = message.logprob
    return logprobs


def finish_reason_to_proto(reason: str | None) -> int:
    return _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> str | None:
    return _FINISH_FROM_PROTO.get(value)


def stop_reason_to_proto(reason: int | str | None) -> str:
    return "" if reason is None else str(reason)
