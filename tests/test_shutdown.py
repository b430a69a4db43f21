"""`draftline serve` as a process, stopped by signals: the first stops taking requests, aborts
the waiting ones with a reason, gives the running ones server.shutdown_timeout_s and exits 0;
a second exits at once."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from draftline.api.server import free_port

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
LONG = {"text": "def f(x):", "stream": True, "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}


def _serve(tmp_path, timeout_s: float):
    port = free_port()
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {random_init: {preset: tiny-qwen3, seed: 0}, max_model_len: 2048}\n"
                    "speculative: {method: none}\nbackend: reference\n"
                    f"server: {{port: {port}, max_batch_size: 1, shutdown_timeout_s: {timeout_s}}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "draftline", "serve", "--spec", str(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not start")


def _stream(url: str, body: dict, out: list, started: threading.Event) -> None:
    """Read one SSE stream to its end; ``out`` gets its last chunk (or the transport error)."""
    try:
        with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    out.append(json.loads(line[6:]))
                    started.set()
    except httpx.TransportError as exc:
        out.append(exc)
    started.set()


def test_sigterm_aborts_the_queue_gives_running_work_its_time_and_exits_0(tmp_path):
    proc, url = _serve(tmp_path, timeout_s=1.0)
    running, waiting, started = [], [], threading.Event()
    threads = [threading.Thread(target=_stream, args=(url, LONG, running, started))]
    threads[0].start()
    assert started.wait(60)  # the first request holds the only slot; the next one waits
    plain = {**LONG, "stream": False}
    threads.append(threading.Thread(target=lambda: waiting.append(httpx.post(url + "/generate", json=plain, timeout=60))))
    threads[1].start()
    time.sleep(0.5)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    took = time.monotonic() - sent
    for t in threads:
        t.join(timeout=30)
    err = proc.stderr.read()
    assert code == 0 and "Traceback" not in err, err[-2000:]
    assert took < 1.0 + 5.0, took  # the timeout, then the answers flushed
    last = running[-1]["meta_info"]["finish_reason"]
    assert last["type"] == "abort" and "not finished within server.shutdown_timeout_s (1 s)" in last["message"]
    assert "had not started" in waiting[-1].json()["meta_info"]["finish_reason"]["message"]
    with pytest.raises(httpx.TransportError):  # nothing listens any more
        httpx.get(url + "/health", timeout=2)


def test_a_second_signal_exits_at_once(tmp_path):
    proc, url = _serve(tmp_path, timeout_s=30.0)
    running, started = [], threading.Event()
    thread = threading.Thread(target=_stream, args=(url, LONG, running, started))
    thread.start()
    assert started.wait(60)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=10)
    assert code == 128 + signal.SIGTERM and time.monotonic() - sent < 3
    thread.join(timeout=30)
