"""Simulated nodes for the multi-node tests: network, mount and UTS
namespaces on this machine, joined by a bridge. Python standard library
only; needs root, ip(8), nsenter(1) and unshare(1).

    c = Cluster(3, workdir, private_dirs=[mountroot], private_size="256m").start()
    c.addr(i), c.name(i)           node i's address (10.213.R.(i+1)) and hostname
    c.run(i, argv, ...)            a command inside node i (nsenter -n -m -u)
    c.path(i, p)                   p as node i sees it, for the test's own file
                                   calls: /proc/<holder>/root<p>
    c.mounts(i, under)             node i's mounts under a path
    c.link(i, up)                  node i's cable, pulled (False) or plugged in
    c.kill_node(i)                 node i lost: its processes, holder, mounts gone
    c.destroy()                    everything gone: processes, mounts, namespaces

The layout, none of it in this machine's own network namespace:

  - a "switch": a network namespace holding the bridge br0;
  - per node i, a holder process (`sleep`, renamed to a marker) in a new
    network, mount and UTS namespace: a veth pair links its eth0, address
    10.213.R.(i+1)/24, to the port n<i> of br0; its hostname is the
    marker's node name. Commands enter its namespaces with nsenter, so
    mounts made on a node stay there across commands. The mount namespace
    is a slave of this machine's: paths outside the private directories
    (BACKING_DIR, the binaries) are the same on every node, as a shared
    filesystem would be, and unmounts on this machine reach the copies
    (no other test's FUSE mount is held alive by a node). Each of
    private_dirs gets a tmpfs of its own on every node (MOUNTROOT: a
    local directory per host; a node-local tier), of private_size (a
    limit: only what is written takes memory).

R is picked per run, different from the subnets of other live clusters
and from every address and route of this machine. The namespaces live as
long as their holders: destroy() kills every process in a node's network
namespace (the node's daemons, orted, mpirun) and then the holders, and
the kernel drops the namespaces, their links and their mounts. Holders
are named ckptfs-netns:OWNERPID:OWNERSTART:R:ROLE; clusters left by a
test run that died (its owner process is gone) are removed by the next
Cluster.start() (sweep_stale()).

Open MPI starts its daemons on the other nodes through netns-agent (next
to this file) as it would through ssh: `--mca plm_rsh_agent
tests/integration/ckpttest/netns-agent`, with CKPT_NETNS_MAP=<the map
file> in mpirun's environment (Cluster.env()). The worlds started on the
nodes by ckpt-mount, and their test case, are in networld.py.
"""

import ipaddress
import os
import shutil
import signal
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))
AGENT = os.path.join(HERE, "netns-agent")
MARK = "ckptfs-netns:"
SUBNET_BASE = "10.213"  # 10.213.R.0/24


class Unavailable(Exception):
    """The namespaces cannot be made here (a reason to skip)."""


# ---- processes ----------------------------------------------------------------

def _stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def start_time(pid):
    """The process's start time (clock ticks after boot), or None."""
    st = _stat(pid)
    return int(st[19]) if st else None


def alive(pid):
    """Running (a zombie has exited)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def netns_of(pid):
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def pids():
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def holders():
    """{pid: (owner pid, owner start, R, role)} of every cluster's holders."""
    out = {}
    for p in pids():
        argv = cmdline(p)
        if not argv or not argv[0].startswith(MARK.encode()):
            continue
        parts = argv[0].decode(errors="replace")[len(MARK):].split(":")
        if len(parts) != 4:
            continue
        try:
            out[p] = (int(parts[0]), int(parts[1]), int(parts[2]), parts[3])
        except ValueError:
            continue
    return out


def kill_namespace(ns, keep=()):
    """SIGKILL every process in network namespace ns (but keep), until none
    is left (mpirun and orted may start more meanwhile). Returns the pids."""
    killed = []
    for _ in range(50):
        left = [p for p in pids() if p not in keep and p != os.getpid()
                and netns_of(p) == ns and alive(p)]
        if not left:
            break
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
                killed.append(p)
            except OSError:
                pass
        time.sleep(0.05)
    return killed


