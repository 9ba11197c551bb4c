"""`bench paper`: the Orca and vLLM papers' experiments reproduced (traces, baselines, sustained rates)."""
