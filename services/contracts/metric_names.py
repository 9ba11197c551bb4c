"""Names of every Prometheus metric the services export, in one place.

The scheduler and router register their metrics under these names, and everything outside the
services that names a metric (the Helm chart's HPA and KEDA trigger, the Prometheus adapter rules,
the Grafana dashboard) is checked against them by tests/charts, so a renamed metric breaks a test
instead of silently breaking autoscaling in production.
"""

from __future__ import annotations

# --- scheduler (one per model replica) ---
REQUESTS_WAITING = "pagedserve_requests_waiting"  # gauge: queued, not yet scheduled; the autoscaling signal
REQUESTS_RUNNING = "pagedserve_requests_running"  # gauge: in the running batch
KV_CACHE_USAGE_RATIO = "pagedserve_kv_cache_usage_ratio"  # gauge in [0, 1]: used KV blocks / all blocks
PREFIX_CACHE_QUERIES = "pagedserve_prefix_cache_queries_total"  # counter, tokens looked up
PREFIX_CACHE_HITS = "pagedserve_prefix_cache_hits_total"  # counter, tokens found cached
PREEMPTIONS = "pagedserve_preemptions_total"  # counter
PROMPT_TOKENS = "pagedserve_prompt_tokens_total"  # counter
GENERATION_TOKENS = "pagedserve_generation_tokens_total"  # counter
TIME_TO_FIRST_TOKEN = "pagedserve_time_to_first_token_seconds"  # histogram
INTER_TOKEN_LATENCY = "pagedserve_inter_token_latency_seconds"  # histogram
E2E_REQUEST_LATENCY = "pagedserve_e2e_request_latency_seconds"  # histogram
# vLLM's own name and labels (running_lora_adapters, waiting_lora_adapters, max_lora), so gateways that read
# vLLM's LoRA residency (llm-d, AIBrix, Gateway API inference extension) read pagedserve's too.
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
# Speculative decoding (issue 33), under vLLM's names so its dashboards and queries read pagedserve's:
# acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts; per-position
# acceptance = accepted_per_pos{position} / drafts. Exported only by replicas that speculate.
SPEC_DECODE_NUM_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DECODE_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_DECODE_NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"  # label position
SPEC_DECODE_METRICS = frozenset({SPEC_DECODE_NUM_DRAFTS, SPEC_DECODE_NUM_DRAFT_TOKENS, SPEC_DECODE_NUM_ACCEPTED_TOKENS,
                                 SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS})
# gauge: the step size (tokens) at which a forward pass is measured to turn compute-bound; speculation
# turns down as a step approaches and passes it (services/scheduler/spec_decode/policy.py)
# A mixture-of-experts model's routing (issue 31), label `expert`: tokens routed to each expert, summed over
# its expert layers (one series per expert, not per layer and expert: 60 layers x 256 experts would be 15k
# series per replica). Imbalance = max / mean of the rates. Exported only by replicas serving experts.
MOE_EXPERT_TOKENS = "pagedserve_moe_expert_tokens_total"
SPEC_DECODE_KNEE_TOKENS = "pagedserve_spec_decode_knee_tokens"
# Structured output (counters): compile time per compile = compile_seconds / compiles; mask time per step =
# mask_seconds / mask_steps; constrained share of rows = constrained_rows / sampled_rows.
GUIDED_COMPILES = "pagedserve_structured_output_compiles_total"
GUIDED_COMPILE_SECONDS = "pagedserve_structured_output_compile_seconds_total"
GUIDED_CACHE_HITS = "pagedserve_structured_output_grammar_cache_hits_total"
GUIDED_COMPILE_FAILURES = "pagedserve_structured_output_compile_failures_total"
GUIDED_MASK_STEPS = "pagedserve_structured_output_mask_steps_total"
GUIDED_MASK_SECONDS = "pagedserve_structured_output_mask_seconds_total"
GUIDED_CONSTRAINED_ROWS = "pagedserve_structured_output_constrained_rows_total"
SAMPLED_ROWS = "pagedserve_sampled_rows_total"

# --- router ---
ROUTER_REQUESTS = "pagedserve_router_requests_total"  # counter, label status (HTTP code)
ROUTER_UPSTREAM_ERRORS = "pagedserve_router_upstream_errors_total"  # counter
ROUTER_RETRIES = "pagedserve_router_retries_total"  # counter
ROUTER_QUEUE_DEPTH = "pagedserve_router_queue_depth"  # gauge: requests waiting for a free replica
ROUTER_MODEL_QUEUE_DEPTH = "pagedserve_router_model_queue_depth"  # gauge, label model: the same per base model
# gauge: requests held while no replica is ready; the scale-from-zero signal (present at 0 from the start)
ROUTER_REQUESTS_HELD = "pagedserve_router_requests_held"
ROUTER_PREFIX_MATCH_RATIO = "pagedserve_router_prefix_match_ratio"  # histogram: share of prompt cached
ROUTER_HEALTHY_REPLICAS = "pagedserve_router_healthy_replicas"  # gauge
ROUTER_ROUTING_DECISIONS = "pagedserve_router_routing_decisions_total"  # counter, labels policy, replica
# counter: index reads not made (Redis unreachable, no connection free, skipped while down): decisions on load only
ROUTER_INDEX_FALLBACKS = "pagedserve_router_index_fallbacks_total"

# The per-pod metric the HorizontalPodAutoscaler averages (through the Prometheus adapter).
AUTOSCALING_METRIC = REQUESTS_WAITING

SCHEDULER_METRICS = frozenset({
    REQUESTS_WAITING, REQUESTS_RUNNING, KV_CACHE_USAGE_RATIO, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS,
    PREEMPTIONS, PROMPT_TOKENS, GENERATION_TOKENS, TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY,
    E2E_REQUEST_LATENCY, GUIDED_COMPILES, GUIDED_COMPILE_SECONDS, GUIDED_CACHE_HITS, GUIDED_COMPILE_FAILURES,
    GUIDED_MASK_STEPS, GUIDED_MASK_SECONDS, GUIDED_CONSTRAINED_ROWS, SAMPLED_ROWS, SPEC_DECODE_KNEE_TOKENS,
})
ROUTER_METRICS = frozenset({
    ROUTER_REQUESTS, ROUTER_UPSTREAM_ERRORS, ROUTER_RETRIES, ROUTER_QUEUE_DEPTH, ROUTER_MODEL_QUEUE_DEPTH,
    ROUTER_REQUESTS_HELD,
    ROUTER_PREFIX_MATCH_RATIO,
    ROUTER_HEALTHY_REPLICAS, ROUTER_ROUTING_DECISIONS, ROUTER_INDEX_FALLBACKS,
})
HISTOGRAMS = frozenset({TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, E2E_REQUEST_LATENCY, ROUTER_PREFIX_MATCH_RATIO})
ALL_METRICS = SCHEDULER_METRICS | ROUTER_METRICS


def exported_series_names() -> frozenset[str]:
    """Every series name a Prometheus scrape can show: histograms add _bucket, _sum and _count."""
    names = set(ALL_METRICS)
    for hist in HISTOGRAMS:
        names.update((hist + "_bucket", hist + "_sum", hist + "_count"))
    return frozenset(names)
