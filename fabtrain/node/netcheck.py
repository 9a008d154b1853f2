"""The network as one node sees it: which interface carries its address, the
route to each peer, who holds a port, and whether the job's ports can be
listened on here and reached from the other nodes.

Runs ON a node (Python 3.8+, standard library only), through node ops'
`netcheck`. One call per node answers everything, so `fab check` and the
start tasks need one fan-out, never one connection per pair of nodes:

- every node opens a short-lived listener on each port it will hold for the
  job (when free: a taken port is reported with the pid and command holding
  it, where /proc shows them) and answers each connection with a token line;
- at the same time every node connects to every such port of the others,
  retrying a refused connection until the listener there is up (the nodes
  start within the same fan-out, a fraction of a second apart), and checks
  the token: the check's own listener answered, not some other program.

The connecting side closes first, so the listener's port is left without a
TIME_WAIT and a program that binds it right after (without SO_REUSEADDR)
still can.
"""
import array
import errno
import fcntl
import json
import os
import selectors
import socket
import struct
import time

from fabtrain.contract.jobfolder import job_folder
from fabtrain.contract.opreplies import Claim, Listened, Netcheck, Owner, Reached, Route, kept
from fabtrain.node import procfs
from fabtrain.node.hostnames import for_resolver

SIOCGIFCONF = 0x8912
SIOCGIFNETMASK = 0x891B
TCP_TIME_WAIT = "06"
TCP_LISTEN = "0A"
GREETING = "fabtrain-netcheck"
ATTEMPT_TIMEOUT = 2.0  # one connect attempt: a SYN nobody answers (a firewall that drops) ends here
GREET_TIMEOUT = 1.0  # connected, but no token within this: another program holds the port


# -- interfaces and routes -----------------------------------------------------------


def ipv4_interfaces():
    """[(interface, address, netmask)] of every IPv4 address (secondary ones too), by SIOCGIFCONF."""
    size = 40 if struct.calcsize("P") == 8 else 32  # struct ifreq
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        count = 64
        while True:
            buf = array.array("B", b"\0" * (size * count))
            ifconf = struct.pack("iP", len(buf), buf.buffer_info()[0])
            used = struct.unpack("iP", fcntl.ioctl(s.fileno(), SIOCGIFCONF, ifconf))[0]
            if used < len(buf):
                break
            count *= 4  # the buffer was full: there may be more
        data, found = buf.tobytes()[:used], []
        for i in range(0, used, size):
            label = data[i:i + 16].split(b"\0", 1)[0].decode()
            address = socket.inet_ntoa(data[i + 20:i + 24])
            try:
                mask = fcntl.ioctl(s.fileno(), SIOCGIFNETMASK, struct.pack("256s", label.encode()))
                netmask = socket.inet_ntoa(mask[20:24])
            except OSError:
                netmask = "255.255.255.255"
            # "eth0:1" is an address label; gloo and NCCL want the device.
            found.append((label.split(":", 1)[0], address, netmask))
    return found


def ipv6_interfaces():
    """[(interface, address)] from /proc/net/if_inet6."""
    found = []
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6:
                    packed = bytes.fromhex(parts[0])
                    found.append((parts[5], socket.inet_ntop(socket.AF_INET6, packed)))
    except (OSError, ValueError):
        pass
    return found


