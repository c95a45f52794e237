"""The control plane's own certificate authority (issue 26): ``qlagent tls ca create`` makes a
CA key and certificate, ``qlagent tls cert create --server`` a replica's key and certificate
with its subjectAltNames signed by that CA, and ``not_after`` reads a certificate's expiry for
``config check`` and ``doctor``. Keys are ECDSA P-256; certificates X.509 v3 with the
constraints a TLS client checks (CA: ``basicConstraints CA:TRUE, pathlen 0``, keyCertSign;
server: ``CA:FALSE``, digitalSignature, ``extendedKeyUsage serverAuth``).

Uses ``cryptography``: on the control-plane side only (the CLI imports this module inside the
command), never on a router. Files are written whole or not at all: every output is checked
first, each is written to a temporary file in its directory (key 0600, certificate 0644) and
renamed into place."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re

from ..core.errors import ConflictError, ValidationError

CA_CERT = "qlagent-ca.pem"
CA_KEY = "qlagent-ca-key.pem"
SERVER_CERT = "qlagent-server.pem"
SERVER_KEY = "qlagent-server-key.pem"
MAX_CA_DAYS = 3650          # ten years
MAX_CERT_DAYS = 825         # what browsers and most TLS stacks still accept for a server certificate
MAX_NAMES = 32
MAX_COMMON_NAME = 64        # X.509's upper bound for a commonName (RFC 5280, ub-common-name)
MAX_DNS_NAME = 253          # RFC 1035 §2.3.4, in its dotted text form
MAX_DNS_LABEL = 63
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", re.IGNORECASE)


def check_days(days: int, most: int) -> int:
    """``days`` when 1..``most``; ValidationError naming ``--days`` otherwise."""
    if not 1 <= days <= most:
        raise ValidationError("--days", f"{days} is outside 1..{most}", limit=f"1..{most}")
    return days


def check_common_name(name: str) -> str:
    """``name`` when it is 1..64 characters without control characters; ValidationError naming
    ``--common-name`` otherwise (``cryptography`` would refuse it only while signing)."""
    if not 1 <= len(name) <= MAX_COMMON_NAME:
        raise ValidationError("--common-name", f"{len(name)} characters is outside 1..{MAX_COMMON_NAME}",
                              limit=f"1..{MAX_COMMON_NAME}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise ValidationError("--common-name", "a control character is not allowed")
    return name


def check_dns_name(name: str) -> str:
    """``name`` when it is a DNS name a certificate can carry: ASCII letters, digits and hyphens
    in dot-separated labels (1..63 characters, no hyphen at either end), 1..253 characters, one
    leading ``*.`` allowed, its last label not all digits (that is an IP address, RFC 3696 §2).
    ValidationError naming ``--name`` with the limit broken (an internationalized name: with its
    ``xn--`` form to give instead)."""
    if not name.isascii():
        try:
            ace = name.encode("idna").decode("ascii")
        except UnicodeError:
            ace = None
        hint = f"give its xn-- form {ace!r}" if ace else "give its xn-- (IDNA) form"
        raise ValidationError("--name", f"{name!r}: a certificate carries a DNS name in ASCII: {hint}")
    if len(name) > MAX_DNS_NAME:
        raise ValidationError("--name", f"{name[:20]!r}…: {len(name)} characters; a DNS name has at most "
                                        f"{MAX_DNS_NAME}", limit=MAX_DNS_NAME)
    labels = name.split(".")
    if labels[0] == "*" and len(labels) > 1:
        labels = labels[1:]
    for label in labels:
        if len(label) > MAX_DNS_LABEL:
            raise ValidationError("--name", f"{name!r}: the label {label[:20]!r}… has {len(label)} characters; a "
                                            f"DNS label has at most {MAX_DNS_LABEL}", limit=MAX_DNS_LABEL)
        if not _LABEL.fullmatch(label):
            raise ValidationError("--name", f"{name!r} is neither an IP address nor a DNS name (labels of letters, "
                                            "digits and inner hyphens, separated by dots)")
    if labels[-1].isdigit():
        raise ValidationError("--name", f"{name!r} is not an IP address (four numbers 0..255 without leading "
                                        "zeros) and a DNS name's last label cannot be all digits")
    return name


def parse_names(text: str) -> list[str]:
    """``HOST[,HOST…]`` → the subjectAltNames as ``DNS:name`` / ``IP:address`` (1..32, no
    repeats; a DNS name by ``check_dns_name``). Raises ValidationError naming ``--name`` and the
    entry."""
    out: list[str] = []
    for raw in text.split(","):
        name = raw.strip()
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            entry = f"DNS:{check_dns_name(name).lower()}"
        else:
            if getattr(address, "scope_id", None):
                # An IP subjectAltName is the bare 16 bytes: a certificate cannot carry the scope.
                raise ValidationError("--name", f"{name!r}: a scoped address cannot be a certificate name (give "
                                                f"{name.partition('%')[0]})")
            entry = f"IP:{address}"
        if entry in out:
            raise ValidationError("--name", f"{name!r} is given twice")
        out.append(entry)
    if len(out) > MAX_NAMES:
        raise ValidationError("--name", f"{len(out)} names", limit=MAX_NAMES)
    return out


def _refuse_existing(paths: list[str], force: bool) -> None:
    for p in paths:
        if not os.path.isdir(os.path.dirname(p) or "."):
            raise ValidationError("--dir", f"{os.path.dirname(p)}: no such directory")
        if os.path.lexists(p) and not force:
            raise ConflictError(f"{p} exists; --force replaces it", field="--dir", code="file_exists")


def _write_all(files: list[tuple[str, bytes, int]], key_owner: tuple[int, int] | None = None) -> None:
    """Each (path, data, mode) to a temporary file beside it, then every rename: a failure
    before the renames leaves no file. ``key_owner`` (uid, gid) gets the first file (the key)."""
    temps: list[tuple[str, str]] = []
    try:
        for i, (path, data, mode) in enumerate(files):
            tmp = f"{path}.tmp{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            temps.append((tmp, path))
            try:
                os.fchmod(fd, mode)         # the umask does not decide a key's mode
                if i == 0 and key_owner is not None and key_owner[0] != os.geteuid():
                    os.fchown(fd, *key_owner)
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        for tmp, path in temps:
            os.replace(tmp, path)
    except BaseException:
        for tmp, _ in temps:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def create_ca(directory: str, days: int, common_name: str = "qlagent CA", force: bool = False) -> tuple[str, str]:
    """A new CA in ``directory``: (certificate path ``qlagent-ca.pem`` 0644, key path
    ``qlagent-ca-key.pem`` 0600), valid from now for ``days`` (1..3650). Raises ValidationError
    (``--days``, ``--dir``) or ConflictError ``file_exists`` when a file is there and not
    ``force``; nothing is written then."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    check_days(days, MAX_CA_DAYS)
    check_common_name(common_name)
    cert_path, key_path = os.path.join(directory, CA_CERT), os.path.join(directory, CA_KEY)
    _refuse_existing([cert_path, key_path], force)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256()))
    from cryptography.hazmat.primitives import serialization
    _write_all([(key_path, _key_pem(key), 0o600), (cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)])
    return cert_path, key_path


