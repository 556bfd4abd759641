"""TLS for the gRPC servers (scheduler, worker) and their clients: flags, credentials from PEM files, channels.

Without a certificate everything stays plaintext, as before. Start-up checks of the flags and the files live in
scheduler_svc/validation.py (check_server_tls, check_channel_tls) so that a bad combination fails at once.
"""

from __future__ import annotations

import argparse

import grpc


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def add_client_tls_args(p: argparse.ArgumentParser) -> None:
    """--tls-ca/--tls-cert/--tls-key/--tls-server-name of a client (`llmserve generate`, `llmserve health`)."""
    p.add_argument("--tls-ca", default=None, help="connect over TLS, trusting this CA bundle (PEM)")
    p.add_argument("--tls-cert", default=None, help="client certificate (PEM) for mutual TLS; needs --tls-key")
    p.add_argument("--tls-key", default=None, help="private key (PEM) of --tls-cert")
    p.add_argument("--tls-server-name", default=None,
                   help="expect this name in the server's certificate instead of the address's host")


def server_credentials(cert: str | None, key: str | None, client_ca: str | None) -> grpc.ServerCredentials | None:
    """None without a certificate (plaintext); with `client_ca`, clients must present a certificate it signed."""
    if cert is None:
        return None
    return grpc.ssl_server_credentials([(_read(key), _read(cert))], root_certificates=_read(client_ca),
                                       require_client_auth=client_ca is not None)


def channel_credentials(ca: str | None, cert: str | None = None, key: str | None = None) -> grpc.ChannelCredentials:
    """TLS credentials of a client; `ca` None trusts gRPC's default roots."""
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key),
                                        certificate_chain=_read(cert))


def open_channel(address: str, credentials: grpc.ChannelCredentials | None, server_name: str | None = None,
                 options=(), aio: bool = False) -> grpc.Channel | grpc.aio.Channel:
    """A plaintext channel when `credentials` is None, else TLS (checking `server_name` if given); `aio`: an
    asyncio channel (to be made inside the event loop that uses it)."""
    api = grpc.aio if aio else grpc
    if credentials is None:
        return api.insecure_channel(address, options=list(options))
    if server_name:
        options = [*options, ("grpc.ssl_target_name_override", server_name)]
    return api.secure_channel(address, credentials, options=list(options))


def client_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """The TLS credentials of a CLI client, None for plaintext: TLS as soon as --tls-ca or --tls-cert is given."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit("--tls-cert and --tls-key go together: give both or neither")
    if args.tls_ca is None and args.tls_cert is None:
        if args.tls_server_name:
            raise SystemExit("--tls-server-name needs --tls-ca (it applies to TLS connections only)")
        return None
    try:
        return channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    except OSError as e:
        raise SystemExit(f"cannot read a TLS file: {e}") from None


def client_channel(args: argparse.Namespace, address: str) -> grpc.Channel:
    """The channel of a CLI client (see client_credentials)."""
    return open_channel(address, client_credentials(args), args.tls_server_name)


def closed_hint(details: str, over_tls: bool) -> str:
    """What a connection the worker closed during set-up most likely means (gRPC only says "Socket closed")."""
    if "Socket closed" not in details:
        return ""
    if over_tls:
        return (" (the worker hung up during the TLS handshake: if it has --tls-client-ca it needs a client "
                "certificate signed by that CA: --worker-tls-cert/--worker-tls-key)")
    return " (the worker hung up: if it serves TLS, give --worker-tls-ca)"
