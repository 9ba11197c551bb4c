"""The model families the engine serves: one module per family (llama, qwen3, gemma, phi3), each a
thin reading of its checkpoint's config into a `DecoderSpec` that the shared decoder (decoder.py) runs,
registered by `architectures` name (registry.py); transformers' own classes for other dense decoders
(transformers_backend.py). Adding a family is one small module, a line in the registry, and its tests."""
