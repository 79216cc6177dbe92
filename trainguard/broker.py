"""The local Apache Kafka (KRaft) behind ``trainguard broker start|stop|status``.

The jars are the real Apache Kafka broker, named by ``deploy/kafka/pom.xml`` and copied
by Maven once into a per-user cache (``$TRAINGUARD_HOME/kafka-<version>``, else
``~/.cache/trainguard/kafka-<version>``); later starts work offline from the cache.
One JVM runs a combined broker and controller on 127.0.0.1 with every replication
factor at 1, so consumer groups, Faust and transactions work on one node.

``--brokers N`` (:class:`LocalCluster`) runs N such combined broker+controller nodes instead,
one JVM each, on loopback ports (``--port``, ``--port``+1, ...; the controller ports are
chosen once and kept in ``cluster.json``): an N-voter controller quorum, every replication
factor ``min(N, 3)`` and ``min.insync.replicas`` 2 from three nodes, and fail-over tuned for a
local cluster (a dead node is fenced after ``broker.session.timeout.ms`` = 3 s, not Kafka's
9 s). See docs/OPERATIONS.md, "Three brokers".
"""
from __future__ import annotations

from .errors import UserError

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

HEAP = "512m"
#: a local broker (development, the demo, tests) compiles with C1 only: a start costs 2.6
#: CPU-s to ready instead of 4.6 (measured here), and it never carries a heavy load
JVM_OPTIONS = ("-XX:TieredStopAtLevel=1",)
CLUSTER_HEAP = "256m"  # per node of a --brokers N cluster
MAX_BROKERS = 9
START_TIMEOUT_S = 90.0
STOP_GRACE_S = 20.0


class BrokerError(UserError):
    """A one-line reason the broker cannot be fetched, started or stopped."""


def pom_path() -> Path:
    return Path(str(resources.files("trainguard.deploy") / "kafka" / "pom.xml"))


def kafka_version(pom: Path | None = None) -> str:
    text = (pom or pom_path()).read_text(encoding="utf-8")
    match = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", text)
    if not match:
        raise BrokerError(f"{pom or pom_path()} names no <kafka.version>")
    return match.group(1).strip()


def trainguard_home(environ=None) -> Path:
    environ = os.environ if environ is None else environ
    if environ.get("TRAINGUARD_HOME"):
        return Path(environ["TRAINGUARD_HOME"]).expanduser()
    cache = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "trainguard"


def java_major_version(java: str) -> int:
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BrokerError(f"cannot run {java}: {exc}; install Java 17 or newer") from None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not match:
        raise BrokerError(f"cannot tell the version of {java}; install Java 17 or newer")
    major = int(match.group(1))
    return int(match.group(2)) if major == 1 else major


def find_java() -> str:
    home = os.environ.get("JAVA_HOME")
    candidates = [str(Path(home) / "bin" / "java")] if home else []
    found = shutil.which("java")
    if found:
        candidates.append(found)
    for java in candidates:
        if Path(java).exists():
            major = java_major_version(java)
            if major < 17:
                raise BrokerError(f"Java {major} found at {java}; Kafka 4 needs Java 17 or newer "
                                  "(install openjdk-17-jre-headless or set JAVA_HOME)")
            return java
    raise BrokerError("Java not found; install Java 17 or newer (e.g. apt-get install "
                      "openjdk-17-jre-headless) or set JAVA_HOME")


