"""Load generator and speculation A/B benchmark for OpenAI-compatible servers.

`python -m loadtest run|compare|sweep --help`. Latency metrics follow vLLM's
serving benchmark (`vllm/benchmarks/serve.py`); speculation figures come from
the server's Prometheus counters (specserve's or vLLM's own).
"""
