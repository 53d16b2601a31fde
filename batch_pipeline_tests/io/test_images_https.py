"""Images from an allowed https:// host, fetched over real TLS (io/images.py).

A local HTTPS server (Python's http.server in a thread, wrapped in TLS) with a certificate made for
this test by `openssl` for `localhost`; the pipeline trusts it through `SSL_CERT_FILE`, as an
operator points it at a private CA. Covered: an image fetched over HTTPS decodes to the same pixels
as the same bytes in a data: URL; the certificate is verified (not trusted: the line's error); a
redirect is not followed (it could lead off the allowed hosts); a 404 and an image over
MAX_IMAGE_BYTES are the line's errors, naming the host. No engine: what the model does with a
decoded image is the same for every source (test_images_pipeline.py).
"""

from __future__ import annotations

import http.server
import re
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from batch_pipeline.io import images
from batch_pipeline.io.images import ImageError, ImageRef, ImageSettings
from batch_pipeline_tests.support.image_data import data_url, png

WHERE = "body.messages[0].content[1].image_url"
PICTURE = png("teal", (33, 21))
BIG = png("white", (400, 400), fmt="BMP")  # uncompressed: ~480 kB


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/redirect.png":
            self.send_response(302)
            self.send_header("Location", "https://elsewhere.example/a.png")
            self.end_headers()
            return
        body = {"/a.png": PICTURE, "/big.bmp": BIG}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate can be made for the HTTPS server")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], cert
    server.shutdown()
    server.server_close()


def load(url: str, settings: ImageSettings):
    return images.load_image(ImageRef(WHERE, url), settings)


def test_an_allowed_https_host_serves_the_image_over_verified_tls(tls_server, monkeypatch):
    port, cert = tls_server
    allowed = ImageSettings(allowed_hosts=("localhost",), timeout_seconds=5)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the operator's CA: here, the server's own certificate
    fetched = load(f"https://localhost:{port}/a.png", allowed)
    same = images.decode(ImageRef(WHERE, "data:"), images.fetch_bytes(ImageRef(WHERE, data_url(PICTURE)), allowed),
                         allowed)
    assert fetched.size == (33, 21) and fetched.tobytes() == same.tobytes()

    with pytest.raises(ImageError, match=re.escape(WHERE) + r": could not fetch the image from localhost: HTTP 404"):
        load(f"https://localhost:{port}/missing.png", allowed)
    with pytest.raises(ImageError, match=r"could not fetch the image from localhost: HTTP 302"):
        load(f"https://localhost:{port}/redirect.png", allowed)  # not followed off the allowed host
    with pytest.raises(ImageError, match=r"larger than MAX_IMAGE_BYTES=100000"):
        load(f"https://localhost:{port}/big.bmp", ImageSettings(allowed_hosts=("localhost",), max_image_bytes=100_000))


def test_a_certificate_nobody_vouches_for_is_the_lines_error(tls_server, monkeypatch):
    port, _cert = tls_server
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)  # the system's CAs only: they never signed it
    with pytest.raises(ImageError, match=r"could not fetch the image from localhost: .*CERTIFICATE_VERIFY_FAILED"):
        load(f"https://localhost:{port}/a.png", ImageSettings(allowed_hosts=("localhost",), timeout_seconds=5))


def test_a_warm_engines_lines_carry_their_images_inline(tls_server, monkeypatch):
    """What a warm engine is sent (engine/remote.py): each image part's URL a data: URL of the bytes
    fetched and checked here, so the server fetches nothing; a data: URL goes as it is."""
    port, cert = tls_server
    allowed = ImageSettings(allowed_hosts=("localhost",), timeout_seconds=5)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    chat = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": f"https://localhost:{port}/a.png", "detail": "low"}},
        {"type": "image_url", "image_url": data_url(png("red"))}]}]}
    sent = images.inline_images("/v1/chat/completions", chat, allowed)
    first, second = sent["messages"][0]["content"][1:]
    assert first["image_url"] == {"url": data_url(PICTURE), "detail": "low"}
    assert second["image_url"] == {"url": data_url(png("red"))}
    assert chat["messages"][0]["content"][1]["image_url"]["url"].startswith("https://")  # the line itself unchanged
    responses = {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": f"https://localhost:{port}/a.png"}]}]}
    assert images.inline_images("/v1/responses", responses, allowed)["input"][0]["content"][0]["image_url"] == data_url(PICTURE)
    with pytest.raises(ImageError, match=r"body.messages\[0\].content\[1\].image_url: could not fetch the image from "
                                         r"localhost: HTTP 404"):
        images.inline_images("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "?"}, {"type": "image_url", "image_url": {"url": f"https://localhost:{port}/missing.png"}}]}]},
            allowed)
