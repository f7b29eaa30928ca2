"""The node API, written once: the operations a DSec node offers (:class:`NodeAPI`), how each travels over
HTTP (:mod:`dsec.api.operations`), one HTTP client for any number of nodes (:class:`NodeClient`) and the
server binding the daemon and the gateway serve (:mod:`dsec.api.binding`, imported on its own: it pulls in
FastAPI). See ``docs/api.md``."""

from dsec.api.client import NodeClient
from dsec.api.operations import Operation, operations_of
from dsec.api.protocol import NodeAPI

__all__ = ["NODE_OPERATIONS", "NodeAPI", "NodeClient", "Operation"]

NODE_OPERATIONS = operations_of(NodeAPI)
"""Every operation of :class:`NodeAPI`, in declaration order (the order of the server's routes)."""
