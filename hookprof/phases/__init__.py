"""Where the training thread is and how long each step phase took, on the host and the device
(clock, device, recorder), and the stall watch that judges it. A feature package: imports
foundations, device/ and step/, never nonfinite/ or efficiency/.

docs/architecture.md has the layers and who owns what."""
