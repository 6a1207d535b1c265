"""Files weights come in: safetensors shards read through a bounded buffer, checkpoints written, GGUF files."""
