"""What a person reads: the per-layer table, the detach/exit summary, `hookprof top`, the run
report's page, and reading endpoints from outside the process. The top layer below the wiring.

docs/architecture.md has the layers and who owns what."""
