"""colibri-moe on Ray: engine replicas behind Ray Serve, and one model split
into pipeline stages across machines. Needs the ray extra:
``pip install 'colibri-moe[ray]'``."""

from __future__ import annotations

from ._pipeline import Engine, Pipeline
from ._serve import deployment, require, serve

__all__ = ["Engine", "Pipeline", "deployment", "require", "serve"]
