"""A raw HTTP/2 gRPC client (the `h2` library) that can do what well-behaved clients never do: open
streams and then withhold flow-control window (never read), or send bytes that are not a protobuf."""

from __future__ import annotations

import socket
import struct

import h2.config
import h2.connection
import h2.events
import h2.settings


class StallingClient:
    """One connection whose window for server data is zero: the server can send headers, never data."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0, h2.settings.SettingCodes.ENABLE_PUSH: 0})
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.events: list[h2.events.Event] = []

    def start_call(self, method: str, body: bytes) -> int:
        """Open a stream and send one gRPC message (5-byte prefix + body); returns the stream id."""
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream_id, [
            (":method", "POST"), (":scheme", "http"), (":path", method), (":authority", "localhost"),
            ("content-type", "application/grpc"), ("te", "trailers"),
        ])
        self.conn.send_data(stream_id, struct.pack(">?I", False, len(body)) + body, end_stream=True)
        self.sock.sendall(self.conn.data_to_send())
        return stream_id

    def pump(self, seconds: float = 0.2) -> list[h2.events.Event]:
        """Read what the server sent for up to `seconds` (acknowledging settings and pings, never
        opening the window); returns the new events."""
        self.sock.settimeout(seconds)
        new: list[h2.events.Event] = []
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                new += self.conn.receive_data(data)
                out = self.conn.data_to_send()
                if out:
                    self.sock.sendall(out)
        except (TimeoutError, socket.timeout):
            pass
        self.events += new
        return new

    @property
    def max_concurrent_streams(self) -> int:
        return self.conn.remote_settings.max_concurrent_streams

    def status_of(self, stream_id: int) -> dict[str, str] | None:
        """The trailers (or trailers-only headers) with grpc-status for a stream, once they came."""
        for event in self.events:
            headers = getattr(event, "headers", None)
            if getattr(event, "stream_id", None) == stream_id and headers:
                found = dict(headers)
                if "grpc-status" in found:
                    return found
        return None

    def reset_streams(self) -> set[int]:
        return {e.stream_id for e in self.events if isinstance(e, h2.events.StreamReset)}

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
