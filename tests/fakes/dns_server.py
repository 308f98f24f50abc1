"""A small authoritative DNS server for tests: A records from a dict you change while it runs (UDP, a thread).

Messages are parsed and built with dnspython (``dns.message``). A name absent from ``records`` answers
NXDOMAIN; a name mapped to ``[]`` answers NOERROR without records (a headless Service with no ready pod).
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType

import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

__all__ = ["DnsServer"]


class DnsServer:
    """``with DnsServer({"decode": ["127.0.0.3"]}) as dns: ...``; ``dns.address`` is ``"127.0.0.1:PORT"``."""

    def __init__(self, records: dict[str, list[str]] | None = None, host: str = "127.0.0.1") -> None:
        self._lock = threading.Lock()
        self._records = {k.rstrip("."): list(v) for k, v in (records or {}).items()}
        self.queries = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((host, 0))
        self._sock.settimeout(0.2)
        self.host, self.port = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-dns", daemon=True)

    @property
    def address(self) -> str:
        """``HOST:PORT``, the form ``PDCTL_DNS_SERVER`` takes."""
        return f"{self.host}:{self.port}"

    def set(self, name: str, addresses: list[str]) -> None:
        """Replace a name's A records."""
        with self._lock:
            self._records[name.rstrip(".")] = list(addresses)

    def __enter__(self) -> DnsServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                query = dns.message.from_wire(data)
            except Exception:  # a malformed packet: ignore it, as a server would
                continue
            self.queries += 1
            self._sock.sendto(self._answer(query).to_wire(), peer)

    def _answer(self, query: dns.message.Message) -> dns.message.Message:
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        question = query.question[0]
        name = question.name.to_text().rstrip(".")
        with self._lock:
            addresses = self._records.get(name)
        if addresses is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.A and addresses:
            response.answer.append(
                dns.rrset.from_text_list(question.name, 1, dns.rdataclass.IN, dns.rdatatype.A, addresses)
            )
        return response
