"""Batch and corpus jobs: what does not need the server."""
