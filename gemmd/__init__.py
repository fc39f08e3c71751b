"""gemmd: scheduled GEMM probes on every GPU, measured vs predicted, as Prometheus metrics."""

__version__ = "0.1.0"
