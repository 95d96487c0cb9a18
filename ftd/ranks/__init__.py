"""The node's rank processes: spawning (spawn/), the worker group, launch environment, output,
error files, in-process restarts."""
