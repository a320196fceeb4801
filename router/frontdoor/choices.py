"""The choices of one request (a batch of prompts x n samples): each runs as its own
generation (`expand`), the samples of a prompt forking from the first one's KV
(`choice_forks`); for the HTTP API their responses are read together, in arrival order for
a stream or whole for a JSON reply, and their usage is added up (a prompt counted once however
many samples it has)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve_proto import pdserve_pb2 as pb
from router.frontdoor.limits import MAX_CHOICES
from router.frontdoor.tool_stream import CallDelta, ToolStream
from router.frontdoor.tools import ToolPlan
from router.request.calls import RouterError
from router.request.forks import ForkRole, fork_roles

END = object()  # a choice's responses are over


def expand(base: pb.GenerateRequest, prompts: list[str | list[int] | None], n: int
           ) -> list[pb.GenerateRequest]:
    """One request per prompt and sample (a None prompt keeps the base's input); sample j of a
    seeded request draws with seed + j. ValueError past MAX_CHOICES."""
    if len(prompts) * n > MAX_CHOICES:
        raise ValueError(f"n x {len(prompts)} prompt(s) = {len(prompts) * n} choices; the limit "
                         f"is {MAX_CHOICES}")
    choices = []
    for prompt in prompts:
        for j in range(n):
            choice = pb.GenerateRequest()
            choice.CopyFrom(base)
            choice.n = 0
            if len(prompts) * n > 1:
                choice.request_id = f"{base.request_id}-{len(choices)}"
            if isinstance(prompt, str):
                choice.prompt = prompt
            elif prompt is not None:
                choice.prompt_token_ids.ids.extend(prompt)
            if j and base.sampling.HasField("seed"):
                choice.sampling.seed = (base.sampling.seed + j) % (1 << 64)
            choices.append(choice)
    return choices


def expand_grpc(request: pb.GenerateRequest) -> list[pb.GenerateRequest]:
    """A gRPC request's choices: its batch's prompts (or its one input) x n."""
    prompts: list[str | list[int] | None] = [None]
    if request.WhichOneof("input") == "batch":
        batch = request.batch
        if batch.prompts and batch.token_ids:
            raise ValueError("batch holds text prompts and token-id prompts: one kind only")
        prompts = list(batch.prompts) or [list(t.ids) for t in batch.token_ids]
        if not prompts:
            raise ValueError("batch holds no prompt")
    if not request.request_id:  # the choices' ids derive from it
        named = pb.GenerateRequest()
        named.CopyFrom(request)
        named.request_id = f"gen-{uuid.uuid4().hex[:12]}"
        request = named
    return expand(request, prompts, max(1, request.n))


def choice_forks(n: int, sampling: pb.SamplingOptions, num_choices: int
                 ) -> list[ForkRole | None]:
    """The part of each of `expand`'s `num_choices` choices among the `n` samples of its prompt:
    the first sample prefills and the others fork from its KV (router.request.forks) — unless
    the prompt's logprobs are asked for, which only a whole prefill computes."""
    n = max(1, n)
    if n == 1 or sampling.HasField("prompt_logprobs"):
        return [None] * num_choices
    return fork_roles(num_choices // n, n)


@dataclass(frozen=True)
class Echo:
    """What completions with `echo` put before a choice's completion: the prompt's text, and its
    tokens for the logprobs; empty without echo (and after the first part of a stream)."""

    prompt_token_ids: list[int] = field(default_factory=list)
    text: str = ""


@dataclass
class Choice:
    index: int
    responses: AsyncIterator  # pb.GenerateResponse, or a RouterError that ends them
    prompt_token_ids: list[int]
    echo: Echo
    first_sample: bool  # sample 0 of its prompt: its prompt counts in the usage
    parts: list[pb.GenerateResponse] = field(default_factory=list)
    tools: ToolPlan | None = None  # chat with tools: how its output becomes tool calls
    streamed_calls: ToolStream | None = None  # a stream's tool calls as they come

    def stream_text(self, text: str) -> tuple[str, list[CallDelta]]:
        """What a stream sends now for this output text: content, and tool-call deltas."""
        if self.tools is None:
            return text, []
        if self.streamed_calls is None:
            self.streamed_calls = ToolStream(self.tools)
        return self.streamed_calls.feed(text)

    def stream_end(self) -> tuple[str, list[CallDelta]]:
        """At the stream's end: content still held, and the calls' last deltas."""
        if self.tools is None:
            return "", []
        if self.streamed_calls is None:
            self.streamed_calls = ToolStream(self.tools)
        return self.streamed_calls.finish()

    @property
    def made_calls(self) -> bool:
        return self.streamed_calls is not None and self.streamed_calls.calls > 0


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, object]]:
    """Every choice's responses as they come, each with its choice; a choice's END follows its
    last. The readers stop when the consumer does."""
    if len(choices) == 1:  # most requests: read directly, with no task and queue per token
        async for entry in _one(choices[0]):
            yield entry
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        async for item in choice.responses:
            await queue.put((choice, item))
        await queue.put((choice, END))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        for _ in range(len(choices)):
            while (entry := await queue.get())[1] is not END:
                yield entry
                if isinstance(entry[1], RouterError):
                    return
            yield entry
    finally:
        for task in tasks:
            task.cancel()


async def _one(choice: Choice) -> AsyncIterator[tuple[Choice, object]]:
    async for item in choice.responses:
        yield choice, item
        if isinstance(item, RouterError):
            return
    yield choice, END


async def collect(choices: list[Choice]) -> RouterError | None:
    """Read every choice's responses into its `parts`; the first error, if any."""
    async for choice, item in merged(choices):
        if isinstance(item, RouterError):
            return item
        if item is not END:
            choice.parts.append(item)
    return None


def total_usage(choices: list[Choice]) -> pb.Usage:
    """The last responses' usage added up, each prompt once."""
    usage = pb.Usage()
    for choice in choices:
        last = choice.parts[-1].usage if choice.parts else pb.Usage()
        if choice.first_sample:
            usage.prompt_tokens += last.prompt_tokens
            usage.cached_tokens += last.cached_tokens
        usage.completion_tokens += last.completion_tokens
    return usage
