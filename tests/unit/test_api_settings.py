"""The HTTP API's tool and Responses settings: vLLM's start-up rule for the tool flags, and `llmserve serve` passing
them, its Redis URL and --namespace on to the API process it starts."""

from __future__ import annotations

import pytest

from api_svc.config import APIConfig
from common.config import ConfigError, from_namespace, parse
from llmserve import serve
from llmserve.cli import build_parser


def test_serve_passes_tool_flags_and_its_redis_to_the_api():
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                      "--namespace", "ns1", "--responses-store-ttl", "60"])
    argv = serve.api_argv(args, from_namespace(serve.ServeConfig, args), 50051, "redis://:pw@127.0.0.1:7000/0")
    back = from_namespace(APIConfig, build_parser().parse_args(argv[3:]))
    assert (back.enable_auto_tool_choice, back.tool_call_parser) == (True, "hermes")
    assert (back.redis_url, back.namespace, back.responses_store_ttl) == ("redis://:pw@127.0.0.1:7000/0", "ns1", 60)


def test_auto_tool_choice_needs_a_parser():
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        parse(APIConfig, ["--enable-auto-tool-choice"])
    with pytest.raises(SystemExit):  # argparse: not a registered parser
        parse(APIConfig, ["--tool-call-parser", "nope"])
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice"])
    with pytest.raises(ConfigError, match="--tool-call-parser"):
        from_namespace(serve.ServeConfig, args)


def test_serve_passes_https_to_the_api_and_points_it_at_the_loopback_listener():
    """With --tls-cert, serve's own API connects to the scheduler's plaintext loopback listener (any certificate,
    mutual TLS included, needs nothing more); --ssl-* (vLLM's HTTPS flags) reach the API process."""
    args = build_parser().parse_args(["serve", "--host", "10.1.2.3", "--tls-cert", "c.pem", "--tls-key", "k.pem",
                                      "--ssl-certfile", "h.pem", "--ssl-keyfile", "h.key", "--ssl-cert-reqs", "0"])
    own = from_namespace(serve.ServeConfig, args)
    argv = serve.api_argv(args, own, 50051, loopback_port=40123)
    back = from_namespace(APIConfig, build_parser().parse_args(argv[3:]))
    assert (back.scheduler, back.host) == ("127.0.0.1:40123", "10.1.2.3")
    assert (back.ssl_certfile, back.ssl_keyfile, back.scheduler_tls_ca) == ("h.pem", "h.key", None)
    assert not any(a.startswith("--tls") for a in argv)
    plain = serve.api_argv(args, own, 50051)
    assert from_namespace(APIConfig, build_parser().parse_args(plain[3:])).scheduler == "10.1.2.3:50051"
