"""Model versions: which backends a request may go to (a pin, a canary share, or the stable versions)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from llmrt.router.backends import Backend

VERSION_HEADER = "x-llmrt-model-version"
VERSION_FIELD = "model_version"  # the body field that pins a version (the header wins)


def parse_canary(specs: list[str]) -> dict[str, float]:
    """`VERSION=SHARE` flags as {version: share}; shares in (0, 1] adding up to at most 1."""
    out: dict[str, float] = {}
    for spec in specs:
        version, sep, share = spec.rpartition("=")
        try:
            value = float(share)
        except ValueError:
            value = -1.0
        if not sep or not version or not 0.0 < value <= 1.0:
            raise ValueError(f"--canary {spec!r}: expected VERSION=SHARE with SHARE in (0, 1], e.g. v2=0.1")
        out[version] = value
    if sum(out.values()) > 1.0 + 1e-9:
        raise ValueError(f"the canary shares add up to {sum(out.values()):g}, over 1")
    return out


@dataclass
class VersionRules:
    """Pins and canaries. Canary shares are exact, not random: a smooth weighted count sends every 1/share-th
    unpinned request to the canary, so a 0.1 canary gets 10 of every 100."""

    canary: dict[str, float] = field(default_factory=dict)
    _credit: dict[str, float] = field(default_factory=dict)

    def set_canary(self, canary: dict[str, float]) -> None:
        """Replace the canary shares (the admin route)."""
        self.canary = dict(canary)
        self._credit = {v: self._credit.get(v, 0.0) for v in canary}

    def candidates(self, available: list[Backend], pin: Optional[str]) -> tuple[list[Backend], Optional[str]]:
        """The backends this request may use, and the version chosen for it (None: any stable version)."""
        if pin is not None:
            return [b for b in available if b.version == pin], pin
        for version, share in self.canary.items():
            serving = [b for b in available if b.version == version]
            if not serving:
                continue
            self._credit[version] = self._credit.get(version, 0.0) + share
            if self._credit[version] >= 1.0 - 1e-9:
                self._credit[version] -= 1.0
                return serving, version
        stable = [b for b in available if b.version not in self.canary]
        # Only canaries are left (the old version is gone): they are the stable version now.
        return (stable or available), None
