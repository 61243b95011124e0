"""FLOPs per layer and for the model, the device's peak, weight and update norms: measured on
sampled steps (figures, flops, updates, peaks) and their metric families. A feature package:
imports foundations, device/ and step/, never nonfinite/ or phases/.

docs/architecture.md has the layers and who owns what."""
