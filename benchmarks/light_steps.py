"""Light calls beside a long chunked call, engine only: light steps between two layers of the
long call's windows off and on, alternated in one process (so a loaded host loads both alike).

    PYTHONPATH=src python benchmarks/light_steps.py [--words 6000] [--rounds 3]

Per round and setting: the long call's time and tokens a second, the light clients' latency
(two clients of their own, a one-word call, 50 ms pause, again), and the engine's steps: those
computed inside the long call's windows (light steps) and the others. The bundled MiniLM on the
CPU.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from pipepool import Engine
from pipepool.core.priority import client_turns

WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
    "wizards", "quietly", "hex",
]  # fmt: skip
LIGHT_CLIENTS = 2
THINK_S = 0.05


class LightStepClock:
    """Counts the light steps computed inside others (``LocalPipeline._light_step``) and
    their time."""

    def __init__(self, engine: Engine) -> None:
        self.pipeline = engine.pipeline
        self.steps, self.seconds = 0, 0.0
        hook = self.pipeline._light_step

        def counted() -> None:
            before, started = self.pipeline.stats.steps, time.perf_counter()
            hook()
            if self.pipeline.stats.steps != before:
                self.steps += 1
                self.seconds += time.perf_counter() - started

        self.pipeline._light_step = counted  # type: ignore[method-assign]


def measure(engine: Engine, long_text: str, on: bool) -> tuple[float, int, np.ndarray]:
    """(seconds the long call took, its tokens, light latencies in ms) with light steps
    between layers ``on`` or off."""
    engine.pipeline._between_layers = on
    latencies: list[float] = []
    done = threading.Event()

    def light(k: int) -> None:
        with client_turns(f"light {k}"):
            while not done.is_set():
                t = time.perf_counter()
                engine.embed(["hello"])
                latencies.append(time.perf_counter() - t)
                time.sleep(THINK_S)

    threads = [threading.Thread(target=light, args=(k,)) for k in range(LIGHT_CLIENTS)]
    started = time.perf_counter()
    with client_turns("long"):
        call = engine.submit([long_text], long_inputs="chunk")
    for thread in threads:
        thread.start()
    call.result()
    took = time.perf_counter() - started
    done.set()
    for thread in threads:
        thread.join()
    return took, int(call.num_tokens.sum()), np.array(latencies) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--words", type=int, default=6000, help="words of the long text")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    long_text = " ".join(WORDS[i % len(WORDS)] for i in range(args.words))
    with Engine() as engine:
        engine.embed(["hello"])
        engine.embed([long_text], long_inputs="chunk")  # warm: every shape once
        clock = LightStepClock(engine)
        for r in range(args.rounds):
            for on in (False, True):
                steps, inside, inside_s = engine.stats.steps, clock.steps, clock.seconds
                took, tokens, light = measure(engine, long_text, on)
                inside, inside_s = clock.steps - inside, clock.seconds - inside_s
                print(
                    f"round {r + 1}, light steps between layers {'on ' if on else 'off'}: long "
                    f"call {took:.2f} s ({tokens / took:,.0f} tok/s); light n={len(light)} p50 "
                    f"{np.median(light):.1f} ms, p99 {np.percentile(light, 99):.1f} ms; steps "
                    f"{engine.stats.steps - steps - inside} + {inside} inside windows "
                    f"({inside_s:.2f} s)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
