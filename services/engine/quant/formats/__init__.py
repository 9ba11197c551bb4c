"""Readers of each on-disk quantized format into a `QuantizedWeight` (services/engine/quant/packed_weight.py)."""
