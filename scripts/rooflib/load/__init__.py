"""Load generation: workloads and prompts, the streaming HTTP/1.1 client, runs, their analysis, comparison and sweeps."""
