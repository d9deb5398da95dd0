"""Executors: how plans reach stages and results come back (one process, or one per stage)."""
