"""TLS, mutual TLS and bearer tokens for every service and every client, from files named in the
environment (or `kiln serve` flags).

Server: KILN_TLS_CERT + KILN_TLS_KEY turn TLS on; KILN_TLS_CLIENT_CA also demands a client
certificate signed by that CA (mTLS). KILN_AUTH_TOKEN_FILE (one token per line, several while
rotating) or KILN_AUTH_TOKEN turns the token check on: every call except grpc.health.v1 must carry
`authorization: Bearer <token>`, or it is UNAUTHENTICATED.
Client: KILN_TLS_CA (the CA that signed the servers) turns TLS on; KILN_TLS_CLIENT_CERT +
KILN_TLS_CLIENT_KEY present a certificate; KILN_TLS_SERVER_NAME overrides the name checked against
the server's certificate; the first token of the same token setting is sent with every call.
A service that calls others (the optimizer's peers) uses both halves. The server's token check is
kiln.rpc.interceptors.BearerTokenInterceptor.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import grpc

from kiln.core.errors import InvalidArgument


def _read(env: Mapping[str, str], name: str) -> Optional[bytes]:
    path = env.get(name)
    if not path:
        return None
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise InvalidArgument(f"{name}={path}: cannot read it: {e.strerror}") from None


@dataclass(frozen=True)
class AuthConfig:
    cert: Optional[bytes] = None          # server certificate chain (PEM)
    key: Optional[bytes] = None           # its private key
    client_ca: Optional[bytes] = None     # server: CA that client certificates must chain to (mTLS)
    ca: Optional[bytes] = None            # client: CA that server certificates must chain to (TLS on)
    client_cert: Optional[bytes] = None   # client: certificate to present
    client_key: Optional[bytes] = None
    server_name: str = ""                 # client: name to check the server's certificate against
    tokens: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "AuthConfig":
        tokens: tuple[str, ...] = ()
        token_file = _read(env, "KILN_AUTH_TOKEN_FILE")
        if token_file is not None:
            tokens = tuple(t.strip() for t in token_file.decode().splitlines() if t.strip())
            if not tokens:
                raise InvalidArgument(f"KILN_AUTH_TOKEN_FILE={env['KILN_AUTH_TOKEN_FILE']} holds no token")
        elif env.get("KILN_AUTH_TOKEN"):
            tokens = (env["KILN_AUTH_TOKEN"].strip(),)
        cfg = cls(_read(env, "KILN_TLS_CERT"), _read(env, "KILN_TLS_KEY"), _read(env, "KILN_TLS_CLIENT_CA"),
                  _read(env, "KILN_TLS_CA"), _read(env, "KILN_TLS_CLIENT_CERT"), _read(env, "KILN_TLS_CLIENT_KEY"),
                  env.get("KILN_TLS_SERVER_NAME", ""), tokens)
        if (cfg.cert is None) != (cfg.key is None):
            raise InvalidArgument("TLS needs both KILN_TLS_CERT and KILN_TLS_KEY")
        if cfg.client_ca is not None and cfg.cert is None:
            raise InvalidArgument("KILN_TLS_CLIENT_CA (mTLS) needs KILN_TLS_CERT and KILN_TLS_KEY")
        if (cfg.client_cert is None) != (cfg.client_key is None):
            raise InvalidArgument("a client certificate needs both KILN_TLS_CLIENT_CERT and KILN_TLS_CLIENT_KEY")
        if cfg.client_cert is not None and cfg.ca is None:
            raise InvalidArgument("a client certificate is sent over TLS only: set KILN_TLS_CA too")
        return cfg

    def server_credentials(self) -> Optional[grpc.ServerCredentials]:
        if self.cert is None:
            return None
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)

    def channel_credentials(self) -> Optional[grpc.ChannelCredentials]:
        if self.ca is None:
            return None
        return grpc.ssl_channel_credentials(self.ca, self.client_key, self.client_cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name and self.ca else []


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class BearerTokenClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call on the channel."""

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, d):
        metadata = list(d.metadata or ()) + [self._header]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)
