"""Images: the node's store of root filesystems and the builders that fill it.

Owns naming, layout and import (``store``) and Debian bootstrap recipes (``build``). Never runs
sandboxes and never mounts anything.
"""

from dsec.images.build import RECIPES, build
from dsec.images.image_store import DEFAULT_PATH, ImageStore, validate_name

__all__ = ["DEFAULT_PATH", "RECIPES", "ImageStore", "build", "validate_name"]
