"""A real S3 API for tests: moto's server on a free loopback port, and fresh buckets in it."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

from prime_testkit.children import Children, free_port, wait_until

MOTO = Path(sys.executable).with_name("moto_server")
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class MotoS3:
    """`MotoS3(children)` starts the server (killed with the test); `.endpoint` is its URL,
    `.bucket()` makes a fresh bucket and returns its name, `.keys(bucket)` lists its objects."""

    def __init__(self, children: Children, timeout: float = 60.0):
        port = free_port()
        children.popen(
            [str(MOTO), "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.endpoint = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                self._client().list_buckets()
                return True
            except Exception:
                return False

        wait_until(up, timeout=timeout, what="moto S3 server")

    def _client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        )

    def bucket(self) -> str:
        name = f"b{uuid.uuid4().hex[:8]}"
        self._client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str) -> list[str]:
        pages = self._client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def delete(self, bucket: str, prefix: str) -> None:
        for key in self.keys(bucket):
            if key.startswith(prefix):
                self._client().delete_object(Bucket=bucket, Key=key)


class DeadS3:
    """An S3 endpoint that fails a node's uploads: `"hung"` accepts connections and never
    answers (a remote that stalls), `"refused"` is a free port nobody listens on (`hang()`
    makes it the first from then on). `.endpoint` is its URL; `close()` (or the `with`
    block's end) drops what it holds: refused again."""

    KINDS = ("hung", "refused")

    def __init__(self, kind: str):
        if kind not in self.KINDS:
            raise ValueError(f"DeadS3 kind {kind!r}: one of {', '.join(self.KINDS)}")
        self._held: list[socket.socket] = []
        self._server: socket.socket | None = None
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        if kind == "hung":
            self.hang()

    def hang(self) -> None:
        """Accept connections on its port from now on, and never answer them."""
        if self._server is not None:
            return
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._server.settimeout(0.5)
        threading.Thread(target=self._hold, args=(self._server,), daemon=True,
                         name="dead-s3").start()  # fmt: skip

    def _hold(self, server: socket.socket) -> None:
        while self._server is not None:
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            self._held.append(conn)  # never read from, never answered

    def close(self) -> None:
        server, self._server = self._server, None
        for s in [*self._held, *([server] if server else [])]:
            s.close()

    def __enter__(self) -> DeadS3:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
