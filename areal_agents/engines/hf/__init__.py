"""The built-in transformers engine: `HFEngine` (in-process, continuous batching) and `ProcessEngine`."""
