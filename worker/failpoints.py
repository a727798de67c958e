"""Fault injection for the fault-tolerance tests, off unless JITNEY_FAILPOINTS is set.

Failures that real deployments meet (a kernel error some input triggers, a process killed by
the OOM killer) cannot be produced on demand, so tests arm them by token id:
  JITNEY_FAILPOINTS="step_error_token=7"   a step raises while a request with token 7 in its
                                           prompt is in the engine (a poison request);
  JITNEY_FAILPOINTS="step_crash_token=7"   the worker kills itself (SIGKILL) instead;
  JITNEY_FAILPOINTS="step_delay_ms=20"     every step takes 20 ms longer (a slow device), so
                                           tests can act while a tiny model is mid-generation;
  JITNEY_FAILPOINTS="start_error_token=7"  starting a request with token 7 in its prompt raises
                                           a ValueError that is no engine rejection (a bug in
                                           Engine.add_request, not the client's fault).
Several comma-separated entries may be given.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from engine.llm_engine import Engine

ENV = "JITNEY_FAILPOINTS"


class InjectedFault(RuntimeError):
    """Raised by the step_error_token failpoint."""


class InjectedBug(ValueError):
    """Raised by the start_error_token failpoint: a ValueError, as many a bug's is, that the
    worker must not take for the client's fault."""


@dataclass(frozen=True, slots=True)
class Failpoints:
    step_error_token: int | None = None
    step_crash_token: int | None = None
    step_delay_ms: int = 0
    start_error_token: int | None = None

    @classmethod
    def from_env(cls) -> Failpoints:
        spec = os.environ.get(ENV, "").strip()
        if not spec:
            return cls()
        values: dict[str, int] = {}
        for item in spec.split(","):
            name, _, value = item.strip().partition("=")
            if name not in cls.__dataclass_fields__:
                raise ValueError(f"{ENV}: unknown failpoint {name!r}")
            values[name] = int(value)
        return cls(**values)

    @property
    def armed(self) -> bool:
        tokens = (self.step_error_token, self.step_crash_token, self.start_error_token)
        return any(t is not None for t in tokens) or self.step_delay_ms > 0

    def before_start(self, prompt_token_ids: list[int]) -> None:
        """Called where the worker hands a request to the engine (`Engine.add_request`)."""
        if self.start_error_token is not None and self.start_error_token in prompt_token_ids:
            raise InjectedBug(f"failpoint start_error_token={self.start_error_token}")

    def before_step(self, engine: Engine) -> None:
        if not self.armed:
            return
        time.sleep(self.step_delay_ms / 1000)
        prompts = engine.view.prompt_token_ids()
        if self.step_crash_token is not None and any(self.step_crash_token in p for p in prompts):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.step_error_token is not None and any(self.step_error_token in p for p in prompts):
            raise InjectedFault(f"failpoint step_error_token={self.step_error_token}")
