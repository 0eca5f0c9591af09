"""`model.rollout.engine.launch`: its checks, the dtype it reports, and the launched process's life, on a stand-in
server process (an HTTP `/health` with an engine process of its own, as vLLM's API server has). The real CPU vLLM
server is launched by `lit-rl fit` in `tests/integration/test_vllm.py`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

from lit_rl.errors import ConfigError
from lit_rl.rollout import VLLMServer, WeightTransfer
from lit_rl.rollout.server import client
from lit_rl.rollout.server.client import LocalVLLMServer, RolloutServerError

# A stand-in for vLLM's API server: answers /health, starts an "engine" child, and on SIGTERM ends it and exits (as
# vLLM does; with `--leave-engine` it leaves it running). `--die` exits at once with a message, as a server with a bad
# flag does; `--mute` never answers.
STAND_IN = textwrap.dedent(
    """
    import http.server, signal, subprocess, sys, time
    if "--mute" in sys.argv:  # alive, never answering: a server stuck loading
        print("loading weights ...", flush=True)
        time.sleep(600)
    if "--die" in sys.argv:
        print("error: unrecognized arguments: --die", flush=True)
        print("    For further information visit https://example.org", flush=True)
        sys.exit(2)
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    def stop(*_):
        if "--leave-engine" not in sys.argv:
            engine.terminate()
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"data": [{"id": "policy"}]}' if self.path == "/v1/models" else b""
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    port = int(sys.argv[sys.argv.index("--port") + 1])
    print("engine", engine.pid, flush=True)
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)

    def command(model, port, host="127.0.0.1", cpu=True, weight_transfer="file", extra_args=(), **_):
        return [sys.executable, str(script), *extra_args, "--port", str(port)], {}

    monkeypatch.setattr(client, "server_command", command)
    return script


def _engine_pid(log_path) -> int:
    for _ in range(100):
        for line in open(log_path).read().splitlines():
            if line.startswith("engine "):
                return int(line.split()[1])
        time.sleep(0.05)
    raise AssertionError("the stand-in never started its engine")


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_stop_ends_the_server_and_the_processes_it_started(stand_in, tmp_path):
    server = LocalVLLMServer("m", str(tmp_path / "server.log"), timeout_s=30)
    engine = _engine_pid(tmp_path / "server.log")
    assert psutil.pid_exists(engine) and server.process.poll() is None
    server.stop()
    server.stop()  # idempotent: close() and the exit hook may both call it
    assert server.process.poll() is not None and _gone(engine)


def test_a_server_that_does_not_start_fails_in_one_line_quoting_its_log(stand_in, tmp_path):
    log = tmp_path / "server.log"
    with pytest.raises(RolloutServerError) as failed:
        LocalVLLMServer("m", str(log), extra_args=["--die"], timeout_s=30)
    message = str(failed.value)
    assert "\n" not in message and "did not start: it exited with code 2" in message
    assert "unrecognized arguments: --die" in message and str(log) in message


def _start_then(stand_in, log, ending: str, *args: str) -> subprocess.CompletedProcess:
    """A process that starts the stand-in server (with `args`), prints its pid, then ends by `ending` (Python)."""
    starter = textwrap.dedent(
        f"""
        import os, signal, sys
        from lit_rl.rollout.server import client
        client.server_command = lambda *a, **k: (
            [sys.executable, {str(stand_in)!r}, *k["extra_args"], "--port", str(a[1])], {{}}
        )
        server = client.LocalVLLMServer("m", {str(log)!r}, extra_args={list(args)!r}, timeout_s=30)
        print(server.process.pid, flush=True)
        """
    )
    return subprocess.run([sys.executable, "-c", starter + ending], capture_output=True, text=True, timeout=60)