def _load_ca(ca_cert: str, ca_key: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    try:
        with open(ca_cert, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
    except FileNotFoundError:
        raise ValidationError("--ca", f"{ca_cert}: no such file (make one with `qlagent tls ca create`)") from None
    except (OSError, ValueError) as e:
        raise ValidationError("--ca", f"{ca_cert}: not a PEM certificate ({type(e).__name__})") from None
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        bc = None
    if bc is None or not bc.ca:
        raise ValidationError("--ca", f"{ca_cert}: not a CA certificate (basicConstraints CA:TRUE)")
    try:
        with open(ca_key, "rb") as f:
            key = serialization.load_pem_private_key(f.read(), password=None)
    except FileNotFoundError:
        raise ValidationError("--ca-key", f"{ca_key}: no such file (it is made with the CA certificate)") from None
    except (OSError, ValueError, TypeError) as e:
        raise ValidationError("--ca-key", f"{ca_key}: not an unencrypted PEM private key ({type(e).__name__})") from None
    if key.public_key().public_numbers() != cert.public_key().public_numbers():
        raise ValidationError("--ca-key", f"{ca_key}: not the key of {ca_cert}")
    return cert, key


def create_server_cert(directory: str, names: list[str], ca_cert: str, ca_key: str, days: int,
                       force: bool = False, key_owner: tuple[int, int] | None = None) -> tuple[str, str]:
    """A replica's key and certificate in ``directory``: (``qlagent-server.pem`` 0644,
    ``qlagent-server-key.pem`` 0600, owned by ``key_owner`` (uid, gid) when given: the service's
    user reads it) with ``names`` (``parse_names``) as subjectAltNames, signed by the CA
    (``ca_cert``, ``ca_key``), valid for ``days`` (1..825) but never past the CA.
    Raises ValidationError naming ``--days``, ``--ca``, ``--ca-key`` or ``--dir``, ConflictError
    ``file_exists``; nothing is written then."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    check_days(days, MAX_CERT_DAYS)
    cert_path, key_path = os.path.join(directory, SERVER_CERT), os.path.join(directory, SERVER_KEY)
    ca, signer = _load_ca(ca_cert, ca_key)
    _refuse_existing([cert_path, key_path], force)
    now = _now()
    ca_end = ca.not_valid_after_utc
    if ca_end <= now:
        raise ValidationError("--ca", f"{ca_cert}: expired at {ca_end:%Y-%m-%dT%H:%M:%SZ}")
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.IPAddress(ipaddress.ip_address(v)) if k == "IP" else x509.DNSName(v)
            for k, _, v in (n.partition(":") for n in names)]
    # The subject CN is only a label (clients verify the subjectAltNames): the first name that
    # fits a commonName's 64 characters, else a fixed one, so a 253-character name is accepted.
    cn = next((v for v in (n.partition(":")[2] for n in names) if len(v) <= MAX_COMMON_NAME), "qlagent replica")
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(min(now + dt.timedelta(days=days), ca_end))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), critical=False)
            .sign(signer, hashes.SHA256()))
    _write_all([(key_path, _key_pem(key), 0o600), (cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)],
               key_owner)
    return cert_path, key_path


def not_after(cert_file: str) -> int:
    """When the first certificate in the PEM ``cert_file`` expires (Unix seconds). Raises
    OSError or ValueError when it cannot be read or parsed."""
    from cryptography import x509
    with open(cert_file, "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    return int(cert.not_valid_after_utc.timestamp())
