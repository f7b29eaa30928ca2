"""The former home of the surface's wire models, kept so that ``dsec.models_surface`` imports keep working:
they live in :mod:`dsec.models.surface` (and are importable from :mod:`dsec.models`).

Owns nothing; must never define a model."""

from dsec.models.surface import *  # noqa: F403
from dsec.models.surface import __all__ as __all__
