"""Quantized checkpoints: which `quantization_config`s are served (`scheme`), the packed weights they
hold (`packed_weight`), each on-disk format's reader (`formats/`), and the linear layer that multiplies
by a packed weight (`quant_linear`)."""
