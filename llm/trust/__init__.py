"""Trust in files on disk: bounded reads, SHA-256 manifests, the hash cache, trust on first use, checkpoint checks."""
