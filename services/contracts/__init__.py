"""What processes agree on: the step protocol, block hashing, internal auth, metric names, byte sizes (stdlib and
small pure packages only: every process imports it)."""
