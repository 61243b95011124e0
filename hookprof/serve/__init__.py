"""The process's /metrics endpoint: the HTTP server with its limits (httpd, server), the snapshot
collector (exporter), system and GPU metrics, the endpoint every model joins and one profiler's
place on it (attachment). Reads snapshots only, never the hooks or the device.

docs/architecture.md has the layers and who owns what."""
