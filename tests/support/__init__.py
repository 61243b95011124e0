"""Helpers the tests share, each written once: import them as `support.<module>` (pytest puts
tests/ on the path, pyproject's `pythonpath`).

Training
  models         the small deterministic models and the loops that train them
  settings       Config overrides most tests attach with (every step sampled, or rarely)
  optimizers     the optimizers the NaN-guard tests step (fused, for-each, momentum SGD)
  closures       closure steps: the loop, a SAM optimizer, the closure optimizers
  inject         every NaN/Inf injector (by step, by batch, a NaN-making layer)
  first_nan      issue 28's first-NaN scenarios, what hookprof must say of each, their loop
  compare        parameters compared bit for bit with a reference run, finiteness
  lightning_models  a LightningModule, its callbacks, one DDP rank of Trainer.fit
Devices and costs
  lagging_device a CPU stand-in for a device that runs steps behind the host
  sync_watch     catches, on the CPU, every wait for a GPU hookprof would make
  fake_gpu       stand-ins for NVML and torch.cuda (streams, events)
  cuda           the model, loop parts and no-sync check of the tests on a real GPU
  op_counter     ATen ops counted per step (hookprof's share of an unsampled step)
  mark_counter   timer marks and hook calls of one sampled step
  phase_clock    a fake clock for the step phase tests
  stalling       layers and datasets that stall on purpose
  hooks_left     torch's own hook registries, read to prove detach() left nothing
Outside the process
  metrics        scraping /metrics and reading samples back
  rendered       the HTML report and `hookprof top`'s cells read back
  ports          free TCP ports on loopback
  processes      children a test starts: the hookprof CLI, their output, stopping them
  waiting        polling until a condition holds, with a bound
  binaries       promtool, prometheus ...: found, or the test skipped naming the package
  servers        real Prometheus and Alertmanager on loopback, a webhook receiver
  dashboard      the shipped Grafana dashboard and alert rules, read for their queries
  ranks          torch.distributed ranks spawned on the CPU (gloo)
  certs          a CA and certificates made for TLS tests
  paths          where the repository's files are (root, bench/, deploy/, tests/workers/)
  hardware       whether a CUDA device or an NVIDIA driver is here
"""
