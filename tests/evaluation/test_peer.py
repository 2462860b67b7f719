"""The peer launcher: real processes, real health checks; llama-server's command line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from adaflash.evaluation.peer import launched_process, llama_server_command, require_binary
from tests.helpers import free_port


def test_launched_process_waits_for_health_and_stops_the_server(tmp_path: Path):
    (tmp_path / "health").write_text("ok")
    port = free_port()
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    with launched_process("static", cmd, f"http://127.0.0.1:{port}/health", tmp_path / "logs" / "static.log") as proc:
        assert proc.poll() is None
    assert proc.poll() is not None  # stopped on exit


def test_a_server_that_dies_before_it_is_healthy_names_its_log(tmp_path: Path):
    cmd = [sys.executable, "-c", "import sys; print('bad flag --frobnicate'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"exited with 3.*dead\.log[\s\S]*bad flag --frobnicate"):
        with launched_process("dead", cmd, f"http://127.0.0.1:{free_port()}/health", tmp_path / "dead.log"):
            pass


def test_llama_server_command_adds_model_slots_and_context(tmp_path: Path):
    (tmp_path / "llama-server").write_text("")
    cmd = llama_server_command(tmp_path, ["--spec-type", "draft-dflash"], 8123, parallel=32, ctx_per_slot=512,
                               threads=2, model_gguf=Path("/m/target.gguf"))
    assert cmd[0] == str(tmp_path / "llama-server")
    assert cmd[1:3] == ["--spec-type", "draft-dflash"]
    joined = " ".join(cmd)
    assert "-m /m/target.gguf" in joined and "-np 32" in joined and f"-c {32 * 512}" in joined
    assert "--port 8123" in joined and "-t 2" in joined
    # An explicit -m wins; no model at all is an error.
    own = llama_server_command(tmp_path, ["-m", "x.gguf"], 1, 1, 64, None, Path("/m/target.gguf"))
    assert own.count("-m") == 1 and "x.gguf" in own
    with pytest.raises(ValueError, match="-m GGUF"):
        llama_server_command(tmp_path, [], 1, 1, 64, None, None)


def test_missing_peer_binary_says_how_to_build_it(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"llama-server does not exist: build llama.cpp with `make peer`"):
        require_binary(tmp_path, "llama-server")


def test_sweep_with_a_peer_but_no_build_fails_before_starting_any_server(tmp_path: Path, monkeypatch, capsys):
    from adaflash.cli import main

    monkeypatch.setenv("ADAFLASH_PEER_DIR", str(tmp_path / "no-peer"))
    code = main(["bench", "sweep", "--server", "ar=--method ar", "--peer", "llama=", "--datasets", "gsm8k",
                 "--concurrency", "1", "--out", str(tmp_path / "sweep"), "--log-dir", str(tmp_path / "logs")])
    assert code == 2
    assert "no-peer/bin/llama-server does not exist: build llama.cpp with `make peer`" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()  # no server was launched


def test_vllm_server_command_serves_the_folder_under_our_name(tmp_path: Path):
    from adaflash.evaluation.peer import vllm_server_command

    bin_dir, model = tmp_path / "bin", tmp_path / "target"
    bin_dir.mkdir()
    (bin_dir / "python").write_text("")
    with pytest.raises(FileNotFoundError, match="adaflash export vllm"):
        vllm_server_command(bin_dir, [], 8000, model, "smollm2-135m", 64, 512)
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = ["--speculative-config", '{"method": "dflash"}']
    cmd = vllm_server_command(bin_dir, spec, 8000, model, "smollm2-135m", 64, 512)
    assert cmd[:3] == [str(bin_dir / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--model") + 1] == str(model) and cmd[cmd.index("--served-model-name") + 1] == "smollm2-135m"
    assert cmd[cmd.index("--max-num-seqs") + 1] == "64" and cmd[cmd.index("--max-model-len") + 1] == "512"
    assert spec[1] in cmd and cmd[cmd.index("--dtype") + 1] == "float32" and "--enforce-eager" in cmd
    bf16 = vllm_server_command(bin_dir, ["--dtype", "bfloat16"], 8000, model, "m", 8, 256)
    assert bf16.count("--dtype") == 1 and "bfloat16" in bf16
    with pytest.raises(FileNotFoundError, match="make peer-vllm"):
        vllm_server_command(tmp_path, [], 8000, model, "m", 8, 256)


@pytest.mark.parametrize("extra, message", [
    (["--vllm", "vllm-ar="], "--vllm needs --vllm-model"),
    (["--baseline", "nobody"], "--baseline 'nobody' is none of the servers"),
])
def test_sweep_refuses_a_vllm_peer_without_its_folder_or_an_unknown_baseline(tmp_path: Path, monkeypatch, capsys,
                                                                               extra, message):
    from adaflash.cli import main

    bin_dir = tmp_path / "peer" / "vllm-venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text("")
    monkeypatch.setenv("ADAFLASH_PEER_DIR", str(tmp_path / "peer"))
    try:
        code = main(["bench", "sweep", "--server", "ar=--method ar", *extra, "--datasets", "gsm8k", "--concurrency", "1",
                     "--out", str(tmp_path / "sweep"), "--log-dir", str(tmp_path / "logs")])
    except SystemExit as stop:
        code, err = 2, str(stop)
    else:
        err = capsys.readouterr().err
    assert code == 2 and message in err
    assert not (tmp_path / "logs").exists()  # no server was launched


def _fake_llama_server(tmp_path: Path, completion_status: int) -> Path:
    """A stand-in llama-server: answers /health, and /completion with `completion_status` (an AMX build's server that
    starts, then dies at its first matmul, answers none)."""
    tmp_path.mkdir()
    script = tmp_path / "llama-server"
    script.write_text(f"""#!{sys.executable}
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        self.send_response({completion_status}); self.end_headers(); self.wfile.write(b"{{}}")
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", port), H).serve_forever()
""")
    script.chmod(0o755)
    return tmp_path


def test_make_peers_smoke_test_tells_a_server_that_completes_from_one_that_does_not(tmp_path: Path):
    """`make peer` rebuilds without AMX when the built llama-server cannot answer a completion."""
    from adaflash.evaluation.peer import smoke_test_llama_server

    assert smoke_test_llama_server(_fake_llama_server(tmp_path / "good", 200), port=free_port()) is None
    problem = smoke_test_llama_server(_fake_llama_server(tmp_path / "bad", 500), port=free_port())
    assert problem is not None and "500" in problem