def test_a_server_that_never_answers_fails_in_one_line_after_the_time_limit_and_is_stopped(stand_in, tmp_path):
    with pytest.raises(RolloutServerError) as failed:
        LocalVLLMServer("m", str(tmp_path / "server.log"), extra_args=["--mute"], timeout_s=2)
    message = str(failed.value)
    assert "\n" not in message and "did not start: it did not answer within 2 s (loading weights ...)" in message
    assert not [p for p in psutil.process_iter(["cmdline"]) if "--mute" in (p.info["cmdline"] or [])]


def test_a_port_taken_by_another_process_first_is_said_and_sent_nothing(stand_in, tmp_path, monkeypatch):
    """Between `free_port` and the server's bind (tens of seconds of vLLM imports) another local user may take the
    port: its listener answered the health poll, which carried VLLM_API_KEY, and then every request. The start
    now waits for the child's own listener and stops in one line when another process holds the port."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Impostor(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    impostor = ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    monkeypatch.setenv("VLLM_API_KEY", "k3y")
    port = impostor.server_port
    try:
        with pytest.raises(RolloutServerError) as failed:
            LocalVLLMServer("m", str(tmp_path / "server.log"), port=port, timeout_s=30)
    finally:
        impostor.shutdown()
        impostor.server_close()
    message = str(failed.value)
    assert "\n" not in message
    assert f"did not start: it found its port {port} taken by another process (nothing was sent there)" in message
    assert seen == []


def test_a_launched_server_whose_port_another_process_takes_first_starts_on_another_which_the_engine_uses(
    stand_in, tmp_path, monkeypatch, capsys, first_free_port_taken
):
    """`launch: true` picks a free port, and another process may bind it first while vLLM imports: the server is
    started on another port, the line that says it is ready names that one, and the engine's requests go there
    (other ranks take rank 0's URL, `_follow`). Before, the launcher's port was fixed before the start: the run
    stopped with `found its port ... taken by another process`."""
    from types import SimpleNamespace

    from lit_rl.training.perf import BusyClock

    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # no core split in this test's process
    host = SimpleNamespace(  # what `VLLMServer.build` reads of the module (`RolloutHost`)
        policy=torch.nn.Linear(1, 1),
        tokenizer=SimpleNamespace(eos_token_id=2, pad_token_id=0),
        engine_clock=BusyClock(),
        policy_args=SimpleNamespace(model_name_or_path="m", trust_remote_code=False),
        trainer=SimpleNamespace(log_dir=str(tmp_path)),
    )
    engine = VLLMServer(launch=True, launch_timeout_s=30).build(host)
    try:
        url = f"http://127.0.0.1:{first_free_port_taken}"
        assert engine.launcher.url == url and [server.url for server in engine.pool.servers] == [url]
        assert engine.pool.servers[0].model_name == "policy"  # its /v1/models answered there
        assert f"vLLM server ready on {url} after" in capsys.readouterr().err
    finally:
        engine.close()
    assert engine.launcher.server is None


def test_a_killed_trainer_takes_its_server_with_it(stand_in, tmp_path):
    """SIGKILL leaves no exit hook to run: the kernel's parent-death signal ends the server, which ends its engine."""
    log = tmp_path / "server.log"
    result = _start_then(stand_in, log, "os.kill(os.getpid(), signal.SIGKILL)")
    assert result.returncode == -signal.SIGKILL, result.stderr
    server_pid, engine_pid = int(result.stdout.split()[0]), _engine_pid(log)
    assert _gone(server_pid) and _gone(engine_pid)


def test_a_trainer_that_fails_stops_its_server_on_the_way_out(stand_in, tmp_path):
    """An exception skips Lightning's teardown, so the engine is never closed: the exit hook stops the server's whole
    session (an engine its server left behind too), and the interpreter waits for them before it exits."""
    log = tmp_path / "server.log"
    result = _start_then(stand_in, log, "raise RuntimeError('the run failed')", "--leave-engine")
    assert result.returncode == 1 and "the run failed" in result.stderr
    server_pid, engine_pid = int(result.stdout.split()[0]), _engine_pid(log)
    assert not psutil.pid_exists(server_pid) and _gone(engine_pid)


def test_launch_settings_that_cannot_work_are_refused_naming_the_key():
    refused = {
        r"launch_args: --host \(--host\) is set by lit-rl": VLLMServer(launch=True, launch_args=["--host", "0.0.0.0"]),
        r"launch_args: --port=9000 \(--port\) is set": VLLMServer(launch=True, launch_args=["--port=9000"]),
        # vLLM's parser takes a prefix of a flag, and `_` for `-`: each would reach lit-rl's flag.
        r"launch_args: --hos \(--host\)": VLLMServer(launch=True, launch_args=["--hos", "0.0.0.0"]),
        r"--served_model_name \(--served-model-name\)": VLLMServer(launch=True, launch_args=["--served_model_name"]),
        r"--logprobs-mode \(--logprobs-mode\)": VLLMServer(launch=True, launch_args=["--logprobs-mode", "raw"]),
        "set by model.policy.trust_remote_code": VLLMServer(launch=True, launch_args=["--trust-remote-code"]),
        r"launch_args '\[\"--dtype\", \"bfloat16\"\]'": VLLMServer(launch=True, dtype="bfloat16"),
        "launch_args is set but model.rollout.engine.launch is false": VLLMServer(launch_args=["--dtype", "half"]),
        "server_urls names servers started elsewhere": VLLMServer(
            launch=True, server_urls=["http://127.0.0.1:1", "http://127.0.0.1:2"]
        ),
        "not through a weight receiver": VLLMServer(
            launch=True, transfer=WeightTransfer(method="http", receiver_url="http://127.0.0.1:8010")
        ),
        "launch_timeout_s must be": VLLMServer(launch=True, launch_timeout_s=0),
    }
    for message, config in refused.items():
        with pytest.raises(ConfigError, match=message):
            config.check()
    VLLMServer(launch=True, launch_args=["--max-model-len", "128"], transfer=WeightTransfer(method="gloo")).check()


def test_the_launched_servers_dtype_is_known_for_the_rollout_correction():
    cpu_default = torch.float32 if not torch.cuda.is_available() else None
    assert VLLMServer(launch=True).engine_dtype(torch.float32) == cpu_default
    assert VLLMServer(launch=True, launch_args=["--dtype", "bfloat16"]).engine_dtype(torch.float32) == torch.bfloat16
    assert VLLMServer(launch=True, launch_args=["--dtype=float16"]).engine_dtype(torch.float32) == torch.float16
    assert VLLMServer().engine_dtype(torch.float32) is None  # a server started elsewhere: unknown


def test_the_launched_command_serves_the_policy_on_loopback_with_the_rl_endpoints():
    model = "lit_rl/assets/tiny-qwen2-addition-sft"
    extra = ["--dtype", "bfloat16", "--max-model-len", "128"]
    argv, env = client.server_command(model, 8123, weight_transfer="gloo", extra_args=extra)
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "8123"
    assert "--weight-transfer-config" in argv and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["PYTHONSAFEPATH"] == "1"  # no working directory on the server's import path (docs/security.md)
    # The user's flags override the CPU defaults (the last --dtype wins) and come before lit-rl's own, which win.
    dtypes = [i for i, arg in enumerate(argv) if arg == "--dtype"]
    assert argv[dtypes[-1] + 1] == "bfloat16" and max(dtypes) < argv.index("--model") < argv.index("--host")
    assert "--trust-remote-code" not in argv  # unless the policy's own setting asks for it:
    trusted, _ = client.server_command(model, 8123, trust_remote_code=True)
    assert trusted[-1] == "--trust-remote-code"


def test_on_cpu_the_trainer_leaves_half_its_threads_to_the_launched_server_until_it_stops(monkeypatch, capsys):
    from lit_rl.rollout.server.launch import ServerLauncher, share_cores

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's setting wins
        assert share_cores(None) is None and torch.get_num_threads() == 4
        monkeypatch.delenv("OMP_NUM_THREADS")
        launcher = ServerLauncher("m", None, [], 1.0, "file")
        launcher.trainer_share = share_cores(None)
        assert torch.get_num_threads() == 2
        assert "the trainer now computes on 2 of its 4 CPU threads" in capsys.readouterr().err
        launcher.stop()  # a second engine of the same process starts from the whole count again
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="one core")
def test_on_cpu_the_launched_server_and_the_trainer_each_get_half_the_cores_until_it_stops(
    stand_in, tmp_path, monkeypatch, capsys
):
    """Sampling and training at once (asynchronous rollouts) on shared cores took each other's: the server's
    processes run on the second half of the cores, every thread of the trainer on the first, until the server stops.
    The user's own placement (`OMP_NUM_THREADS`, `VLLM_CPU_OMP_THREADS_BIND`) is left alone."""
    from lit_rl.rollout.server.launch import ServerLauncher, core_split

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cores = sorted(os.sched_getaffinity(0))
    trainer, server = core_split()
    assert trainer | server == set(cores) and not trainer & server and max(trainer) < min(server)
    threads = torch.get_num_threads()
    launcher = ServerLauncher("m", str(tmp_path), [], 30.0, "file")
    try:
        torch.set_num_threads(len(cores))
        launcher.start()
        engine = psutil.Process(_engine_pid(tmp_path / "vllm_server.log"))
        assert set(psutil.Process(launcher.server.process.pid).cpu_affinity()) == server
        assert set(engine.cpu_affinity()) == server  # inherited by what the server starts
        for task in os.listdir("/proc/self/task"):
            assert os.sched_getaffinity(int(task)) == trainer
        assert torch.get_num_threads() == len(trainer)
        assert f"(cores {','.join(map(str, sorted(trainer)))}; the server's: the others)" in capsys.readouterr().err
        launcher.stop()
        assert os.sched_getaffinity(0) == set(cores) and torch.get_num_threads() == len(cores)
    finally:
        launcher.stop()
        torch.set_num_threads(threads)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert core_split() is None


