"""Trust in files on disk: bounded reads, SHA-256 manifests, the hash cache, trust on first use, checkpoint checks.

The names below are its public surface: code outside llm/ imports them from here. Each is imported
from its module on first use (llmplan/lazy_exports.py), so importing the package costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmplan.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .checkpoint import (
        IntegrityError,
        ShardManifest,
        build_manifest,
        files_read_by_load,
        read_safetensors_header,
        verify,
    )
    from .files import FileProblem, describe_os_error, read_bytes_limited, read_json_limited
    from .first_use import FirstUseError, trust_file_on_first_use, trust_on_first_use
    from .hash_cache import HashCache, identity_of
    from .manifest import (
        MANIFEST_NAME,
        ManifestError,
        manifest_fingerprint,
        open_regular_fd,
        read_sha256sums,
        sha256_fd,
    )

EXPORTS = {  # name -> the module that defines it
    "FileProblem": "files",
    "FirstUseError": "first_use",
    "HashCache": "hash_cache",
    "IntegrityError": "checkpoint",
    "MANIFEST_NAME": "manifest",
    "ManifestError": "manifest",
    "ShardManifest": "checkpoint",
    "build_manifest": "checkpoint",
    "describe_os_error": "files",
    "files_read_by_load": "checkpoint",
    "identity_of": "hash_cache",
    "manifest_fingerprint": "manifest",
    "open_regular_fd": "manifest",
    "read_bytes_limited": "files",
    "read_json_limited": "files",
    "read_safetensors_header": "checkpoint",
    "read_sha256sums": "manifest",
    "sha256_fd": "manifest",
    "trust_file_on_first_use": "first_use",
    "trust_on_first_use": "first_use",
    "verify": "checkpoint",
}
__all__ = [
    "MANIFEST_NAME",
    "FileProblem",
    "FirstUseError",
    "HashCache",
    "IntegrityError",
    "ManifestError",
    "ShardManifest",
    "build_manifest",
    "describe_os_error",
    "files_read_by_load",
    "identity_of",
    "manifest_fingerprint",
    "open_regular_fd",
    "read_bytes_limited",
    "read_json_limited",
    "read_safetensors_header",
    "read_sha256sums",
    "sha256_fd",
    "trust_file_on_first_use",
    "trust_on_first_use",
    "verify",
]
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
