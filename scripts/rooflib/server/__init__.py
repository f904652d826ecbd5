"""What a server says: /metrics parsing and the diagnosis, Prometheus and fleets, the served model, the timeline during a run."""
