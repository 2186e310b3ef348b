"""The chaos and soak suite: real processes on loopback, faults injected, figures written to a JSON report
(`python -m soak`, `make soak`)."""
