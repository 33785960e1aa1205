"""A loopback TCP proxy a test can partition: the network between two real processes.

Loopback cannot be partitioned per port without root (iptables, namespaces), so a test
puts this proxy between a client process and a server address and points the client at
it. `cut()` partitions it the way a network does: bytes in flight and new connections
are held, not refused (no RST, no FIN: the client sees silence and its own deadlines),
and `restore()` lets everything held through, as a partition that heals before TCP gives
up. `stop()` closes it all; every thread is a daemon bounded by the stop flag.
"""

from __future__ import annotations

import contextlib
import socket
import threading

# How long a blocked thread sleeps before it rechecks the stop flag.
_POLL_S = 0.1
_CHUNK_BYTES = 65536


class TcpProxy:
    """Forwards 127.0.0.1:<port> to `target` ("host:port") until stopped."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(_POLL_S)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._open = threading.Event()
        self._open.set()
        self._stopped = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    def cut(self) -> None:
        """Partitions: nothing passes in either direction until restore()."""
        self._open.clear()

    def restore(self) -> None:
        """Heals the partition: what was held goes through, new connections proceed."""
        self._open.set()

    def stop(self) -> None:
        """Closes the listener and every connection."""
        self._stopped.set()
        self._open.set()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in [self._listener, *sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _wait_open(self) -> bool:
        """Blocks while cut; False once stopped."""
        while not self._open.wait(_POLL_S):
            if self._stopped.is_set():
                return False
        return not self._stopped.is_set()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        with self._lock:
            self._sockets.append(client)
        if not self._wait_open():
            return
        try:
            upstream = socket.create_connection(self._target, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._sockets.append(upstream)
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        # Ends when either side closes or the proxy stops.
        while self._wait_open():
            try:
                data = source.recv(_CHUNK_BYTES)
            except OSError:
                data = b""
            if not data or not self._wait_open():
                break
            try:
                sink.sendall(data)
            except OSError:
                break
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
