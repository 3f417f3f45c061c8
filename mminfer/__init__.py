"""mminfer: fast long-video question answering with modality-aware sparse prefill."""

__version__ = "0.1.0"
