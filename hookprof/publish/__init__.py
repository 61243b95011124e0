"""The publisher thread: folds each step's packet into totals (aggregate), the run report's
history and document, and publishes immutable Snapshots. Imports every layer below it.

docs/architecture.md has the layers and who owns what."""
