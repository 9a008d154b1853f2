"""The agents' shared view of a job: a tiny key-value service of our own.

The first node's agent (job.json ``nodes[0]``) hosts a `Coordinator` on
``watchdog.coordinator`` (host, port); every agent, that one included, keeps
one TCP connection to it through a `Client`. Beats go up every
``watchdog.interval`` and at once when something happens; the coordinator
answers each and pushes a status line to every agent the moment the job's
status changes, so a failure on one node reaches the others in milliseconds.

    board.py        the state table (pure): who beat when, the job's status, lost peers
    protocol.py     JSON lines bounded before parsing; a handshake and an HMAC on every
                    line, keyed by the job's secret, which never travels
    server.py       Coordinator: the board behind a TCP port, one selector loop on a thread
    connections.py  its open connections: caps and timeouts for those without the secret
    client.py       Client: one agent's connection, reconnecting by itself

Why not ``torch.distributed.TCPStore``: importing torch costs the agent ~40+ MB
of RSS and a second of CPU on every node, where the agent must stay under
40 MB, and a store still needs polling for the "someone failed" key. This is
a few hundred lines of stdlib: selectors, sockets, json, hmac.

Import each from its module: this package imports nothing, so an agent that
does not host the coordinator never loads the board and the server (a start
pays every import on every node at once).
"""
