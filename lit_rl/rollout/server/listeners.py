"""Who listens on a local TCP port, from the kernel's tables (Linux): a server lit-rl starts must hold the port it
was given before anything is sent there.

`free_port` finds a port nothing listens on, and the child binds it only once it is up (a vLLM server imports for
tens of seconds): another local user may bind the port first. The health poll, which carries `VLLM_API_KEY`, and
every request after it would then go to that process. `port_holder` tells the child's listener from another's.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import socket
import time
from pathlib import Path
from typing import Union

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]

LISTEN = "0A"  # the state of a listening socket in /proc/net/tcp
# The local addresses whose listeners receive a connection made to 127.0.0.1.
REACH_LOOPBACK = {ipaddress.ip_address(a) for a in ("127.0.0.1", "0.0.0.0", "::", "::ffff:127.0.0.1")}


def port_holder(port: int, session: int, scans: int = 3) -> str:
    """Who listens where a connection to 127.0.0.1:`port` lands: "none"; "session" (only processes of session
    `session`: a child started in a session of its own, `start_child`, and the processes it started); "other" (a
    process outside it, or one this user cannot see into, in `scans` scans 0.1 s apart: a socket the child's
    process had just opened may not be among its fds yet); "unknown" where the kernel's tables cannot be read, or
    do not list this process's own listeners (a sandbox's kernel)."""
    for scan in range(scans):
        inodes = _listening_inodes(port)
        if inodes is None:
            return "unknown"
        if not inodes:
            return "none" if _table_lists_listeners() else "unknown"
        if inodes <= _session_sockets(session):
            return "session"
        if scan + 1 < scans:
            time.sleep(0.1)
    return "other"


@functools.lru_cache(maxsize=1)
def _table_lists_listeners() -> bool:
    """Whether the kernel's table lists this process's own listener (a sandbox's kernel may list none): a socket
    listening on a free port of 127.0.0.1, looked up, closed. Asked once a process."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        probe.listen()
        return bool(_listening_inodes(probe.getsockname()[1]))


def listening_sockets(port: int) -> list[tuple[IPAddress, int]] | None:
    """(local address, inode) of each socket listening on `port`, as the kernel lists them (/proc/net/tcp, tcp6);
    None where the IPv4 table cannot be read (not Linux)."""
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            if table.endswith("6"):  # no IPv6 in this kernel
                continue
            return None
        for row in rows:
            fields = row.split()
            hex_address, hex_port = fields[1].split(":")
            if fields[3] != LISTEN or int(hex_port, 16) != port:
                continue
            words = bytes.fromhex(hex_address)  # 32-bit words in host order (little-endian on x86 and ARM)
            address = ipaddress.ip_address(b"".join(words[i : i + 4][::-1] for i in range(0, width, 4)))
            found.append((address, int(fields[9])))
    return found


def _listening_inodes(port: int) -> set[int] | None:
    """The inodes of the sockets listening on `port` at an address that receives 127.0.0.1's connections."""
    sockets = listening_sockets(port)
    return None if sockets is None else {inode for address, inode in sockets if address in REACH_LOOPBACK}


def _session_sockets(session: int) -> set[int]:
    """The inodes of the sockets open in the processes of `session` (this user's own: their fds are readable)."""
    sockets: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[3]) != session:  # after the command's name: state, ppid, pgrp, sid
                continue
            fds = list((entry / "fd").iterdir())
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not this user's
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:  # closed meanwhile (a busy server opens and closes fds all the time): the others count
                continue
            if link.startswith("socket:["):
                sockets.add(int(link[8:-1]))
    return sockets
