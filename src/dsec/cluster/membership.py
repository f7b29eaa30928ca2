"""Membership without Ray: the node list read from a URL that answers it as JSON.

Owns :class:`HttpNodes`, a gateway node source (see :data:`dsec.cluster.gateway.NodeSource`) for fleets
whose membership is kept by something other than Ray: the fleet simulator's ``/fleet/membership``
(``dsec bench cluster-sim`` and the cluster invariant tests), or an operator's own inventory service.
The document is a JSON list of objects with the fields of :class:`~dsec.cluster.gateway.NodeFacts`
(``name``, ``alive``, ``url``, ``token``, ``capacity``, ``reason``). It must never start node daemons:
whoever serves the list runs them.
"""

from __future__ import annotations

import httpx
from pydantic import BaseModel, ConfigDict, TypeAdapter

from dsec.cluster.gateway import NodeFacts
from dsec.errors import BackendUnavailable, InvalidRequest

__all__ = ["HttpNodes"]


class _Fact(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    alive: bool
    url: str | None = None
    token: str | None = None
    capacity: dict[str, object] | None = None
    reason: str | None = None


_FACTS = TypeAdapter(list[_Fact])


class HttpNodes:
    """``GET url`` once per membership poll; a list of node facts."""

    def __init__(self, url: str, token: str | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise InvalidRequest(f"--nodes-from must be an http(s):// URL answering the node list, got {url!r}")
        self.url = url
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http: httpx.AsyncClient | None = None
        self._etag: str | None = None
        self._last: list[NodeFacts] = []

    async def __call__(self) -> list[NodeFacts]:
        """One membership report: the very same list object as last time when the source answers that nothing
        changed (``304`` to ``If-None-Match``), which the gateway then skips."""
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=10.0, headers=self._headers)
        headers = {"If-None-Match": self._etag} if self._etag else {}
        try:
            response = await self._http.get(self.url, headers=headers)
            if response.status_code == 304:
                return self._last
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"the node list at {self.url} does not answer: {exc!r}") from exc
        self._etag = response.headers.get("etag")
        self._last = [NodeFacts(f.name, f.alive, f.url, f.token, f.capacity, f.reason)
                      for f in _FACTS.validate_json(response.content)]
        return self._last

    async def aclose(self) -> None:
        """Close the connection."""
        if self._http is not None:
            await self._http.aclose()
