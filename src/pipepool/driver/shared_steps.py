"""``SharedSteps``: short steps while light calls share the engine with large ones, where steps
run one at a time (the CPU).

A step cannot be interrupted: a call that arrives while one runs waits for its end, then for
its own step. One client's large call fills every step with the whole token budget (2,048
tokens: about half a second of two CPU cores for MiniLM), so a one-word request of another
client waited that long, ~40x its time on an idle server (issue 57). So while light calls
(``Scheduler.light_call_waits``) have met other calls' work within the last ``MEMORY_S``, or
have been served at all within it (a large call that comes then would meet them again),
every step holds about ``STEP_S`` of compute: its tokens follow the speed measured on recent
steps. The large call then pays the fixed cost of more steps (docs/benchmarks/http-server.md
has both clients' figures); with no light call about (a large call alone, or one client's
calls), steps keep the whole budget. A prompt longer than such a step still runs whole, alone
(an encoder cannot split it), so it bounds the light calls' wait.

Pipelines whose steps overlap (``overlap_steps``, CUDA's default) keep their budgets: there the
host builds the next step while the device runs one, a step of the whole budget takes a few
milliseconds, and a short one would leave the device idle.
"""

from __future__ import annotations

from ..core.scheduler import Scheduler

# How long a step may compute while light calls share the engine: a light call waits for about
# one such step in flight and then runs in one.
STEP_S = 0.02
# How long after light calls last met other work steps stay short: light clients send again
# within it, so a large call's steps do not grow back to the whole budget between two of their
# requests (the first light request after a quiet spell waits for a whole step in flight).
MEMORY_S = 10.0
# A call of at most this share of the step budget is light (1/8: 256 tokens of the CPU's 2,048).
LIGHT_SHARE = 8
# Steps of fewer tokens are not timed (their fixed cost would read as a slow token), and no
# short step holds fewer: a slow host still makes progress with each.
MIN_TOKENS = 64
# Weight of the newest step in the running figure of seconds per token.
_NEWEST = 0.2


class SharedSteps:
    """The budget of the next step of one pipeline: None (the whole budget) unless light calls
    met other work, or waited alone, within ``MEMORY_S`` (and another call's work waits now);
    then the tokens ``STEP_S`` of compute holds, at the seconds per token measured on steps of
    at least ``MIN_TOKENS``, never fewer than that.
    ``step_s``: the compute such a step holds (``STEP_S``).

    ``enabled`` false (steps overlap): always None. One thread (the pipeline's loop) calls it;
    times are ``time.perf_counter`` seconds.
    """

    def __init__(self, step_tokens: int, *, enabled: bool, step_s: float = STEP_S) -> None:
        self.enabled = enabled
        self.step_s = step_s
        self.light_tokens = max(1, step_tokens // LIGHT_SHARE)
        self.seconds_per_token: float | None = None  # none timed yet
        self._shared_until = float("-inf")
        # The call whose light requests, waiting alone, set ``_shared_until`` (None: light
        # calls met other calls' work): its own later work holds up no other call.
        self._alone_call: int | None = None

    def budget(self, scheduler: Scheduler, now: float) -> int | None:
        """The token budget of the step ``scheduler`` plans next."""
        if not self.enabled:
            return None
        light = self.light_tokens
        one_call = scheduler.light_batches_of_one_call(light)
        if one_call is not None and one_call <= light:
            # A light call alone counts too: a large call that comes within MEMORY_S of it
            # starts in short steps, so the next light requests never meet a whole step.
            self._shared_until = now + MEMORY_S
            self._alone_call = scheduler.sole_call()
        elif one_call is None and scheduler.light_call_waits(light):
            # (Where one call's light batches wait alone, no two calls wait either.)
            self._shared_until = now + MEMORY_S
            self._alone_call = None
        if one_call is not None or now >= self._shared_until or self.seconds_per_token is None:
            # Nothing to cut: one call's small requests alone (one client's stream, however
            # many wait) hold up no other call; cut, they would only pay more steps.
            return None
        if self._alone_call is not None and scheduler.sole_call() == self._alone_call:
            return None  # the light call's own large work: there is no one else to wait
        return self.short_tokens()

    def short_tokens(self) -> int:
        """The tokens of a step of about ``step_s`` of compute (``MIN_TOKENS`` until a step
        was timed)."""
        if self.seconds_per_token is None:
            return MIN_TOKENS
        return max(MIN_TOKENS, int(self.step_s / self.seconds_per_token))

    def expected_s(self, tokens: int) -> float | None:
        """The compute a step of ``tokens`` takes at the speed measured (None: none yet)."""
        return None if self.seconds_per_token is None else tokens * self.seconds_per_token

    def light_served(self, now: float) -> None:
        """A light call was served beside other calls' work (between two layers of their
        step, ``LocalPipeline._light_step``): steps stay short, as when one waits for a step."""
        if self.enabled:
            self._shared_until = now + MEMORY_S
            self._alone_call = None

    def timed(self, tokens: int, seconds: float) -> None:
        """A step of ``tokens`` took ``seconds`` from its hand-over to its result."""
        if not self.enabled or tokens < MIN_TOKENS:
            return
        rate = seconds / tokens
        old = self.seconds_per_token
        self.seconds_per_token = rate if old is None else old + _NEWEST * (rate - old)
