"""The Batch API: durable store, input/output lines, the runner core, the offline command."""