def resolve(address):
    """The IP address a host name or address stands for here (None if it does not resolve)."""
    try:
        return socket.getaddrinfo(for_resolver(address), None, 0, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return None


def is_local(ip):
    """True if this machine can listen on ip (127.0.0.2 can, on lo, without being listed)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def _in_subnet(ip, address, netmask):
    def number(a):
        return struct.unpack("!I", socket.inet_aton(a))[0]
    mask = number(netmask)
    return number(ip) & mask == number(address) & mask


def iface_of(ip):
    """The interface that carries ip on this machine, or None.

    An address listed on an interface is that interface's; one that is not
    listed but is local all the same (127.0.0.2 on lo) belongs to the
    interface whose subnet holds it.
    """
    if not ip:
        return None
    if ":" in ip:
        return next((name for name, a in ipv6_interfaces() if a == ip), None)
    interfaces = ipv4_interfaces()
    exact = next((name for name, a, _ in interfaces if a == ip), None)
    if exact or not is_local(ip):
        return exact
    return next((name for name, a, m in interfaces if _in_subnet(ip, a, m)), None)


def route_to(peer):
    """(local address, interface) a connection from here to peer would leave by.

    A UDP connect() sends nothing: it only asks the routing table.
    """
    ip = resolve(peer)
    if ip is None:
        return None, None
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            local = s.getsockname()[0]
    except OSError:
        return None, None
    return local, iface_of(local)


def link_speed(iface):
    """What the interface says it runs at, in Mb/s (None: it does not say, as lo and most virtual links)."""
    try:
        with open("/sys/class/net/%s/speed" % iface) as f:
            speed = int(f.read().strip())
        return speed if speed > 0 else None
    except (OSError, ValueError, TypeError):
        return None


# -- who holds a port ----------------------------------------------------------------


def tcp_sockets(names=("/proc/net/tcp", "/proc/net/tcp6")):
    """[(local port, state, inode)] of every TCP socket in /proc/net/tcp and tcp6 (or of `names`)."""
    found = []
    for name in names:
        try:
            with open(name) as f:
                next(f, None)
                for line in f:
                    parts = line.split()
                    if len(parts) >= 10:
                        found.append((int(parts[1].rsplit(":", 1)[1], 16), parts[3], parts[9]))
        except (OSError, ValueError):
            continue
    return found


def udp_sockets():
    """[(local port, state, inode)] of every UDP socket in /proc/net/udp and udp6 (the same columns as TCP's)."""
    return tcp_sockets(("/proc/net/udp", "/proc/net/udp6"))


def busy_ports(lo, hi, sockets=None):
    """Ports in [lo, hi] that a socket holds, TCP or UDP (an `auto` port may be a job's UDP port too: a ballot
    box's; TIME_WAIT does not hold one against SO_REUSEADDR, and a UDP socket is never in it)."""
    return sorted({port for port, state, _ in (sockets or tcp_sockets() + udp_sockets())
                   if lo <= port <= hi and state != TCP_TIME_WAIT})


def process_marker(pid):
    """(workspace, job id) of a fabtrain job process, from its environment, else (None, None)."""
    env = procfs.environ(pid)
    ws, job = env.get(b"FABTRAIN_WORKSPACE"), env.get(b"FABTRAIN_JOB_ID")
    return (ws.decode("utf-8", "replace") if ws else None), (job.decode("utf-8", "replace") if job else None)


def port_owner(port, udp=False):
    """Who holds a TCP (or UDP) port here: {"pid", "command", "workspace", "job_id"}, or {} when
    /proc does not show it (another user's process, without root)."""
    inodes = {inode for p, state, inode in (udp_sockets() if udp else tcp_sockets())
              if p == port and state != TCP_TIME_WAIT and inode != "0"}
    if not inodes:
        return {}
    wanted = {"socket:[%s]" % i for i in inodes}
    for pid in procfs.pids():
        fd_dir = "/proc/%d/fd" % pid
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(os.path.join(fd_dir, fd)) in wanted:
                    return _describe(pid)
            except OSError:
                continue
    return {}


def _describe(pid):
    command = " ".join(procfs.cmdline(pid))
    ws, job = process_marker(pid)
    return {"pid": pid, "command": command[:160], "workspace": ws, "job_id": job}


def claimed_ports(own_workspace, own_job):
    """Ports that running fabtrain jobs on this machine hold or are about to (their
    job.json's `listens`): a job's pserver binds its port seconds after it starts.

    Found through the job marker in /proc/<pid>/environ (this user's processes, or
    everyone's for root). [{"port", "count", "what", "workspace", "job_id"}].
    """
    jobs = set()
    for pid in procfs.pids():
        if pid != os.getpid():
            ws, job = process_marker(pid)
            if ws and job and (ws, job) != (own_workspace, own_job):
                jobs.add((ws, job))
    claims = []
    for ws, job in sorted(jobs):
        try:
            with open(job_folder(ws, job).job_json) as f:
                listens = json.load(f).get("listens") or []
        except (OSError, ValueError, AttributeError):
            continue
        for entry in listens:
            try:
                port, count, what = int(entry[0]), int(entry[1]), str(entry[2])
            except (TypeError, ValueError, IndexError):
                continue  # a job.json this code does not know: its ports are still seen when bound
            address = entry[3] if len(entry) > 3 else None
            if kept(Claim.FIELDS["port"], port) is None or kept(Claim.FIELDS["count"], count) is None \
                    or not (address is None or isinstance(address, str)):
                continue  # the same: not ports the reply's type carries (contract/opreplies.py Claim)
            claims.append({"port": port, "count": count, "what": what, "address": address,
                           "workspace": ws, "job_id": job})
    return claims


def ephemeral_range():
    """The ports the kernel hands to outgoing connections: `auto` keeps out of them."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = f.read().split()
        return [int(lo), int(hi)]
    except (OSError, ValueError):
        return [32768, 60999]


# -- listening and connecting --------------------------------------------------------


def _listener(ip, port):
    """A listening socket on (ip, port), as the job's programs would hold it, or the OSError."""
    family = socket.AF_INET6 if ip and ":" in ip else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip or "", port))
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL or not ip:
                raise
            s.bind(("", port))  # the node's address is not this machine's (NAT): where a store would listen
        s.listen(64)
        s.setblocking(False)
        return s
    except OSError:
        s.close()
        raise


