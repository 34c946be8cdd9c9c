"""TLS, mTLS and bearer tokens on real servers over loopback; S3 credentials never in a span or a log.
Certificates are made per run with openssl (a CA, a server certificate for 127.0.0.1, a client
certificate, and a second CA that nothing trusts)."""

from __future__ import annotations

import io
import logging
import subprocess

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kiln
from kiln.rpc import client
from kiln.rpc.auth import AuthConfig
from kiln.core.errors import InvalidArgument
from kiln.apps.examples import mlp_example
from kiln.apps.serve import serve
from kiln.v1 import services_pb2, services_pb2_grpc

TOKEN = "s3cr3t-token-for-tests"


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def _signed(d, ca: str, name: str, ext: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "rogue")
    _signed(d, "ca", "server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _signed(d, "ca", "client", "extendedKeyUsage=clientAuth\n")
    _signed(d, "rogue", "intruder", "extendedKeyUsage=clientAuth\n")
    (d / "tokens").write_text(f"old-token\n{TOKEN}\n")
    return d


def _read(pki, name):
    return (pki / name).read_bytes()


def _server(pki, store, stages=("executor",), mtls=False, token=False):
    auth = AuthConfig(cert=_read(pki, "server.pem"), key=_read(pki, "server.key"),
                      client_ca=_read(pki, "ca.pem") if mtls else None,
                      tokens=("old-token", TOKEN) if token else ())
    server, port = serve(list(stages), 0, store, auth=auth)
    return server, f"127.0.0.1:{port}"


def _run_unknown_session(address, auth: AuthConfig):
    """An Executor.Run for a session nobody has: NOT_FOUND proves the call got past authentication."""
    with client.channel(address, auth=auth) as ch:
        stub = services_pb2_grpc.ExecutorStub(ch)
        try:
            stub.Run(services_pb2.RunRequest(session="0" * 64), timeout=10)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_tls_server_refuses_plaintext_and_serves_a_client_that_trusts_its_ca(pki, file_store):
    server, addr = _server(pki, file_store)
    try:
        assert _run_unknown_session(addr, AuthConfig()) == grpc.StatusCode.UNAVAILABLE
        assert _run_unknown_session(addr, AuthConfig(ca=_read(pki, "rogue.pem"))) == grpc.StatusCode.UNAVAILABLE
        assert _run_unknown_session(addr, AuthConfig(ca=_read(pki, "ca.pem"))) == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop(0)


def test_mtls_needs_a_client_certificate_from_the_trusted_ca(pki, file_store):
    server, addr = _server(pki, file_store, mtls=True)
    ca = _read(pki, "ca.pem")
    try:
        assert _run_unknown_session(addr, AuthConfig(ca=ca)) == grpc.StatusCode.UNAVAILABLE
        intruder = AuthConfig(ca=ca, client_cert=_read(pki, "intruder.pem"), client_key=_read(pki, "intruder.key"))
        assert _run_unknown_session(addr, intruder) == grpc.StatusCode.UNAVAILABLE
        good = AuthConfig(ca=ca, client_cert=_read(pki, "client.pem"), client_key=_read(pki, "client.key"))
        assert _run_unknown_session(addr, good) == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop(0)


def test_bearer_token_missing_or_wrong_is_unauthenticated(pki, file_store):
    server, addr = _server(pki, file_store, token=True)
    ca = _read(pki, "ca.pem")
    try:
        assert _run_unknown_session(addr, AuthConfig(ca=ca)) == grpc.StatusCode.UNAUTHENTICATED
        assert _run_unknown_session(addr, AuthConfig(ca=ca, tokens=("guess",))) == grpc.StatusCode.UNAUTHENTICATED
        assert _run_unknown_session(addr, AuthConfig(ca=ca, tokens=(TOKEN,))) == grpc.StatusCode.NOT_FOUND
        assert _run_unknown_session(addr, AuthConfig(ca=ca, tokens=("old-token",))) == grpc.StatusCode.NOT_FOUND
        with client.channel(addr, auth=AuthConfig(ca=ca)) as ch:
            # a server stream is refused too, before it produces anything
            stream = services_pb2_grpc.ExecutorStub(ch).Generate(services_pb2.GenerateRequest(), timeout=10)
            with pytest.raises(grpc.RpcError) as e:
                next(iter(stream))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in e.value.details()
            # health probes need no token
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)


