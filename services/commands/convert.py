"""`pagedserve convert`: turn a model into what the services load, once, ahead of serving.

A GGUF file is dequantized into a Hugging Face safetensors directory (config, weights, tokenizer) that
the engine loads in seconds; with --tokenizer-only only the tokenizer, chat template and config are
written (all the router and the scheduler read). Run it as an init container onto a volume, or as a
Job onto the model volume before the release starts, so no serving process converts anything and the
torch-free router and scheduler images never need to. Converting again into a directory that already
holds this source's conversion does nothing; a directory converted from another source is replaced.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from services.model_files import model_source

log = logging.getLogger(__name__)


def convert(model: str | None, output: Path, tokenizer_only: bool = False) -> Path:
    """Convert `model` (a .gguf file, a directory holding one, or None for the bundled model) into `output`."""
    gguf = model_source.gguf_of(model)
    if gguf is None:
        raise SystemExit(f"{model} is already a Hugging Face directory (config.json): point --model at it, "
                         "there is nothing to convert")
    output = Path(output)
    fingerprint = model_source.source_fingerprint(gguf, tokenizer_only)
    marker = output / model_source.CONVERTED_MARKER
    if marker.exists():
        if marker.read_text() == fingerprint:
            log.info("%s already holds %s of %s; nothing to do", output, "the tokenizer" if tokenizer_only
                     else "the conversion", gguf.name)
            return output
        log.warning("%s was converted from another source (%s); converting again", output,
                    marker.read_text().strip())
        shutil.rmtree(output)
    started = time.monotonic()
    if tokenizer_only:
        model_source.extract_tokenizer(gguf, output)
    else:
        model_source.convert_gguf(gguf, output)
    log.info("converted %s into %s in %.1fs", gguf, output, time.monotonic() - started)
    return output


def run(args) -> int:
    try:
        convert(args.model, Path(args.output), args.tokenizer_only)
    except OSError as exc:  # the disk full, or the directory taken away meanwhile
        raise SystemExit(f"pagedserve convert: cannot write {args.output}: {exc}") from None
    return 0
