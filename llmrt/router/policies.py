"""Routing policies: round-robin, least-load, prefix-affinity (a consistent-hash ring with bounded load), session."""
from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from llmrt.router.backends import Backend

POLICIES = ("round-robin", "least-load", "prefix-affinity", "session")


@dataclass
class RouteInfo:
    """What the policies see of a request."""

    prefix_key: Optional[bytes] = None  # the first blocks of the rendered prompt
    user: Optional[str] = None  # OpenAI's `user`
    est_tokens: int = 0  # estimated prompt + output tokens, for least-load


@dataclass
class Choice:
    """A policy's pick; `home` is whether it is the instance the key hashes to (prefix-affinity/session hits)."""

    backend: Backend
    home: Optional[bool] = None


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing: each backend owns `replicas` points; a key belongs to the first point clockwise.

    Adding or removing an instance moves only the keys of its own points, so prefix caches elsewhere stay warm.
    """

    def __init__(self, replicas: int = 64):
        self.replicas = replicas
        self._urls: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _rebuild(self, urls: tuple[str, ...]) -> None:
        pairs = sorted((_hash64(f"{u}#{i}".encode()), u) for u in urls for i in range(self.replicas))
        self._urls, self._points, self._owners = urls, [p for p, _ in pairs], [u for _, u in pairs]

    def walk(self, key: bytes, urls: Sequence[str]) -> list[str]:
        """The distinct backend urls in ring order starting at key's point (the first is the key's home)."""
        urls = tuple(sorted(urls))
        if urls != self._urls:
            self._rebuild(urls)
        if not self._points:
            return []
        start = bisect.bisect(self._points, _hash64(key))
        seen: dict[str, None] = {}
        for k in range(len(self._owners)):
            seen.setdefault(self._owners[(start + k) % len(self._owners)], None)
            if len(seen) == len(urls):
                break
        return list(seen)


class RoundRobin:
    """Each available instance in turn."""

    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: list[Backend], info: RouteInfo, everyone: Sequence[Backend]) -> Choice:
        """The next candidate in turn."""
        return Choice(candidates[next(self._counter) % len(candidates)])


class LeastLoad:
    """The instance with the fewest outstanding tokens: /load's queued prompt tokens at the last poll plus the
    router's own in-flight requests' tokens (updated at once, so a burst spreads before the next poll)."""

    name = "least-load"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: list[Backend], info: RouteInfo, everyone: Sequence[Backend]) -> Choice:
        """The least loaded candidate; ties go round-robin."""
        best = min((b.outstanding_tokens(), b.in_flight) for b in candidates)
        tied = [b for b in candidates if (b.outstanding_tokens(), b.in_flight) == best]
        return Choice(tied[next(self._counter) % len(tied)])


class PrefixAffinity:
    """Requests whose prompts start alike go to the same instance, so its prefix cache hits.

    The key (the first blocks of the rendered prompt) hashes onto a ring over every backend; the request goes to
    the first available instance clockwise whose in-flight count is under ceil(load_factor * mean + 1) (consistent
    hashing with bounded loads), so a hot prefix spills over to the next instance instead of overloading one.
    Without a key (an empty prompt) it falls back to least-load.
    """

    name = "prefix-affinity"

    def __init__(self, load_factor: float = 1.25, replicas: int = 64):
        if not load_factor >= 1.0:
            raise ValueError("the load factor of prefix-affinity must be at least 1")
        self.load_factor = load_factor
        self.ring = HashRing(replicas)
        self.fallback = LeastLoad()

    def choose(self, candidates: list[Backend], info: RouteInfo, everyone: Sequence[Backend]) -> Choice:
        """The key's home if it is under the load bound, else the next one clockwise that is."""
        if info.prefix_key is None:
            return self.fallback.choose(candidates, info, everyone)
        by_url = {b.url: b for b in candidates}
        order = [by_url[u] for u in self.ring.walk(info.prefix_key, [b.url for b in everyone]) if u in by_url]
        total = sum(b.in_flight for b in candidates) + 1
        bound = math.ceil(self.load_factor * total / len(candidates))
        for b in order:
            if b.in_flight + 1 <= bound:
                return Choice(b, home=b is order[0])
        return Choice(order[0], home=True)


class Session:
    """Requests with the same OpenAI `user` go to the same instance (the ring, no load bound: stickiness is the
    point); requests without one are spread by least-load."""

    name = "session"

    def __init__(self, replicas: int = 64):
        self.ring = HashRing(replicas)
        self.fallback = LeastLoad()

    def choose(self, candidates: list[Backend], info: RouteInfo, everyone: Sequence[Backend]) -> Choice:
        """The user's instance, or the next available one clockwise while it is out."""
        if not info.user:
            return self.fallback.choose(candidates, info, everyone)
        by_url = {b.url: b for b in candidates}
        walk = self.ring.walk(info.user.encode(), [b.url for b in everyone])
        order = [by_url[u] for u in walk if u in by_url]
        return Choice(order[0], home=walk[0] == order[0].url)


def make_policy(name: str, load_factor: float = 1.25):
    """The policy called `name` (one of POLICIES)."""
    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    if name == "prefix-affinity":
        return PrefixAffinity(load_factor)
    if name == "session":
        return Session()
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
