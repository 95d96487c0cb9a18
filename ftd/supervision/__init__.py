"""The attempt loop: attempts, the restart policy and its decisions, recovery, the failure summary,
node control."""
