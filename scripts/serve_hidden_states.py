"""Serve a target's EAGLE-3 hidden states by URL for 04 --online --engine vllm --vllm-url URL: one vLLM
engine (from .venv-vllm) that every torchrun rank of the trainer shares, on the trainer's GPUs (with
--gpu-memory-utilization leaving room for training) or on another host.

Usage:
    python scripts/serve_hidden_states.py --target /models/Kimi-K2.5 --trust-remote-code \
        --tensor-parallel-size 8 --gpu-memory-utilization 0.6 --max-model-len 8192 [--port 8100] [--host 0.0.0.0]
        [--enforce-eager --kv-cache-memory-bytes B --max-num-batched-tokens N --max-num-seqs S]
                                            # sharing the trainer's GPUs: the values plan_kimi_k25.py --online prints
    torchrun --nproc-per-node 8 04_train.py ... --online --engine vllm --vllm-url http://HOST:8100

The layer ids (default 2 N//2 N-3, as 02 and 04) must be the ones 04 trains with; 04 checks them
against the server's before it trains. The server runs until stopped (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from common.cli import run_main
from common.defaults import REPO_ROOT
from common.engine_device import DTYPES
from common.errors import PipelineError
from common.target.config import choose_layer_ids, load_target_info
from common.vllm.client import EngineSettings, check_servable, check_vllm_python, vllm_device, worker_env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="the target model folder")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--layer-ids", type=int, nargs="+", default=None, metavar="I",
                        help="three auxiliary layer ids, vLLM convention (default: 2 N//2 N-3)")
    parser.add_argument("--max-model-len", type=int, default=8192, help="longest sample, in tokens (default: 8192)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="vLLM's share of each GPU (default: vLLM's 0.9)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="vLLM's KV cache per GPU, a fixed size in place of what --gpu-memory-utilization leaves "
                             "(a prefill-only server needs one batch's: scripts/plan_kimi_k25.py --online sizes it)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs: they speed decoding, which this server never does, and take memory")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="vLLM's tokens per engine step")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="vLLM's sequences per engine step")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve another host (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--vllm-python", type=Path, default=None, help="python of the vLLM environment")
    args = parser.parse_args(argv)

    python = check_vllm_python(args.vllm_python)
    info = load_target_info(args.target, args.trust_remote_code)
    layer_ids = choose_layer_ids(args.layer_ids, info)
    check_servable(info, vllm_device())
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization < 1:
        raise PipelineError(f"--gpu-memory-utilization {args.gpu_memory_utilization}: a share in (0, 1)")
    settings = EngineSettings.for_target(info, args.max_model_len + 1, args.trust_remote_code,
                                         args.tensor_parallel_size, DTYPES[args.dtype])
    scratch = tempfile.mkdtemp(prefix="hidden-state-server-")  # the connector's files, deleted once sent
    settings.extract_layer_ids, settings.storage = [*layer_ids, info.num_layers], scratch
    settings.gpu_memory_utilization = args.gpu_memory_utilization
    settings.kv_cache_bytes, settings.enforce_eager = args.kv_cache_memory_bytes, args.enforce_eager
    settings.max_num_batched_tokens, settings.max_num_seqs = args.max_num_batched_tokens, args.max_num_seqs
    print(f"starting {settings.describe()} on http://{args.host}:{args.port} (scratch {scratch})", flush=True)
    os.chdir(REPO_ROOT)
    os.execve(str(python), [str(python), "-m", "common.vllm.state_server", settings.as_json(), "--host", args.host,
                            "--port", str(args.port)], worker_env())
    return 0  # not reached: the server replaced this process


if __name__ == "__main__":
    run_main(main)