@dataclass(kw_only=True)
class KafkaRuntime:
    """The cached jars of one Kafka version; :meth:`ensure` fetches them once with Maven."""

    home: Path
    pom: Path

    def __post_init__(self):
        self.version = kafka_version(self.pom)

    @property
    def libs(self) -> Path:
        return self.home / f"kafka-{self.version}" / "libs"

    @property
    def complete_marker(self) -> Path:
        return self.libs.parent / ".complete"

    def is_cached(self) -> bool:
        return self.complete_marker.exists()

    def ensure(self, log=None) -> Path:
        if self.is_cached():
            return self.libs
        mvn = shutil.which("mvn")
        if mvn is None:
            raise BrokerError(f"Kafka {self.version} is not cached in {self.libs.parent} and "
                              "Maven is not installed; install maven (apt-get install maven) "
                              "once, or copy a filled cache there")
        staging = self.libs.parent / f".staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        if log:
            log(f"fetching Apache Kafka {self.version} with Maven into {self.libs.parent} ...")
        cmd = [mvn, "-B", "-q", "-f", str(self.pom), "dependency:copy-dependencies",
               f"-DoutputDirectory={staging}", "-DincludeScope=runtime"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            tail = " | ".join((result.stdout + result.stderr).strip().splitlines()[-3:])
            raise BrokerError(f"Maven could not fetch Kafka {self.version}: {tail[-400:]}")
        shutil.rmtree(self.libs, ignore_errors=True)
        staging.rename(self.libs)
        self.complete_marker.write_text(f"kafka {self.version}\n")
        return self.libs


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def broker_answers(bootstrap: str, timeout: float = 3.0) -> bool:
    """True when a Kafka metadata request to ``bootstrap`` is answered with a broker."""
    from confluent_kafka.admin import AdminClient

    client = AdminClient({"bootstrap.servers": bootstrap, "socket.timeout.ms": int(timeout * 1000),
                          "log_level": 0, "logger": _QuietLogger()})
    try:
        return bool(client.list_topics(timeout=timeout).brokers)
    except Exception:  # any client-side failure means "does not answer"
        return False


class _QuietLogger:
    def log(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return self.log


SERVER_PROPERTIES = """\
# written by trainguard broker start; edit freely, it is kept across restarts
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{controller_port}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs={log_dirs}
num.partitions=1
default.replication.factor=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=true
log.retention.hours=72
"""

#: what a node of a ``--brokers N`` cluster adds to (and overrides in) SERVER_PROPERTIES
CLUSTER_PROPERTIES = """# node {node_id} of a {brokers}-node cluster: replicated topics, fast fail-over
node.id={node_id}
controller.quorum.voters={voters}
default.replication.factor={replication}
min.insync.replicas={min_isr}
offsets.topic.replication.factor={replication}
transaction.state.log.replication.factor={replication}
transaction.state.log.min.isr={min_isr}
share.coordinator.state.topic.replication.factor={replication}
share.coordinator.state.topic.min.isr={min_isr}
unclean.leader.election.enable=false
broker.heartbeat.interval.ms=500
broker.session.timeout.ms=3000
replica.lag.time.max.ms=10000
"""


def cluster_replication(brokers: int) -> tuple[int, int]:
    """``(replication factor, min.insync.replicas)`` of a cluster of ``brokers`` nodes:
    three copies where there are three brokers, of which two must have every write.

    >>> [cluster_replication(n) for n in (1, 2, 3, 5)]
    [(1, 1), (2, 1), (3, 2), (3, 2)]
    """
    replication = max(1, min(brokers, 3))
    return replication, 2 if replication >= 3 else 1

LOG4J2_YAML = """\
Configuration:
  Appenders:
    RollingFile:
      name: FILE
      fileName: "{log}"
      filePattern: "{log}.%i"
      PatternLayout:
        pattern: "[%d] %p %m (%c)%n"
      Policies:
        SizeBasedTriggeringPolicy:
          size: 20MB
      DefaultRolloverStrategy:
        max: 3
  Loggers:
    Root:
      level: INFO
      AppenderRef:
        - ref: FILE
    Logger:
      - name: kafka.request.logger
        level: WARN
"""


@dataclass(kw_only=True)
class LocalBroker:
    """One local broker: its port, data folder and pid file. Several run side by side.

    A node of a :class:`LocalCluster` also has its ``node_id``, the cluster's size, quorum
    (``voters``), id, and its own fixed ``controller_port``."""

    port: int = 9092
    data: Path
    runtime: KafkaRuntime
    heap: str = HEAP
    node_id: int = 1
    cluster_size: int = 1
    voters: str | None = None
    controller_port: int | None = None
    cluster_id: str | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.data / "broker.pid"

    @property
    def log_file(self) -> Path:
        return self.data / "server.log"

    @property
    def properties(self) -> Path:
        return self.data / "server.properties"

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        cmdline = Path(f"/proc/{pid}/cmdline")
        if cmdline.exists() and b"kafka.Kafka" not in cmdline.read_bytes():
            return None
        return pid

    def running(self) -> bool:
        return self.pid() is not None and broker_answers(self.bootstrap)

    def _write_config(self) -> None:
        if self.voters is not None:      # a cluster node: its ports are the cluster's
            if not self.properties.exists():
                self.properties.write_text(cluster_node_properties(
                    port=self.port, controller_port=self.controller_port,
                    log_dirs=self.data / "kraft-logs", node_id=self.node_id,
                    brokers=self.cluster_size, voters=self.voters))
            return
        controller_port = None
        if self.properties.exists():
            written = self.properties.read_text()
            match = re.search(r"CONTROLLER://127\.0\.0\.1:(\d+)", written)
            if match and not port_in_use(int(match.group(1))):
                if re.search(rf"PLAINTEXT://127\.0\.0\.1:{self.port}\b", written):
                    return                   # as written: its port and a free controller port
                controller_port = int(match.group(1))
        controller_port = controller_port or free_port()
        self.properties.write_text(SERVER_PROPERTIES.format(
            port=self.port, controller_port=controller_port, log_dirs=self.data / "kraft-logs"))

    def _format_storage(self, java: str, classpath: str) -> None:
        if (self.data / "kraft-logs" / "meta.properties").exists():
            return
        cluster_id = self.cluster_id or _kafka_cluster_id()
        cmd = [java, *JVM_OPTIONS, f"-Dlog4j2.configurationFile={self.data / 'log4j2.yaml'}",
               "-cp", classpath, "kafka.tools.StorageTool", "format", "-t", cluster_id,
               "-c", str(self.properties)]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            tail = " | ".join((result.stdout + result.stderr).strip().splitlines()[-3:])
            raise BrokerError(f"formatting KRaft storage in {self.data} failed: {tail[-300:]}")

    def start(self, log=print, timeout: float = START_TIMEOUT_S) -> str:
        """Start the broker and wait until it answers; returns a one-line status."""
        if self.pid() is not None and broker_answers(self.bootstrap, timeout=10):
            return f"broker already running on {self.bootstrap} (pid {self.pid()})"
        proc = self.launch(log=log)
        return self.wait_ready(proc, timeout)

    def launch(self, log=print) -> subprocess.Popen:
        """Start the JVM without waiting for it to answer (a cluster's nodes answer only once
        a quorum of them runs)."""
        for port, what in ((self.port, "port"), (self.controller_port, "controller port")):
            if port is not None and port_in_use(port):
                raise BrokerError(f"{what} {port} is already in use by another program; "
                                  "choose another with --port")
        java = find_java()
        libs = self.runtime.ensure(log=log)
        self.data.mkdir(parents=True, exist_ok=True)
        (self.data / "log4j2.yaml").write_text(LOG4J2_YAML.format(log=self.log_file))
        self._write_config()
        classpath = f"{libs}/*"
        self._format_storage(java, classpath)
        cmd = [java, f"-Xmx{self.heap}", f"-Xms{self.heap}", *JVM_OPTIONS, "-XX:+UseG1GC",
               "-XX:MaxGCPauseMillis=20",
               "-Djava.awt.headless=true",
               f"-Dlog4j2.configurationFile={self.data / 'log4j2.yaml'}",
               "-cp", classpath, "kafka.Kafka", str(self.properties)]
        with open(self.data / "kafka.out", "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=self.data,
                                    start_new_session=True)
        self.pid_file.write_text(f"{proc.pid}\n")
        return proc

    def wait_ready(self, proc: subprocess.Popen, timeout: float = START_TIMEOUT_S) -> str:
        """Wait until the launched broker answers; returns a one-line status."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise BrokerError(f"the broker exited during start (code {proc.returncode}); "
                                  f"last log lines: {self.last_log_lines()}")
            if broker_answers(self.bootstrap, timeout=2):
                return f"broker started on {self.bootstrap} (pid {proc.pid}, data {self.data})"
            time.sleep(0.3)
        proc.kill()
        self.pid_file.unlink(missing_ok=True)
        raise BrokerError(f"the broker did not answer within {timeout:.0f}s; "
                          f"last log lines: {self.last_log_lines()}")

    def stop(self, grace: float = STOP_GRACE_S) -> str:
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return f"no broker running for {self.data}"
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        forced = _alive(pid)
        if forced:
            os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.1)
        self.pid_file.unlink(missing_ok=True)
        return f"broker on {self.bootstrap} stopped" + (" (forcibly)" if forced else "")

    def kill(self) -> int | None:
        """SIGKILL the JVM, as a machine failure would (no clean shutdown); its pid."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
        return pid

    def last_log_lines(self, count: int = 5) -> str:
        lines = []
        for path in (self.data / "kafka.out", self.log_file):
            try:
                lines += path.read_text(errors="replace").strip().splitlines()[-count:]
            except OSError:
                pass
        return " | ".join(line.strip() for line in lines[-count:]) or "(no log)"


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


def _kafka_cluster_id() -> str:
    """A random Kafka cluster id: 22 url-safe base64 characters.

    Like Kafka's own ``Uuid.randomUuid``, never one that starts with '-': the storage
    tool's argument parser would read it as an option and fail (1 start in 64).
    """
    import base64

    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def recorded_port(data: str | Path | None) -> int | None:
    """The listener port a single broker's data folder was started with (its
    server.properties), None when there is none.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> recorded_port(folder)
    >>> _ = (folder / "server.properties").write_text(SERVER_PROPERTIES.format(
    ...     port=39411, controller_port=39412, log_dirs=folder))
    >>> recorded_port(folder)
    39411
    """
    if not data:
        return None
    try:
        text = (Path(data).expanduser() / "server.properties").read_text()
    except OSError:
        return None
    match = re.search(r"^listeners=PLAINTEXT://127\.0\.0\.1:(\d+)", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def local_broker(port: int = 9092, data: str | Path | None = None, environ=None) -> LocalBroker:
    home = trainguard_home(environ)
    runtime = KafkaRuntime(home=home, pom=pom_path())
    data_dir = Path(data).expanduser().resolve() if data else home / "brokers" / str(port)
    return LocalBroker(port=port, data=data_dir, runtime=runtime)



def cluster_node_properties(*, port: int, controller_port: int, log_dirs, node_id: int,
                            brokers: int, voters: str) -> str:
    """server.properties of one node of a ``brokers``-node cluster: SERVER_PROPERTIES with
    the keys of CLUSTER_PROPERTIES replaced."""
    replication, min_isr = cluster_replication(brokers)
    extra = CLUSTER_PROPERTIES.format(node_id=node_id, brokers=brokers, voters=voters,
                                      replication=replication, min_isr=min_isr)
    keys = {line.split("=", 1)[0] for line in extra.splitlines() if "=" in line}
    base = SERVER_PROPERTIES.format(port=port, controller_port=controller_port,
                                    log_dirs=log_dirs)
    kept = [line for line in base.splitlines() if line.split("=", 1)[0] not in keys]
    return "\n".join(kept) + "\n" + extra


CLUSTER_MANIFEST = "cluster.json"


def is_cluster_dir(data: Path) -> bool:
    return (Path(data) / CLUSTER_MANIFEST).exists()


@dataclass(kw_only=True)
class LocalCluster:
    """``brokers`` local nodes, each a combined broker and controller in its own JVM and
    ``data/node-<id>`` folder; the layout (ports, cluster id) is kept in
    ``data/cluster.json`` so that later starts, ``stop`` and ``status`` find the same nodes.

    ``start`` launches every node that is not running and waits until each answers and the
    cluster's metadata lists them all; ``node(i)`` is one :class:`LocalBroker`, to stop,
    :meth:`~LocalBroker.kill` or start again on its own."""

    data: Path
    runtime: KafkaRuntime
    brokers: int = 3
    ports: list[int] | None = None
    heap: str = CLUSTER_HEAP

    def __post_init__(self):
        if type(self.brokers) is not int or not 1 <= self.brokers <= MAX_BROKERS:
            raise BrokerError(f"--brokers must be 1 to {MAX_BROKERS}, got {self.brokers}")
        self.data = Path(self.data)
        layout = self._layout()
        if layout is not None:
            if layout["brokers"] != self.brokers:
                raise BrokerError(f"{self.data} holds a {layout['brokers']}-broker cluster; "
                                  f"use --brokers {layout['brokers']} or another --data")
            self.ports = layout["ports"]
            self._controller_ports = layout["controller_ports"]
            self._cluster_id = layout["cluster_id"]
        else:
            if (self.data / "server.properties").exists():
                raise BrokerError(f"{self.data} holds a single broker; give the cluster "
                                  "another --data folder")
            if self.ports is None:
                raise BrokerError(f"no cluster in {self.data}; start one with --brokers N")
            if len(self.ports) != self.brokers or len(set(self.ports)) != self.brokers:
                raise BrokerError(f"{self.brokers} brokers need {self.brokers} distinct ports, "
                                  f"got {self.ports}")
            self._controller_ports = None
            self._cluster_id = None

    def _layout(self) -> dict | None:
        import json

        try:
            layout = json.loads((self.data / CLUSTER_MANIFEST).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise BrokerError(f"cannot read {self.data / CLUSTER_MANIFEST}: {exc}") from None
        return layout

    def _save_layout(self) -> None:
        import json

        taken = set(self.ports)
        controllers = []
        while len(controllers) < self.brokers:
            port = free_port()
            if port not in taken:
                taken.add(port)
                controllers.append(port)
        self._controller_ports = controllers
        self._cluster_id = _kafka_cluster_id()
        self.data.mkdir(parents=True, exist_ok=True)
        layout = {"brokers": self.brokers, "ports": self.ports,
                  "controller_ports": controllers, "cluster_id": self._cluster_id}
        (self.data / CLUSTER_MANIFEST).write_text(json.dumps(layout, indent=2) + "\n")

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in self.ports)

    @property
    def nodes(self) -> list[LocalBroker]:
        if self._controller_ports is None:
            return [LocalBroker(port=port, data=self.data / f"node-{i + 1}", runtime=self.runtime,
                                heap=self.heap, node_id=i + 1, cluster_size=self.brokers)
                    for i, port in enumerate(self.ports)]
        voters = ",".join(f"{i + 1}@127.0.0.1:{port}"
                          for i, port in enumerate(self._controller_ports))
        return [LocalBroker(port=port, data=self.data / f"node-{i + 1}", runtime=self.runtime,
                            heap=self.heap, node_id=i + 1, cluster_size=self.brokers,
                            voters=voters, controller_port=self._controller_ports[i],
                            cluster_id=self._cluster_id)
                for i, port in enumerate(self.ports)]

    def node(self, node_id: int) -> LocalBroker:
        return self.nodes[node_id - 1]

    def answering(self, timeout: float = 3.0) -> list[int]:
        """Ids of the nodes the cluster's metadata lists (those registered and unfenced)."""
        from confluent_kafka.admin import AdminClient

        client = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0,
                              "socket.timeout.ms": int(timeout * 1000),
                              "logger": _QuietLogger()})
        try:
            return sorted(client.list_topics(timeout=timeout).brokers)
        except Exception:
            return []

    def running(self) -> bool:
        return (all(node.pid() is not None for node in self.nodes)
                and len(self.answering()) == self.brokers)

    def start(self, log=print, timeout: float = START_TIMEOUT_S) -> str:
        """Start the nodes that are not running; wait until all of them answer."""
        if self._controller_ports is None:
            self._save_layout()
        nodes = self.nodes
        if all(n.pid() is not None for n in nodes) and len(self.answering()) == self.brokers:
            return (f"{self.brokers} brokers already running on {self.bootstrap} "
                    f"(data {self.data})")
        self.runtime.ensure(log=log)
        launched = []
        try:
            for node in nodes:
                node.data.mkdir(parents=True, exist_ok=True)
                if node.pid() is None:
                    launched.append((node, node.launch(log=log)))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for node, proc in launched:
                    if proc.poll() is not None:
                        node.pid_file.unlink(missing_ok=True)
                        raise BrokerError(f"broker {node.node_id} exited during start (code "
                                          f"{proc.returncode}); last log lines: "
                                          f"{node.last_log_lines()}")
                if len(self.answering(timeout=2)) == self.brokers:
                    return (f"{self.brokers} brokers started on {self.bootstrap} "
                            f"(replication factor {cluster_replication(self.brokers)[0]}, "
                            f"min.insync.replicas {cluster_replication(self.brokers)[1]}, "
                            f"data {self.data})")
                time.sleep(0.3)
            raise BrokerError(f"the {self.brokers} brokers did not all answer within "
                              f"{timeout:.0f}s; last log lines: {nodes[0].last_log_lines()}")
        except BaseException:
            for node, _ in launched:
                node.stop(grace=5)
            raise

    def stop(self, grace: float = STOP_GRACE_S) -> str:
        """Stop every node: SIGTERM to all at once, SIGKILL to those left after ``grace``."""
        nodes = [n for n in self.nodes if n.pid() is not None]
        if not nodes:
            for n in self.nodes:
                n.pid_file.unlink(missing_ok=True)
            return f"no broker running for {self.data}"
        pids = {}
        for node in nodes:
            pid = node.pid()
            if pid is not None:
                pids[node.node_id] = pid
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(p) for p in pids.values()):
            time.sleep(0.2)
        forced = [p for p in pids.values() if _alive(p)]
        for pid in forced:
            os.kill(pid, signal.SIGKILL)
        for pid in forced:
            while _alive(pid):
                time.sleep(0.1)
        for node in self.nodes:
            node.pid_file.unlink(missing_ok=True)
        return (f"{len(pids)} brokers on {self.bootstrap} stopped"
                + (f" ({len(forced)} forcibly)" if forced else ""))

    def status(self) -> list[str]:
        listed = set(self.answering())
        lines = []
        for node in self.nodes:
            pid = node.pid()
            state = ("running" if node.node_id in listed and pid else
                     "started, not in the cluster's metadata" if pid else "stopped")
            lines.append(f"broker {node.node_id} on {node.bootstrap}: {state}"
                         + (f" (pid {pid})" if pid else ""))
        return lines


def local_cluster(port: int = 9092, brokers: int = 3, data: str | Path | None = None,
                  ports: list[int] | None = None, environ=None) -> LocalCluster:
    """A cluster of ``brokers`` nodes on ``ports`` (default ``port``, ``port``+1, ...) in
    ``data`` (default ``$TRAINGUARD_HOME/brokers/<port>-x<brokers>``)."""
    home = trainguard_home(environ)
    runtime = KafkaRuntime(home=home, pom=pom_path())
    data_dir = (Path(data).expanduser().resolve() if data
                else home / "brokers" / f"{port}-x{brokers}")
    return LocalCluster(data=data_dir, runtime=runtime, brokers=brokers,
                        ports=ports or [port + i for i in range(brokers)])
