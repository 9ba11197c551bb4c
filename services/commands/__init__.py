"""Entry points of the `pagedserve` subcommands: each module's `run(args)` starts one service."""
