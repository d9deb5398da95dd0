"""The user's door: the ``Engine`` facade and its result types."""
