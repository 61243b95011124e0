"""One training step on the training thread: where it begins and ends (boundary), whether it is
sampled (plan) and what a sampled one records (hooks, record, sampled), its gradients, GradScaler's
skip decisions and the per-layer statistics (their interface, and hookprof's own written as
parts of it). Imports foundations and device/.

docs/architecture.md has the layers and who owns what."""