class Exchange:
    """This node's listeners and connections, driven by one selector until all is answered."""

    def __init__(self, node, token, deadline):
        self.node, self.token, self.end = node, token, time.monotonic() + deadline
        self.sel = selectors.DefaultSelector()
        self.waiting = []  # (when, target): connections to (re)try
        self.open_targets = 0
        self.open_served = 0
        self.listeners = []  # (socket, entry)

    def listen(self, ip, entry):
        try:
            s = _listener(ip, entry["port"])
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                entry.update(state="taken", owner=port_owner(entry["port"]))
            else:
                entry.update(state="error", error=e.strerror or str(e))
            return
        entry.update(state="ok", accepted=0)
        self.listeners.append((s, entry))
        self.sel.register(s, selectors.EVENT_READ, ("accept", entry, s))

    def reach(self, target):
        target.update(state="refused", attempts=0)
        self.waiting.append((0.0, target))
        self.open_targets += 1

    def done(self):
        if self.open_targets or self.open_served:
            return False
        return all(e["accepted"] >= e.get("expect", 0) for _, e in self.listeners)

    def run(self):
        while not self.done() and time.monotonic() < self.end:
            now = time.monotonic()
            for item in [w for w in self.waiting if w[0] <= now]:
                self.waiting.remove(item)
                self._connect(item[1])
            for key, _ in self.sel.select(timeout=0.02):
                getattr(self, "_on_" + key.data[0])(*key.data[1:])
            self._expire(time.monotonic())
        for key in list(self.sel.get_map().values()):
            kind, entry, sock = key.data[0], key.data[1], key.data[2]
            if kind == "connect":
                entry["state"] = "timeout"
            elif kind == "greet":
                entry["state"] = "other"
            self.sel.unregister(sock)
            sock.close()
        self.sel.close()

    def _connect(self, target):
        ip = resolve(target["address"])
        if ip is None:
            target.update(state="error", error="cannot resolve %s" % target["address"])
            self.open_targets -= 1
            return
        s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        target["attempts"] += 1
        target["started"] = time.monotonic()
        code = s.connect_ex((ip, target["port"]))
        if code not in (0, errno.EINPROGRESS):
            s.close()
            return self._failed(target, code)
        self.sel.register(s, selectors.EVENT_WRITE, ("connect", target, s))

    def _failed(self, target, code):
        if code == errno.ECONNREFUSED and time.monotonic() + 0.05 < self.end:
            self.waiting.append((time.monotonic() + 0.05, target))  # its listener may not be up yet
            return
        target.update(state="refused" if code == errno.ECONNREFUSED else "error", error=os.strerror(code))
        self.open_targets -= 1

    def _on_connect(self, target, s):
        self.sel.unregister(s)
        code = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            s.close()
            return self._failed(target, code)
        local = s.getsockname()[0]
        target.update(local=local, iface=iface_of(local), ms=round((time.monotonic() - target["started"]) * 1000, 1),
                      greeted_at=time.monotonic(), buffer=b"")
        self.sel.register(s, selectors.EVENT_READ, ("greet", target, s))

    def _on_greet(self, target, s):
        try:
            data = s.recv(256)
        except OSError:
            data = b""
        target["buffer"] += data
        if data and b"\n" not in target["buffer"]:
            return
        self.sel.unregister(s)
        s.close()  # we close first: the listener's port keeps no TIME_WAIT
        line = target.pop("buffer").split(b"\n", 1)[0].decode("utf-8", "replace").split()
        expected = [GREETING, self.token, target["node"], str(target["port"])]
        target["state"] = "ok" if line == expected else "other"
        self.open_targets -= 1

    def _on_accept(self, entry, listener):
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        entry["accepted"] += 1
        try:
            conn.sendall(("%s %s %s %d\n" % (GREETING, self.token, self.node, entry["port"])).encode())
        except OSError:
            conn.close()
            return
        conn.setblocking(False)
        self.open_served += 1
        self.sel.register(conn, selectors.EVENT_READ, ("served", entry, conn))

    def _on_served(self, entry, conn):
        try:
            more = conn.recv(256)
        except OSError:
            more = b""
        if not more:  # the other side closed: now we may
            self.sel.unregister(conn)
            conn.close()
            self.open_served -= 1

    def _expire(self, now):
        for key in list(self.sel.get_map().values()):
            kind, target, sock = key.data
            if kind == "connect" and now - target["started"] > ATTEMPT_TIMEOUT:
                self.sel.unregister(sock)
                sock.close()
                target.update(state="timeout", error="no answer within %g s" % ATTEMPT_TIMEOUT)
                self.open_targets -= 1
            elif kind == "greet" and now - target["greeted_at"] > GREET_TIMEOUT:
                self.sel.unregister(sock)
                sock.close()
                target.pop("buffer", None)
                target["state"] = "other"
                self.open_targets -= 1


