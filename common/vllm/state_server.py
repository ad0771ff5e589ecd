"""A hidden-state server: one vLLM engine extracting EAGLE-3's states, reachable by URL, so that the
trainer (04 --online --vllm-url, every torchrun rank) and the target can share a host's GPUs or sit
on two hosts. Runs in .venv-vllm as the worker does (common/vllm/worker.py: the same engine and
extraction); started by scripts/serve_hidden_states.py, which reads the target in the training
environment and passes the engine settings as JSON.

    GET  /health   -> {"ok": true, "vllm": VERSION, "model": PATH, "extract_layer_ids": [...]}
    POST /extract  {"prompts": [[ids], ...]} -> safetensors bytes: "states_i" [S, L, H] (the layers in
                   `extract_layer_ids` order, the last pre-norm) and "token_ids_i" [S] per prompt i

One request runs at a time (a lock; vLLM batches the prompts of one request). The connector's files
go through a scratch folder on this host and are deleted once sent, so the trainer needs no shared
filesystem.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from common.errors import first_line
from common.vllm.worker import engine_kwargs, extract


def read_states(path: str) -> dict[str, Any]:
    """A connector file once its writer released the lock; the file and its lock removed after."""
    from safetensors.torch import load_file

    lock = Path(f"{path}.lock")
    try:
        if lock.exists():
            with lock.open() as handle:
                fcntl.flock(handle, fcntl.LOCK_SH)
        return load_file(path, device="cpu")
    finally:
        Path(path).unlink(missing_ok=True)
        lock.unlink(missing_ok=True)


class StateServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], llm, settings: dict[str, Any], version: str) -> None:
        super().__init__(address, Handler)
        self.llm, self.settings, self.version = llm, settings, version
        self.lock = threading.Lock()

    def extract(self, prompts: list[list[int]]) -> bytes:
        from safetensors.torch import save

        with self.lock:
            paths = extract(self.llm, prompts)["files"]
        tensors = {}
        for i, path in enumerate(paths):
            data = read_states(path)
            tensors[f"states_{i}"], tensors[f"token_ids_{i}"] = data["hidden_states"], data["token_ids"]
        return save(tensors)


class Handler(BaseHTTPRequestHandler):
    server: StateServer

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        if self.path != "/health":
            self.reply(404, json.dumps({"ok": False, "error": f"no {self.path}"}).encode())
            return
        s = self.server.settings
        self.reply(200, json.dumps({"ok": True, "vllm": self.server.version, "model": s["model"],
                                    "extract_layer_ids": s["extract_layer_ids"]}).encode())

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/extract":
            self.reply(404, json.dumps({"ok": False, "error": f"no {self.path}"}).encode())
            return
        try:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            body = self.server.extract(request["prompts"])
        except Exception as e:  # noqa: BLE001 - answered to the trainer, which names the server
            self.reply(500, json.dumps({"ok": False, "error": first_line(e)}).encode())
            return
        self.reply(200, body, "application/octet-stream")

    def reply(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: Any) -> None:  # one line per request would drown the engine's log
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("settings", help="the engine settings as JSON (scripts/serve_hidden_states.py)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args()
    settings = json.loads(args.settings)
    import vllm
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(**engine_kwargs(settings))
    server = StateServer((args.host, args.port), llm, settings, vllm.__version__)
    print(f"hidden-state server: vLLM {vllm.__version__}, {settings['model']}, layers {settings['extract_layer_ids']}, "
          f"started in {time.perf_counter() - start:,.0f}s; listening on http://{args.host}:{server.server_port}",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main()
