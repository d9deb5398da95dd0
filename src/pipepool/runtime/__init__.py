"""The process's own settings: memory, the thread switch interval, signal masks, the user's
cache directory."""