def _datagram(ip, port):
    """A UDP socket bound to (ip, port) as a ballot box binds it (no SO_REUSEADDR: it would share the port), or
    the OSError."""
    s = socket.socket(socket.AF_INET6 if ip and ":" in ip else socket.AF_INET, socket.SOCK_DGRAM)
    try:
        try:
            s.bind((ip or "", port))
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL or not ip:
                raise
            s.bind(("", port))
        return s
    except OSError:
        s.close()
        raise


def bind_test(ip, entry):
    """Whether the port is free here now (a listener, or for `udp` a datagram socket, opened and closed at once),
    and who holds it if not."""
    udp = bool(entry.get("udp"))
    try:
        (_datagram if udp else _listener)(ip, entry["port"]).close()
        entry["state"] = "ok"
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            entry.update(state="taken", owner=port_owner(entry["port"], udp))
        else:
            entry.update(state="error", error=e.strerror or str(e))


# -- the op ---------------------------------------------------------------------------


def _listened(entry):
    """A port this node was asked to hold, with what came of it, as the reply's type (contract/opreplies.py)."""
    owner = entry.get("owner")  # port_owner's {}: /proc does not show who holds it
    return Listened(port=entry["port"], what=entry["what"], setting=entry.get("setting"), expect=entry.get("expect"),
                    state=entry["state"], accepted=entry.get("accepted"), owner=Owner(**owner) if owner else None,
                    error=entry.get("error"))


def _reached(target):
    """A port of another node this node connected to, with what came of it (the exchange's own timings and
    buffer stay here)."""
    return Reached(node=target["node"], address=target["address"], port=target["port"], what=target["what"],
                   state=target["state"], attempts=target.get("attempts"), local=target.get("local"),
                   iface=target.get("iface"), ms=target.get("ms"), error=target.get("error"))


def run(payload):
    """Everything this node can tell about the job's network, in one call.

    payload: "node", "workspace" (set by the transport), "address" (this node's),
    "job_id" (a job whose own claims do not count), "peers" (the other nodes'
    addresses: routes), "listen" ([{"port", "what", "expect"}]: the ports this
    node will hold), "reach" ([{"node", "address", "port", "what"}]: the others'),
    "serve" (open real listeners and answer `expect` connections on each; else
    only see whether each port is free), "token", "deadline" (seconds),
    "window" ([lo, hi]: report which ports there are busy, for `auto`), "claims" (false: leave out
    other jobs' claimed ports, a read of every process's environment, for a node that holds none).
    Answers contract/opreplies.py's Netcheck.
    """
    workspace = os.path.abspath(os.path.expanduser(payload.get("workspace") or "."))
    ip = resolve(payload["address"])
    local = bool(ip) and is_local(ip)
    routes = {}
    for peer in payload.get("peers") or []:
        route_local, route_iface = route_to(peer)
        routes[peer] = Route(local=route_local, iface=route_iface)
    # A NAT address (a cloud VM's public IP): the interface the peers are reached by.
    iface = iface_of(ip) if local else next((r.iface for r in routes.values() if r.iface), None)

    listen = [dict(e) for e in payload.get("listen") or []]
    # Only a served check connects: a target not tried has nothing to say.
    reach = [dict(t) for t in payload.get("reach") or []] if payload.get("serve") else []
    if payload.get("serve"):
        exchange = Exchange(payload["node"], payload.get("token", ""), float(payload.get("deadline", 8)))
        for entry in listen:  # a UDP port is only bound (nobody connects to it)
            (bind_test if entry.get("udp") else exchange.listen)(ip if local else None, entry)
        for target in reach:
            exchange.reach(target)
        exchange.run()
        for s, _ in exchange.listeners:
            s.close()
    else:
        for entry in listen:
            bind_test(ip if local else None, entry)
    busy = busy_ports(*payload["window"]) if payload.get("window") else None
    claimed = claimed_ports(workspace, payload.get("job_id")) if payload.get("claims", True) else []
    return Netcheck(workspace=workspace, address_ip=ip, address_local=local, iface=iface,
                    speed=link_speed(iface) if iface else None, routes=routes, ephemeral=ephemeral_range(),
                    listen=[_listened(e) for e in listen], reach=[_reached(t) for t in reach], busy=busy,
                    claimed=[Claim(**c) for c in claimed]).wire()
