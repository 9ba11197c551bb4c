"""LoRA adapters in the engine: weights read from checked PEFT files (`weights`), fixed slot buffers and
the host LRU behind them (`slots`), and the batched shrink/expand added to each projection (`batch`)."""
