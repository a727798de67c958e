"""Histogram buckets that gateways and workers both export, in one place so their series line up.

TTFT uses vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read alike.
"""

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
