"""Cluster mode on Ray: a gateway serving the node API over many node daemons.

``placement`` decides where sandboxes go (pure logic), ``state`` keeps the gateway's records in
PostgreSQL, ``gateway`` implements the node API (``dsec.api.NodeAPI``) the daemon's HTTP app serves,
``ray_nodes`` runs one daemon per Ray node and reports membership, ``server`` is the gateway process.
Nothing here runs a sandbox: nodes do.
"""
