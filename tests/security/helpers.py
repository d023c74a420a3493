"""Shared helpers of the security tests: tenants files, raw HTTP calls, certificates."""

from __future__ import annotations

import datetime
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from prefixstore.protocol.wire import CONTENT_TYPE, decode_frame, encode_frame
from prefixstore.store.tenants import token_sha256

TOKENS = {"alpha": "tok-alpha-0123456789abcdef", "beta": "tok-beta-fedcba9876543210"}
ADMIN_TOKEN = "tok-admin-00112233445566778899"
CLUSTER_TOKEN = "tok-cluster-aabbccddeeff00112233"


def write_tenants(path: Path, quotas: dict[str, int] | None = None) -> Path:
    """A tenants file (TOML) for TOKENS, ADMIN_TOKEN and CLUSTER_TOKEN; only digests are written."""
    lines = [f'admin_token_sha256 = "{token_sha256(ADMIN_TOKEN)}"',
             f'cluster_token_sha256 = "{token_sha256(CLUSTER_TOKEN)}"']
    for name, token in TOKENS.items():
        lines += [f"[tenants.{name}]", f'token_sha256 = "{token_sha256(token)}"']
        if quotas and name in quotas:
            lines.append(f"quota_bytes = {quotas[name]}")
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Answer:
    status: int
    body: dict[str, Any]  # a decoded frame header or a JSON error: tests index into it freely


async def raw_post(url: str, path: str, header: dict[str, object], token: str | None) -> Answer:
    """POST a frame; the decoded frame header (200) or JSON error body (4xx)."""
    headers = {"Content-Type": CONTENT_TYPE}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, data=encode_frame(header), headers=headers) as resp:
            raw = await resp.read()
            if resp.status == 200 and resp.content_type == CONTENT_TYPE:
                return Answer(resp.status, decode_frame(raw)[0])
            return Answer(resp.status, json.loads(raw) if raw else {})


async def raw_get(url: str, path: str, token: str | None = None, method: str = "GET") -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    if method == "POST":
        headers["Content-Type"] = CONTENT_TYPE
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url + path, headers=headers) as resp:
            await resp.read()
            return resp.status


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # self-signed, not from the CA
    rogue_key: Path


def make_pki(directory: Path) -> Pki:
    """A test CA, a server certificate for 127.0.0.1/localhost, a client certificate, and a rogue self-signed one."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[Path, Path]:
        c, k = directory / f"{stem}.pem", directory / f"{stem}.key"
        c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()))
        return c, k

    def build(cn: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
              ca: bool) -> x509.Certificate:
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(issuer).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                              content_commitment=False, key_encipherment=False,
                                              data_encipherment=False, key_agreement=False,
                                              encipher_only=False, decipher_only=False), critical=True)
            b = b.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        else:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            b = b.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()),
                                critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = build("prefixstore test CA", ca_key, name("prefixstore test CA"), ca_key, ca=True)
    ca_path, _ = write("ca", ca_cert, ca_key)
    out = {}
    for stem in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        out[stem] = write(stem, build(f"prefixstore {stem}", key, ca_cert.subject, ca_key, ca=False), key)
    rogue_key = ec.generate_private_key(ec.SECP256R1())
    rogue = write("rogue", build("rogue", rogue_key, name("rogue"), rogue_key, ca=False), rogue_key)
    return Pki(ca=ca_path, server_cert=out["server"][0], server_key=out["server"][1],
               client_cert=out["client"][0], client_key=out["client"][1], rogue_cert=rogue[0], rogue_key=rogue[1])
