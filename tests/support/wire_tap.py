"""A TCP proxy that records every byte it forwards, both ways: what a listener on the
network between two processes would see."""
from __future__ import annotations

import socket
import threading


class WireTap:
    """Listens on 127.0.0.1 (a free port), connects each accepted connection to `target`
    (host, port) and copies bytes both ways, keeping a copy of all of them in `seen`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.listener.accept()
            except OSError:
                return  # closed
            b = socket.create_connection(self.target)
            self._socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._copy, args=(src, dst), daemon=True).start()

    def _copy(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def bytes_seen(self) -> bytes:
        with self._lock:
            return bytes(self.seen)

    def close(self) -> None:
        for s in self._socks:
            s.close()
