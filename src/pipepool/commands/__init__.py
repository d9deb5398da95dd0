"""The subcommands of the ``pipepool`` CLI, one module each."""
