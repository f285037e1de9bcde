"""litevlm: a low-latency vision-language inference pipeline for multi-camera rigs (LiteVLM, arXiv 2506.07416)."""

from litevlm.errors import LiteVLMError

__all__ = ["LiteVLMError", "Pipeline", "Answer"]
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import litevlm` stays cheap for the CLI and for data-only users.
    if name in ("Pipeline", "Answer"):
        from litevlm import pipeline

        return getattr(pipeline, name)
    raise AttributeError(name)
