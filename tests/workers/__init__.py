"""Entry points that run in a process of their own: the bodies of spawned torch.distributed
ranks (imported by name as `workers.<module>` in the child) and scripts a test starts with
`python tests/workers/<script>.py` (support.paths.worker gives the path)."""
