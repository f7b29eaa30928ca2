"""A SandboxFusion-compatible endpoint: verl's ``sandbox_fusion_url`` and SandboxFusion's client, unchanged,
run code on DSec's function backend.

``dsec serve --sandbox-fusion HOST:PORT`` (and the cluster gateway's ``--sandbox-fusion``) adds a listener
that answers ``POST /run_code`` as SandboxFusion does (bytedance/SandboxFusion's ``sandbox_api.py``). Each
request runs in a function sandbox of its own, claimed from a warm pool, through the node API; nothing here
runs a process.

    options.py    the listener's address and the requests' sandboxes (image, memory, output cap, pool)
    wire.py       SandboxFusion's request and response models
    languages.py  how each language is compiled and run, and the probe of the image's toolchains
    runner.py     one request -> node API calls (create, write, exec, read, destroy) and the statuses
    app.py        the HTTP app: token auth, /run_code, /v1/ping
    serve.py      wiring into a node daemon or the gateway
"""

from __future__ import annotations

from dsec.fusion.options import FusionOptions, RunnerSettings

__all__ = ["FusionOptions", "RunnerSettings"]
