"""Version checks against the installed transformers (no transformers import until one is asked)."""

from __future__ import annotations

__all__ = ["CRF_LOADING_SINCE", "require_transformers"]

# Before this release `from_pretrained` re-initialises the CRF's scores of a model saved with add_crf (no error).
CRF_LOADING_SINCE = "5.13.0"


def require_transformers(version: str, feature: str) -> None:
    """Refuse ``feature`` with one clear line when the installed transformers is older than ``version``."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(version):
        raise RuntimeError(
            f"{feature} needs transformers >= {version} (installed: {transformers.__version__}): "
            f"pip install 'transformers>={version}'"
        )