def test_compile_and_run_through_all_four_services_with_mtls_and_a_token(pki, file_store, monkeypatch):
    server, addr = _server(pki, file_store, stages=("importer", "optimizer", "codegen", "executor"), mtls=True,
                           token=True)
    try:
        (pki / "client-token").write_text(TOKEN + "\n")
        for k, v in {"KILN_TLS_CA": "ca.pem", "KILN_TLS_CLIENT_CERT": "client.pem",
                     "KILN_TLS_CLIENT_KEY": "client.key", "KILN_AUTH_TOKEN_FILE": "client-token"}.items():
            monkeypatch.setenv(k, str(pki / v))
        pipeline = kiln.Pipeline(file_store, {s: addr for s in ("importer", "optimizer", "codegen", "executor")})
        model, inputs = mlp_example(seed=5)
        compiled = kiln.compile(model, inputs, pipeline=pipeline)
        with torch.no_grad():
            expected = model(*inputs)
        np.testing.assert_allclose(compiled(*inputs).numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
        monkeypatch.delenv("KILN_AUTH_TOKEN_FILE")  # the same client without its token
        with pytest.raises(kiln.core.errors.KilnError, match="bearer token") as e:
            kiln.Pipeline(file_store, {s: addr for s in ("importer", "optimizer", "codegen", "executor")}).load(
                compiled.result.bundle, compiled.result.manifest)
        assert e.value.code == "UNAUTHENTICATED"
    finally:
        server.stop(0)


def test_incomplete_or_unreadable_settings_are_refused_with_the_setting_named(pki, tmp_path):
    with pytest.raises(InvalidArgument, match="KILN_TLS_CERT and KILN_TLS_KEY"):
        AuthConfig.from_env({"KILN_TLS_CERT": str(pki / "server.pem")})
    with pytest.raises(InvalidArgument, match="KILN_TLS_CA=.*cannot read"):
        AuthConfig.from_env({"KILN_TLS_CA": str(tmp_path / "missing.pem")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(InvalidArgument, match="holds no token"):
        AuthConfig.from_env({"KILN_AUTH_TOKEN_FILE": str(tmp_path / "empty")})
    with pytest.raises(InvalidArgument, match="needs KILN_TLS_CERT"):
        AuthConfig.from_env({"KILN_TLS_CLIENT_CA": str(pki / "ca.pem")})


def test_kiln_serve_flags_turn_tls_and_tokens_on(pki, tmp_path, kiln_serve):
    server = kiln_serve("executor", "--port", "0", "--tls-cert", str(pki / "server.pem"), "--tls-key",
                        str(pki / "server.key"), "--auth-token-file", str(pki / "tokens"),
                        env={"KILN_STORE": f"file://{tmp_path / 'store'}"})
    assert "(TLS, bearer token)" in server.first_line, server.first_line
    ca = _read(pki, "ca.pem")
    assert _run_unknown_session(server.addr, AuthConfig(ca=ca)) == grpc.StatusCode.UNAUTHENTICATED
    assert _run_unknown_session(server.addr, AuthConfig(ca=ca, tokens=(TOKEN,))) == grpc.StatusCode.NOT_FOUND


def test_s3_credentials_never_reach_a_span_or_a_log(s3, services, span_exporter):
    store, addrs = services
    env = s3.env("any")
    secret, access = env["KILN_S3_SECRET_KEY"], env["KILN_S3_ACCESS_KEY"]
    span_exporter.clear()
    records = io.StringIO()
    handler = logging.StreamHandler(records)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)  # everything any library logs during a compile over S3
    try:
        model, inputs = mlp_example(seed=8)
        compiled = kiln.compile(model, inputs, pipeline=kiln.Pipeline(store, addrs))
        compiled(*inputs)
        with pytest.raises(kiln.core.errors.InvalidArgument):  # an error path, too: a manifest is no bundle
            kiln.Pipeline(store, addrs).load(compiled.result.manifest, compiled.result.manifest)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    spans = span_exporter.get_finished_spans()
    assert len(spans) > 20 and records.getvalue()
    seen = [records.getvalue()]
    for s in spans:
        seen.append(s.to_json())
    text = "\n".join(seen)
    assert secret and secret not in text
    assert access and access not in text
