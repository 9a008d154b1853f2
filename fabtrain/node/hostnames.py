"""A host name or address in the form the resolver takes without the idna codec.

socket.getaddrinfo, and socket.create_connection which calls it, pass every
str host through the idna codec, and its first use imports encodings.idna,
stringprep and unicodedata: ~2 ms of CPU in every agent's start and in every
node's port probe, paid by all nodes at once when a job starts (64 nodes on
2 cores wait for each other's CPU in bench/scale.py). An ASCII name or address
means the same as bytes, and bytes skip the codec; only a name with other
letters (an internationalized domain name) still needs it.
"""


def for_resolver(host):
    """host as bytes when it is ASCII (what getaddrinfo takes as it is), else unchanged."""
    return host.encode("ascii") if host.isascii() else host
