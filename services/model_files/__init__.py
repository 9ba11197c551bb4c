"""A model's files on disk, read without torch where possible: sources (GGUF, Hugging Face directories), the
tokenizer and chat template, LoRA adapter files."""