def test_the_error_quoted_from_the_log_is_the_line_that_says_what_went_wrong(tmp_path):
    # vLLM's own tail for --max-model-len above the model's (0.32): the exception, its message, then a link.
    log = tmp_path / "server.log"
    log.write_text(
        "(APIServer pid=1) INFO 11-29 06:24:27 [utils.py:1] starting\n"
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
        "  Value error, User-specified max_model_len (256) is greater than the derived max_model_len "
        "(max_position_embeddings=128.0 or model_max_length=None in model's config.json). " + "x" * 400 + "\n"
        "    For further information visit https://errors.pydantic.dev/2.13/v/value_error\n"
    )
    quoted = client._last_error(str(log))
    assert quoted.startswith("Value error, User-specified max_model_len (256) is greater") and len(quoted) == 300


def test_port_holder_reads_the_kernels_listeners_and_their_processes():
    """`port_holder` from the kernel's tables: a socket of this process's session listening on 127.0.0.1, or on
    IPv6's any-address (which takes 127.0.0.1's connections too), is the session's; the same socket seen from
    another session is another's; a port nothing listens on is no one's, and a listener on ::1 alone is not where
    127.0.0.1's connections land."""
    import socket

    from lit_rl.rollout.server.listeners import port_holder

    own, elsewhere = os.getsid(0), 2**22 + 1  # no process has that session (pid_max is at most 2**22)
    with socket.socket() as v4:
        v4.bind(("127.0.0.1", 0))
        v4.listen()
        port = v4.getsockname()[1]
        assert port_holder(port, own) == "session"
        assert port_holder(port, elsewhere, scans=1) == "other"
    assert port_holder(port, own) == "none"
    if socket.has_ipv6:
        for address, holder in (("::", "session"), ("::1", "none")):
            with socket.socket(socket.AF_INET6) as v6:
                try:
                    v6.bind((address, 0))
                except OSError:  # no IPv6 in this machine's kernel
                    continue
                v6.listen()
                assert port_holder(v6.getsockname()[1], own) == holder, address
