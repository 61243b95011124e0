"""NaN/Inf: the checks of one step (detector, output, checks), the held-back update (guard), the
forward replay, who made the first one (attribution) and what to do about it (incident). A
feature package: imports foundations, device/ and step/, never efficiency/ or phases/.

docs/architecture.md has the layers and who owns what."""
