"""Baseline: vLLM's CPU build, run as a subprocess inside its own virtualenv (`make vllm-env`).

This file runs under the vLLM virtualenv's Python and imports nothing from pagedserve: it reads the
workload (token ids and output lengths) from a JSON file and prints one JSON line with its result.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # A GGUF file served as it is: vLLM's --quantization gguf, the tokenizer from its extracted directory.
    extra = {"quantization": spec["quantization"], "tokenizer": spec["tokenizer"]} if spec.get("quantization") else {}
    llm = LLM(model=spec["model"], dtype=spec["dtype"], enable_prefix_caching=True, **extra,
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_model_len=spec.get("max_model_len", 2048), seed=0)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in spec["requests"]]
    params = [SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True)
              for r in spec["requests"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print("PAGEDSERVE_RESULT " + json.dumps({"output_tokens": n, "seconds": elapsed, "tokens_per_s": n / elapsed}),
          flush=True)


if __name__ == "__main__":
    main()
