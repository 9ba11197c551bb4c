"""What one request asks for: its error type, sampling, structured-output and beam-search parameters, and the
one table of their limits that every process boundary checks."""
