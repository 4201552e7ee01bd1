"""Real gRPC servers for tests: an `InferenceServer` on a free loopback port, and a throwaway certificate."""

from __future__ import annotations

import asyncio
import threading

from serving.server import InferenceServer, ServeConfig


class RunningServer:
    """A real server on a free loopback port, its asyncio loop in a background thread."""

    def __init__(self, llm, **settings):
        self.loop = asyncio.new_event_loop()
        self.server = InferenceServer(ServeConfig(port=0, metrics_port=0, **settings), llm=llm)
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.port = self.call(self.server.start())
        self.target = f"127.0.0.1:{self.port}"

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=120)

    def close(self):
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


def self_signed(tmp_path) -> tuple[str, str, bytes]:
    """A throwaway certificate for 127.0.0.1 and its key, written as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "jaxinfer-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_path, cert_path = tmp_path / "key.pem", tmp_path / "cert.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert_pem)
    return str(cert_path), str(key_path), cert_pem
