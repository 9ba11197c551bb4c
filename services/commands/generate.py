"""`pagedserve generate`: offline generation from the command line (the default model when none given)."""

from __future__ import annotations

import sys


def run(args) -> int:
    from services import LLM, InvalidRequestError, SamplingParams
    from services.commands.engine import MODEL_LOAD_ERRORS

    # Checked at parse time (flag_rules.sampling): a bad value never waits for the model to load.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    try:
        llm = LLM(model=args.model, dtype=args.dtype)
    except MODEL_LOAD_ERRORS as exc:
        raise SystemExit(f"pagedserve generate: {exc}") from None
    try:
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
        else:
            outs = llm.generate(list(args.prompt), params, use_tqdm=False)
    except InvalidRequestError as e:  # a prompt the model cannot take (empty, longer than its context)
        print(f"pagedserve generate: error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompt, outs, strict=True):
        if len(args.prompt) > 1:
            print(f"### {prompt}")
        print(out.outputs[0].text)
    return 0
