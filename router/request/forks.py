"""The n samples of one prompt prefill it once: sample 0 (the leader) goes the usual way, and tells
its decode worker how many samples will fork from its prompt; once the worker has it (the
leader's first decode message), the leader publishes where, and the other samples start there
from its KV (`DecodeRequest.fork_of`: shared blocks, the last one copied — engine.forks).

Each sample stays a generation of its own — its own stream, deadline share, retries and
migration — so a fork that cannot happen (the leader failed or finished at its prefill, its
worker left, the held prompt was given up) only costs that sample a prefill of its own.
Plain Python."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from router.request.calls import CallScope

POLL_S = 0.05  # how often a waiting sample looks at its deadline and cancellation


@dataclass(frozen=True)
class ForkSource:
    worker_id: str  # the decode (or colocated) worker holding the leader's prompt
    request_id: str  # the leader's id on that worker


class ForkGroup:
    """The samples of one prompt: one leader and `followers` forks."""

    def __init__(self, followers: int):
        self.followers = followers
        self._settled = threading.Event()
        self._source: ForkSource | None = None

    def publish(self, source: ForkSource) -> None:
        """The leader's worker holds its prompt for the followers (first word wins)."""
        if not self._settled.is_set():
            self._source = source
            self._settled.set()

    def give_up(self) -> None:
        """The leader will hold nothing: the followers prefill on their own."""
        self._settled.set()

    def wait(self, scope: CallScope) -> ForkSource | None:
        """Where to fork from, once the leader knows; None when nothing will be held.
        RouterError when the request is cancelled or its deadline passes meanwhile."""
        while not self._settled.wait(POLL_S):
            scope.timeout()
        return self._source


@dataclass(frozen=True)
class ForkRole:
    """One sample's part in its group: sample 0 leads, the others fork."""

    group: ForkGroup
    sample: int

    @property
    def leads(self) -> bool:
        return self.sample == 0


def fork_roles(num_prompts: int, n: int) -> list[ForkRole | None]:
    """The roles of a request's choices in `choices.expand` order (prompt-major, then sample);
    None for every choice when each prompt has one sample."""
    if n <= 1:
        return [None] * num_prompts
    roles: list[ForkRole | None] = []
    for _ in range(num_prompts):
        group = ForkGroup(n - 1)
        roles.extend(ForkRole(group, j) for j in range(n))
    return roles
