"""The offline `summit batch` command (Serve handles, or Ray Data with --ray-data) over the runtime's batch core."""
