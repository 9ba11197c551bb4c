"""`pagedserve bench quant`: the bundled model in each weight format, side by side in one run.

For each format (bf16: the GGUF file dequantized to a float checkpoint and served in bfloat16, the way
pagedserve served it before; gguf-q4_1: the bundled file's weights as they are; gguf-q8_0: the same
weights requantized to Q8_0 blocks, written once into the cache) it reports, from the engine's own
accounting, the weights' bytes and their ratio to bf16, and the decode tokens/s at batch 1 and batch 64
(short prompts, `--decode-tokens` new tokens each, every format measured in each pass, passes alternating
in order and reversed; medians and spreads). With `--kv-fp8` it also reports the KV blocks a fixed
`--kv-cache-memory` holds with an FP8 cache against a bf16 one, and the share of greedy tokens of 100
prompts that an FP8 cache gives identically to a bf16 cache.

Every figure names its weight format, and every row of a comparison uses the same dtype (bfloat16
activations) and the same prompts.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

FORMATS = ("bf16", "gguf-q4_1", "gguf-q8_0")


def copy_gguf_metadata(reader, writer, overrides: dict | None = None) -> None:
    """Every key-value field of a GGUF reader into a writer (architecture excepted: the writer has it),
    with `overrides` (key -> uint32) replacing some."""
    from gguf import GGUFValueType as V

    overrides = overrides or {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in overrides:
            writer.add_key_value(key, overrides[key], V.UINT32)
        elif field.types[0] == V.ARRAY:
            writer.add_key_value(key, field.contents(), V.ARRAY, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), field.types[0])


def requantized_gguf(src: Path, kind: str) -> Path:
    """`src` with every quantized tensor dequantized and requantized to `kind` (e.g. "Q8_0"), once."""
    import gguf
    import numpy as np

    from services.model_files.model_source import cache_root

    out = cache_root() / "models" / f"{src.stem}.requantized-{kind}.gguf"
    if out.exists():
        return out
    target = gguf.GGMLQuantizationType[kind]
    reader = gguf.GGUFReader(str(src))
    tmp = out.with_suffix(".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(tmp), str(reader.fields["general.architecture"].contents()))
    copy_gguf_metadata(reader, writer)
    for t in reader.tensors:
        if t.tensor_type.name in ("F32", "F16", "BF16"):
            writer.add_tensor(t.name, np.array(t.data))
            continue
        values = gguf.dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))
        writer.add_tensor(t.name, gguf.quantize(values.astype(np.float32), target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


def engine_for(fmt: str, **kw):
    from services import LLM
    from services.model_files.model_source import default_gguf_path

    if fmt == "bf16":
        return LLM(dtype="bfloat16", **kw)
    if fmt == "gguf-q4_1":
        return LLM(dtype="bfloat16", quantization="gguf", **kw)
    if fmt == "gguf-q8_0":
        return LLM(model=str(requantized_gguf(default_gguf_path(), "Q8_0")), dtype="bfloat16", quantization="gguf",
                   **kw)
    raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")


def decode_rate(llm, batch: int, decode_tokens: int, prompt_len: int = 16) -> float:
    """Decode tokens/s of `batch` sequences: the steps after the first (which prefills every prompt)."""
    from services import SamplingParams

    prompts = [[(7919 * (i * prompt_len + j)) % 40000 + 100 for j in range(prompt_len)] for i in range(batch)]
    times: list[float] = []
    last = [0.0]

    def hook(_core):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    llm.step_hook = hook
    last[0] = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True), use_tqdm=False)
    llm.step_hook = None
    decode_steps = times[1:]
    return batch * len(decode_steps) / sum(decode_steps)


def kv_fp8_figures(kv_cache_memory: str, prompts: int, max_tokens: int) -> dict:
    """FP8 against bf16 cache on the bundled model (bf16 weights): blocks in the same memory, and the share of
    greedy tokens that agree (position by position, over `prompts` prompts)."""
    from services import LLM, SamplingParams

    texts = [[(104729 * (i + 1) * (j + 3)) % 40000 + 100 for j in range(24 + i % 40)] for i in range(prompts)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = {}
    tokens = {}
    for kind in ("auto", "fp8"):
        llm = LLM(dtype="bfloat16", kv_cache_memory=kv_cache_memory, kv_cache_dtype=kind)
        out[f"kv_blocks_{kind}"] = llm.runner.num_kv_blocks
        tokens[kind] = [o.outputs[0].token_ids for o in llm.generate(texts, params, use_tqdm=False)]
        llm.close()
    same = sum(a == b for x, y in zip(tokens["auto"], tokens["fp8"], strict=True) for a, b in zip(x, y, strict=True))
    total = sum(len(x) for x in tokens["auto"])
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                  for x, y in zip(tokens["auto"], tokens["fp8"], strict=True)]
    out.update(kv_blocks_ratio=out["kv_blocks_fp8"] / out["kv_blocks_auto"], greedy_tokens_agreeing=same / total,
               prompts_identical=sum(d is None for d in first_diff) / len(first_diff), prompts=prompts,
               max_tokens=max_tokens, kv_cache_memory=kv_cache_memory)
    return out


def run(args) -> None:
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for f in formats:
        if f not in FORMATS:
            raise SystemExit(f"--formats: unknown format {f!r}; formats: {', '.join(FORMATS)}")
    engines = {f: engine_for(f, num_kv_blocks=args.num_kv_blocks, max_num_seqs=max(args.batches)) for f in formats}
    weights = {f: engines[f].runner.memory[0].weight_bytes for f in formats}
    for f in formats:  # warm-up outside the clock
        decode_rate(engines[f], 1, 4)
    rates: dict[tuple[str, int], list[float]] = {}
    for p in range(args.passes):
        order = formats if p % 2 == 0 else formats[::-1]
        for f in order:
            for b in args.batches:
                rates.setdefault((f, b), []).append(decode_rate(engines[f], b, args.decode_tokens))
    rows = []
    base = weights.get("bf16")
    for f in formats:
        row = {"format": f, "dtype": "bfloat16", "weight_bytes": weights[f],
               "weight_ratio_to_bf16": None if base is None else weights[f] / base}
        for b in args.batches:
            r = rates[(f, b)]
            row[f"decode_tok_s_batch{b}"] = statistics.median(r)
            row[f"decode_tok_s_batch{b}_range"] = [min(r), max(r)]
        rows.append(row)
    result = {"machine": platform.processor() or platform.machine(), "passes": args.passes,
              "decode_tokens": args.decode_tokens, "rows": rows}
    if args.kv_fp8:
        result["kv_fp8"] = kv_fp8_figures(args.kv_cache_memory, args.kv_prompts, args.kv_max_tokens)
    print(f"{'format':<12} {'weights MiB':>11} {'x bf16':>7} " +
          " ".join(f"{'b' + str(b) + ' tok/s (range)':>24}" for b in args.batches))
    for row in rows:
        ratio = row["weight_ratio_to_bf16"]
        cells = [f"{row[f'decode_tok_s_batch{b}']:9.1f} ({row[f'decode_tok_s_batch{b}_range'][0]:.0f}-"
                 f"{row[f'decode_tok_s_batch{b}_range'][1]:.0f})" for b in args.batches]
        print(f"{row['format']:<12} {row['weight_bytes'] / 2**20:11.1f} {'' if ratio is None else f'{ratio:7.3f}'} "
              + " ".join(f"{c:>24}" for c in cells))
    if args.kv_fp8:
        print(json.dumps(result["kv_fp8"], indent=2))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
