"""GGUF: the header and tensor table read with bounds, its metadata as a config and tokenizer, the import."""
