"""`adaflash serve`: argument handling, engine construction and the policy it reports (the HTTP server stubbed out)."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from adaflash.server.cli import register_cli
from tests.server.test_server import random_drafter  # noqa: F401  (fixture)
from tests.training.test_online import adaflash_drafter  # noqa: F401  (fixture)
from tests.helpers import private_cache


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="adaflash")
    register_cli(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


@pytest.fixture
def served(monkeypatch, tmp_path):
    """Run `serve` with the HTTP server replaced: returns what it would have served."""
    monkeypatch.setenv("ADAFLASH_CACHE", str(private_cache(tmp_path / "cache")))
    captured: dict = {}
    monkeypatch.setattr("adaflash.server.shutdown.serve", lambda app, admission, **kw: captured.update(app=app, **kw))

    def run(argv: list[str]) -> dict:
        args = _parse(argv)
        assert args.func(args) == 0
        return captured

    return run


def test_serve_profiles_the_throughput_policy_and_reports_it(served, tiny_chat_checkpoint, random_drafter, tmp_path, capsys):
    got = served(["--model", tiny_chat_checkpoint, "--drafter", random_drafter, "--dtype", "fp32",
                  "--max-batch", "2", "--max-len", "128", "--port", "8123", "--served-model-name", "tiny"])
    assert (got["host"], got["port"]) == ("127.0.0.1", 8123)
    err = capsys.readouterr().err
    assert "method dflash, length policy throughput" in err
    assert len(list((tmp_path / "cache" / "cost_models").glob("*.json"))) == 1  # profiled once, cached for next time
    client = TestClient(got["app"])
    assert 'policy="throughput"' in client.get("/metrics").text
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_serve_fixed_policy_and_plain_decoding(served, tiny_chat_checkpoint, random_drafter, capsys):
    served(["--model", tiny_chat_checkpoint, "--drafter", random_drafter, "--length-policy", "fixed:4", "--dtype", "fp32"])
    assert "length policy fixed:4" in capsys.readouterr().err
    got = served(["--model", tiny_chat_checkpoint, "--method", "ar", "--dtype", "fp32"])
    err = capsys.readouterr().err
    assert "method ar, length policy none" in err and "context 511 tokens" in err  # clipped to the model's 512 positions
    assert 'method="ar"' in TestClient(got["app"]).get("/metrics").text
    got = served(["--model", tiny_chat_checkpoint, "--method", "ar", "--dtype", "fp32", "--prompt-lookup", "5"])
    err = capsys.readouterr().err
    assert "length policy none (autoregressive), prompt lookup up to 5 tokens (sized by throughput)" in err
    assert "context 506 tokens" in err  # room for a 5-draft verify
    served(["--model", tiny_chat_checkpoint, "--method", "ar", "--dtype", "fp32", "--prompt-lookup", "5",
            "--prompt-lookup-length", "all"])
    assert "prompt lookup up to 5 tokens (all verified)" in capsys.readouterr().err


def test_serve_errors_are_clear(tiny_chat_checkpoint, random_drafter):
    with pytest.raises(ValueError, match="needs --drafter"):
        args = _parse(["--model", tiny_chat_checkpoint])
        args.func(args)
    with pytest.raises(ValueError, match="--method dflash or adaflash only"):
        args = _parse(["--model", tiny_chat_checkpoint, "--method", "ar", "--length-policy", "heuristic"])
        args.func(args)
    with pytest.raises(ValueError, match="1 <= num_tokens <= 15"):
        args = _parse(["--model", tiny_chat_checkpoint, "--method", "ar", "--prompt-lookup", "0"])
        args.func(args)
    with pytest.raises(ValueError, match="unknown length policy"):
        args = _parse(["--model", tiny_chat_checkpoint, "--drafter", random_drafter, "--length-policy", "fastest"])
        args.func(args)
    with pytest.raises(ValueError, match="max_prefill_tokens must be >= 1"):
        args = _parse(["--model", tiny_chat_checkpoint, "--method", "ar", "--max-prefill-tokens", "0"])
        args.func(args)


def test_serve_adaflash_records_and_watches_versions(served, tiny_chat_checkpoint, adaflash_drafter, tmp_path, capsys):
    from adaflash.formats.trajectories import read_trajectories
    from adaflash.models.drafters.checkpoint import publish_version

    versions = tmp_path / "versions"
    publish_version(adaflash_drafter, versions)
    got = served(["--model", tiny_chat_checkpoint, "--method", "adaflash", "--dtype", "fp32", "--max-batch", "2",
                  "--max-len", "128", "--record", str(tmp_path / "buffer"), "--watch-versions", str(versions)])
    assert "method adaflash, length policy adaflash" in capsys.readouterr().err
    client = TestClient(got["app"])
    assert 'method="adaflash"' in client.get("/metrics").text
    assert (tmp_path / "buffer").is_dir() and read_trajectories(tmp_path / "buffer") == []  # nothing served yet
