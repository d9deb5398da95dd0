"""A progress bar that follows one engine call as its inputs finish."""

from __future__ import annotations

import sys


def follow(submission, *, disable: bool, desc: str | None = None, unit: str = "input") -> None:
    """Show a bar over ``submission``'s inputs until it is done (returns at once if disabled).

    The engine reports every step that finished some inputs; the bar catches up from
    ``num_done``, so nothing is missed or counted twice. ``smoothing=0``: the ETA comes from the
    average rate since the first input was submitted, not from the last step alone (a first
    step that also warmed up the model made the estimate swing wildly).
    """
    if disable:
        return
    from tqdm import tqdm

    bar = tqdm(total=submission.num_inputs, unit=unit, desc=desc, file=sys.stderr, smoothing=0)

    def catch_up(_: int) -> None:
        bar.update(submission.num_done - bar.n)

    submission.add_progress_callback(catch_up)
    catch_up(0)  # what finished before the callback was in place
    submission.exception()  # wait
    catch_up(0)
    bar.close()
