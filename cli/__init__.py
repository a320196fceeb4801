"""The command line: `pdserve` and its subcommands, and the streaming client."""
