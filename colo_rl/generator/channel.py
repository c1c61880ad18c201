"""What both ends of the control socket share (stdlib only: the worker may run another Python)."""

from __future__ import annotations

import os
import socket
import struct
from contextlib import contextmanager
from multiprocessing.connection import Connection


@contextmanager
def read_deadline(conn: Connection, seconds: float):
    """A blocking read on `conn` fails (BlockingIOError) after `seconds` instead of waiting
    forever. SO_RCVTIMEO keeps the descriptor blocking, which Connection's reads need."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))  # socket options belong to the socket, not the fd
    try:
        whole = int(seconds)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("ll", whole, int((seconds - whole) * 1e6)))
        yield
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
    finally:
        sock.close()
