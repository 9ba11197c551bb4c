"""`bench index`: the prefix index at fleet scale, with simulated replicas writing to real Redis."""
