"""Step timeline recording (off unless ``EngineConfig.trace`` names a file).

Every process keeps its own spans (``Recorder``); the driver gathers them, aligns the
processes' clocks, writes a Chrome trace-event file (``chrome.py``, opened by the Perfetto UI
and chrome://tracing) and sums the stages' time up (``summary.py``). Off, nothing here is
imported by a step: callers hold ``None`` instead of a recorder and check it.
"""

from __future__ import annotations

from .recorder import ProcessTrace, Recorder, Span
from .summary import TraceSummary, summarize, summarize_pipelines

__all__ = ["ProcessTrace", "Recorder", "Span", "TraceSummary", "summarize", "summarize_pipelines"]
