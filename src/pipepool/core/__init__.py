"""The driver side of the step contract: requests, plans, the scheduler, KV-block accounting
and counters. Plain Python and numpy, no torch: importable and testable without a model."""
