"""The compute core run inside each worker: precision, parallelism, optimizer, train step."""
