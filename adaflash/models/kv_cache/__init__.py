"""The KV cache a target or a drafter attends over, and the ragged batch that addresses it."""
