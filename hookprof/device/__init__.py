"""The one seam between host and device: timers of layer calls (CPU clock or CUDA events on
the tensor's own stream) and every movement of scalars from device to host (one batched copy
per sampled step, one-value peeks, index copies). Imports only foundations.

docs/architecture.md has the layers and who owns what."""
