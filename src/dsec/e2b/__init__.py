"""An E2B-compatible endpoint: the ``e2b`` SDK, unchanged, drives DSec sandboxes.

``dsec serve --e2b HOST:PORT`` (and the cluster gateway's ``--e2b``) adds a listener that speaks E2B's
control plane (REST, ``spec/openapi.yml`` of e2b-dev/E2B) and its in-sandbox agent envd (Connect RPC
process and filesystem services, plain HTTP ``/files`` and ``/health``). Every call is translated onto
DSec's node API; nothing here runs sandboxes.

    options.py    what the operator chooses (listen address, domain, TLS, default image, backend, network)
    keys.py       API keys -> DSec tokens (principals), envd access tokens, signed file URLs
    translate.py  E2B JSON <-> DSec models, DSec errors -> E2B errors
    control.py    the REST control plane
    process.py    envd's Process service
    filesystem.py envd's Filesystem service and /files
    app.py        one ASGI app: routes a request to the control plane, a sandbox's envd, or a sandbox port

The E2B wire definitions come from the pinned ``e2b`` wheel (``pip install 'dsec[e2b]'``, see ``wire.py``).
"""

from __future__ import annotations

from dsec.e2b.options import E2BOptions

__all__ = ["E2BOptions"]
