"""`bench serve` and `bench structured`: online serving through HTTP, like `vllm bench serve`."""
