"""What ax tells an operator: Prometheus metrics."""
