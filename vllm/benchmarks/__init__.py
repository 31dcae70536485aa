"""`vllm bench` (latency, throughput, serve) and the timing the benchmarks/ scripts share."""
