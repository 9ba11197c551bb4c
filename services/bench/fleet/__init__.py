"""`bench routing`, `bench router-overhead` and `bench chaos`: local clusters under load and faults."""
