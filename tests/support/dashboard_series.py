"""The series vLLM's Grafana dashboard and llm-d's autoscaler query (names as scraped: counters with `_total`)."""

DASHBOARD_SERIES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:request_success_total", "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:iteration_tokens_total", "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n", "vllm:request_params_max_tokens", "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds")
# Histograms whose _count is one per finished request.
PER_REQUEST_HISTOGRAMS = ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                          "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                          "vllm:request_inference_time_seconds", "vllm:request_prompt_tokens",
                          "vllm:request_generation_tokens", "vllm:time_to_first_token_seconds",
                          "vllm:request_time_per_output_token_seconds", "vllm:request_params_n",
                          "vllm:request_params_max_tokens", "vllm:request_max_num_generation_tokens")


def samples(text: str) -> list:
    """Every sample of a Prometheus text page, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]
