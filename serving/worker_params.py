"""What a worker's engine is asked to hand over for a request it serves.

A worker's outputs go to the router as token ids only: the router detokenizes them itself, for
every client (router.frontdoor.detokenizer). So a worker asks its engine for delta outputs (no
step copies a request's whole output again) and builds no text unless a stop string must be
found in it. Neither choice is on the wire: they are each worker's own."""

from __future__ import annotations

import dataclasses

from engine.request import OutputKind, SamplingParams


def worker_params(params: SamplingParams) -> SamplingParams:
    """`params` as a worker's engine runs them: delta outputs, text only for stop strings."""
    detokenize = bool(params.stop)
    if params.output_kind is OutputKind.DELTA and params.detokenize is detokenize:
        return params
    return dataclasses.replace(params, output_kind=OutputKind.DELTA, detokenize=detokenize)
