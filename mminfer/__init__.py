"""mminfer: fast long-video question answering with modality-aware sparse prefill."""

import os as _os

__version__ = "0.1.0"

# In a plain source checkout (no install, e.g. the GPU machine), `kernels/` and `server/`
# sit beside this package; make them importable as mminfer.kernels / mminfer.server.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py")) and _root not in __path__:
    __path__.append(_root)