def _owner_alive(owner, start):
    return alive(owner) and start_time(owner) == start


def sweep_stale():
    """Remove the clusters of test runs that died: every process in their
    namespaces, then their holders. Clusters of live runs stay."""
    removed = []
    hs = holders()
    for p, (owner, start, _, role) in hs.items():
        if _owner_alive(owner, start):
            continue
        ns = netns_of(p)
        if ns:
            kill_namespace(ns, keep=(p,))
        try:
            os.kill(p, signal.SIGKILL)
            removed.append(f"{role} (pid {p}, of pid {owner})")
        except OSError:
            pass
    return removed


# ---- the cluster --------------------------------------------------------------

def _used_nets():
    """The IPv4 networks of this machine's addresses and routes (not the
    default route)."""
    nets = []
    for argv in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        r = subprocess.run(argv, capture_output=True, text=True)
        for line in r.stdout.splitlines():
            for word in line.split():
                if "/" in word or (word[:1].isdigit() and word.count(".") == 3):
                    try:
                        nets.append(ipaddress.ip_network(word, strict=False))
                    except ValueError:
                        pass
    return [n for n in nets if n.prefixlen > 0]


class Cluster:
    """n simulated nodes (see the module's doc)."""

    def __init__(self, n, workdir, private_dirs=(), private_size="256m"):
        self.n = n
        self.workdir = workdir
        self.private_dirs = list(private_dirs)
        self.private_size = private_size
        self.dead = set()        # nodes killed by kill_node()
        self.me = (os.getpid(), start_time(os.getpid()))
        self.R = None
        self.switch = None       # holder pid of the switch
        self.node_pids = []      # holder pid of node i
        self._procs = []         # the holders' Popen objects
        self.map_file = os.path.join(workdir, "netns-map")
        self.log = []            # what start() ran, for messages

    # ---- naming
    def addr(self, i):
        return f"{SUBNET_BASE}.{self.R}.{i + 1}"

    @property
    def subnet(self):
        return f"{SUBNET_BASE}.{self.R}.0/24"

    def name(self, i):
        return f"ckpt-n{i}-{self.me[0]}"

    def port(self, i):
        return f"n{i}"

    def _marker(self, role):
        return f"{MARK}{self.me[0]}:{self.me[1]}:{self.R}:{role}"

    # ---- set-up
    def _pick_subnet(self):
        used = _used_nets()
        taken = {r for (_, _, r, _) in holders().values()}
        start = os.getpid() % 200 + 20
        for k in range(230):
            r = (start + k) % 230 + 20
            net = ipaddress.ip_network(f"{SUBNET_BASE}.{r}.0/24")
            if r in taken or any(net.overlaps(u) for u in used):
                continue
            return r
        raise Unavailable(f"no free subnet {SUBNET_BASE}.R.0/24 (R 20-249): all overlap "
                          f"this machine's addresses or routes or other clusters")

    def _holder(self, role, flags):
        marker = self._marker(role)
        argv = ["unshare", *flags, "--", "bash", "-c", 'exec -a "$0" sleep infinity', marker]
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, start_new_session=True)
        self._procs.append(p)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if p.poll() is not None:
                err = p.stderr.read().decode(errors="replace").strip()
                raise Unavailable(f"cannot make namespaces ({' '.join(argv[:-4])}): {err}")
            argv0 = cmdline(p.pid)
            if argv0 and argv0[0] == marker.encode():
                p.stderr.close()
                return p.pid
            time.sleep(0.01)
        raise Unavailable(f"the namespace holder {role} did not start in 10 s")

    def _ns_run(self, pid, flags, argv, what):
        # entering a mount namespace resets the root to the namespace's:
        # -r keeps the holder's (this test may run in a chroot)
        flags = [*flags, "-r", "--wd=/"] if "-m" in flags else list(flags)
        r = subprocess.run(["nsenter", "-t", str(pid), *flags, "--", *argv],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)
        self.log.append(f"{what}: {' '.join(argv)} -> {r.returncode}")
        if r.returncode != 0:
            raise Unavailable(f"{what}: `{' '.join(argv)}` failed: "
                              f"{(r.stderr or r.stdout).strip()}")
        return r

    def start(self):
        if os.geteuid() != 0:
            raise Unavailable("not root: network and mount namespaces need root")
        for tool in ("ip", "nsenter", "unshare", "bash", "sleep"):
            if not shutil.which(tool):
                raise Unavailable(f"no {tool} on PATH")
        sweep_stale()
        os.makedirs(self.workdir, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.destroy()
            raise
        return self

    def _start(self):
        self.R = self._pick_subnet()
        self.switch = self._holder("switch", ["--net", "--uts"])
        sw = ["-n"]
        self._ns_run(self.switch, sw, ["ip", "link", "add", "br0", "type", "bridge"], "switch")
        self._ns_run(self.switch, sw, ["ip", "link", "set", "br0", "up"], "switch")
        for i in range(self.n):
            pid = self._holder(f"n{i}", ["--net", "--mount", "--uts", "--propagation", "slave"])
            self.node_pids.append(pid)
            node = f"node {i}"
            self._ns_run(pid, ["-u"], ["hostname", self.name(i)], node)
            # No IPv6 on the nodes (no duplicate address detection, no
            # link-local addresses for Open MPI to consider). After an
            # outage TCP retransmits within a second, not after up to 2
            # minutes of backoff, where the kernel can be told
            # (net.ipv4.tcp_rto_max_ms, Linux 6.15). A connection with
            # data in flight then survives about tcp_retries2 seconds of
            # outage: raised to 255, the most allowed, first (at the
            # default maximum RTO, 15 retries last 15 minutes).
            sysctl = ("echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6 2>/dev/null; "
                      "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6 2>/dev/null; "
                      "f=/proc/sys/net/ipv4/tcp_rto_max_ms; "
                      "if [ -w $f ] && echo 255 > /proc/sys/net/ipv4/tcp_retries2; then "
                      "echo 1000 > $f; fi; exit 0")
            self._ns_run(pid, ["-n"], ["sh", "-c", sysctl], node)
            self._ns_run(self.switch, sw, ["ip", "link", "add", self.port(i), "type", "veth",
                                           "peer", "name", "eth0", "netns", str(pid)], node)
            self._ns_run(self.switch, sw, ["ip", "link", "set", self.port(i), "master", "br0",
                                           "up"], node)
            self._ns_run(pid, ["-n"], ["ip", "link", "set", "lo", "up"], node)
            self._ns_run(pid, ["-n"], ["ip", "addr", "add", f"{self.addr(i)}/24", "dev", "eth0"],
                         node)
            self._ns_run(pid, ["-n"], ["ip", "link", "set", "eth0", "up"], node)
            for d in self.private_dirs:
                os.makedirs(d, exist_ok=True)
                self._ns_run(pid, ["-m"], ["mount", "-t", "tmpfs", "-o",
                                           f"mode=0755,size={self.private_size}",
                                           f"ckptfs-netns-n{i}", d], node)
        self._write_map()
        self.check_links()

    def _write_map(self):
        with open(self.map_file + ".tmp", "w") as f:
            for i in range(self.n):
                if i not in self.dead:
                    f.write(f"{self.addr(i)} {self.node_pids[i]} {self.name(i)}\n")
        os.replace(self.map_file + ".tmp", self.map_file)

    def check_links(self, timeout=10):
        """Every node reaches every other: a TCP connect to a closed port is
        refused (reachable) rather than timing out."""
        probe = ("import socket, sys\n"
                 "bad = []\n"
                 "for a in sys.argv[1:]:\n"
                 "    try:\n"
                 f"        socket.create_connection((a, 9), timeout={timeout}).close()\n"
                 "    except ConnectionRefusedError:\n"
                 "        pass\n"
                 "    except OSError as e:\n"
                 "        bad.append(f'{a}: {e}')\n"
                 "print('; '.join(bad)); sys.exit(1 if bad else 0)\n")
        py = shutil.which("python3") or "python3"
        for i in range(self.n):
            others = [self.addr(k) for k in range(self.n) if k != i]
            r = self.run(i, [py, "-c", probe, *others], timeout=timeout * self.n + 10)
            if r.returncode != 0:
                raise Unavailable(f"node {i} cannot reach the others: {r.stdout.strip()} "
                                  f"{r.stderr.strip()}")

    # ---- use
    def nsenter(self, i):
        return ["nsenter", "-t", str(self.node_pids[i]), "-n", "-m", "-u", "-r", "--wd=/", "--"]

    def run(self, i, argv, **kw):
        """subprocess.run of argv inside node i (its network, mount and UTS
        namespaces); capture_output and text unless told otherwise."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(self.nsenter(i) + list(argv), **kw)

    def popen(self, i, argv, **kw):
        return subprocess.Popen(self.nsenter(i) + list(argv), **kw)

    def path(self, i, p):
        """Path p as node i sees it (its mounts), for this process's own
        file calls."""
        return f"/proc/{self.node_pids[i]}/root" + os.path.abspath(p)

    def mounts(self, i, under, fstype=None):
        """[(mount point, fstype)] of node i's mount namespace under path
        `under` (not `under` itself); none on a killed node."""
        under = os.path.abspath(under).rstrip("/") + "/"
        out = []
        if i in self.dead:
            return out
        with open(f"/proc/{self.node_pids[i]}/mountinfo") as f:
            for line in f:
                w = line.split()
                mp = w[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
                fs = w[w.index("-") + 1]
                if mp.startswith(under) and (fstype is None or fs == fstype):
                    out.append((mp, fs))
        return out

    def processes(self, i):
        """Pids of the processes in node i (its network namespace), the
        holder not included; none on a killed node."""
        ns = netns_of(self.node_pids[i])
        if ns is None:
            return []
        return [p for p in pids() if p != self.node_pids[i] and netns_of(p) == ns]

    def node_of_pid(self, pid):
        ns = netns_of(pid)
        for i, h in enumerate(self.node_pids):
            if netns_of(h) == ns:
                return i
        return None

    def kill_node(self, i):
        """Node i lost: SIGKILL of every process in it (its daemons, orted,
        mpirun), then of its holder; the kernel drops its namespaces, so
        its private tmpfs dirs and their files go too. The other nodes run
        on (Open MPI may end a world that had ranks on node i). Node i is
        left out of the agent's map; mounts() and processes() show nothing
        of it."""
        h = self.node_pids[i]
        ns = netns_of(h)
        if ns:
            kill_namespace(ns, keep=(h,))
        p = next(p for p in self._procs if p.pid == h)
        p.kill()
        p.wait(10)
        if p.stderr and not p.stderr.closed:
            p.stderr.close()
        self.dead.add(i)
        self._write_map()
        # the namespace (and with it the tmpfs) is gone once no process
        # holds it: every one killed above, the holder reaped
        deadline = time.monotonic() + 10
        while any(netns_of(q) == ns for q in pids()) and time.monotonic() < deadline:
            time.sleep(0.02)

    def link(self, i, up):
        """Plug node i's cable into the switch (up) or pull it: its port on
        the bridge goes down, its own eth0 loses the carrier."""
        r = subprocess.run(["nsenter", "-t", str(self.switch), "-n", "--", "ip", "link", "set",
                            self.port(i), "up" if up else "down"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"ip link set {self.port(i)} {'up' if up else 'down'}: {r.stderr}")

    def tcp_queues(self, i):
        """[(local, peer, send-q)] of node i's TCP connections to the other
        nodes."""
        r = self.run(i, ["ss", "-Htn"])
        out = []
        prefix = f"{SUBNET_BASE}.{self.R}."
        for line in r.stdout.splitlines():
            w = line.split()
            if len(w) >= 5 and w[4].startswith(prefix) and w[3].startswith(prefix):
                out.append((w[3], w[4], int(w[2])))
        return out

    def wait_tcp_drained(self, timeout=180):
        """Wait until every TCP connection between the nodes has delivered
        what it held (send queues empty): after an outage, what was sent
        meanwhile has arrived. Returns the seconds waited."""
        t0 = time.monotonic()
        while True:
            full = [(i, q) for i in range(self.n) if i not in self.dead
                    for q in self.tcp_queues(i) if q[2] > 0]
            if not full:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"TCP send queues still full after {timeout}s: {full}")
            time.sleep(0.05)

    def env(self, base=None):
        """The environment for mpirun (and the scripts that run it): the
        agent's map file."""
        env = dict(os.environ if base is None else base)
        env["CKPT_NETNS_MAP"] = self.map_file
        return env

    def hostfile(self, path, slots):
        """An Open MPI hostfile: node i's address with slots[i] slots (nodes
        with 0 slots are left out). Returns path."""
        with open(path, "w") as f:
            for i, s in enumerate(slots):
                if s:
                    f.write(f"{self.addr(i)} slots={s}\n")
        return path

    def mpi_args(self):
        """mpirun arguments for a world across the nodes."""
        return ["--mca", "plm_rsh_agent", AGENT,
                "--mca", "plm_rsh_no_tree_spawn", "1",
                "--mca", "oob_tcp_if_include", self.subnet,
                "--mca", "btl_tcp_if_include", self.subnet,
                "--mca", "btl", "tcp,self",
                "--mca", "pml", "ob1"]

    # ---- tear-down
    def destroy(self):
        """Kill every process in the nodes (daemons, orted, mpirun), then the
        holders: the kernel removes the namespaces with their links and
        mounts. Safe to call twice."""
        for i, h in enumerate(self.node_pids):
            ns = netns_of(h)
            if ns and alive(h):
                kill_namespace(ns, keep=(h,))
        for p in self._procs:
            if p.poll() is None:
                try:
                    p.kill()
                except OSError:
                    pass
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
            if p.stderr and not p.stderr.closed:
                p.stderr.close()
        self._procs = []
        self.node_pids = []
        self.dead = set()
        self.switch = None
        try:
            os.unlink(self.map_file)
        except OSError:
            pass


# ---- the network's limit ------------------------------------------------------

_RECV = r"""
import os, socket, sys, time
port, n, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[4], port)); s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
buf = bytearray(8 << 20); got = 0
while got < n:
    k = c.recv_into(buf)
    if not k:
        break
    os.write(fd, memoryview(buf)[:k]); got += k
os.fsync(fd); os.close(fd); os.unlink(path)
print(time.time(), got, flush=True)
"""

_SEND = r"""
import os, socket, sys, time
addr, port, n, at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
data = os.urandom(n)
c = socket.create_connection((addr, port))
time.sleep(max(0.0, at - time.time()))
c.sendall(data); c.close()
"""


def tcp_copy_time(cluster, pairs, nbytes, dest_dir, port=47000):
    """What the network between the nodes allows a partner copy: for each
    (sender node, receiver node) in pairs, at once, nbytes sent over one TCP
    connection and written and fsynced by the receiver into dest_dir (as
    that node sees it; a tier). Seconds from the common start to the last
    receiver's fsync."""
    py = shutil.which("python3") or "python3"
    recv, send = [], []
    try:
        for k, (a, b) in enumerate(pairs):
            p = cluster.popen(b, [py, "-c", _RECV, str(port + k), str(nbytes),
                                  os.path.join(dest_dir, f".tcp-copy-{k}"), cluster.addr(b)],
                              stdout=subprocess.PIPE, text=True)
            recv.append(p)
        for p in recv:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a receiver did not start")
        at = time.time() + 1.0
        for k, (a, b) in enumerate(pairs):
            send.append(cluster.popen(a, [py, "-c", _SEND, cluster.addr(b), str(port + k),
                                          str(nbytes), repr(at)]))
        ends = []
        for p in recv:
            end, got = p.stdout.readline().split()
            if int(got) != nbytes:
                raise RuntimeError(f"a receiver got {got} of {nbytes} bytes")
            ends.append(float(end))
        return max(ends) - at
    finally:
        for p in recv + send:
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout:
                p.stdout.close()
