"""The vLLM side of `--engine vllm`: one offline `vllm.LLM` in .venv-vllm's python, driven by
the pipeline (common/vllm/client.py) over JSON lines.

Runs as `python -m common.vllm.worker SETTINGS_JSON` with the repository root on PYTHONPATH. It
imports vLLM and nothing of the training stack (transformers 5.x here, 4.57 there). Protocol:
one JSON object per line on the original stdout (vLLM's own logging goes to stderr); the first
line answers start-up, then one answer per request read from stdin:
    {"op": "extract", "prompts": [[ids]...]}  -> {"ok": true, "files": [safetensors path per prompt]}
    {"op": "generate", "prompts": [[ids]...], "max_tokens": N, "stop_ids": [...], "temperature": T,
     "top_p": P, "seed": S, "ignore_eos": bool}  (all but the first three optional)
        -> {"ok": true, "outputs": [[ids]...], "stopped": [bool...], "counters": {spec-decode counters}}
Failures answer {"ok": false, "error": "..."}. Tokenizer initialisation is skipped: prompts are
token ids, so the checkpoint's tokenizer code never runs under transformers 5.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO

from common.errors import first_line

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def engine_kwargs(settings: dict[str, Any]) -> dict[str, Any]:
    """`vllm.LLM` arguments for a run: the target, and either extraction or an EAGLE-3 draft."""
    kwargs: dict[str, Any] = {
        "model": settings["model"], "dtype": settings["dtype"], "skip_tokenizer_init": True,
        "max_model_len": settings["max_model_len"], "trust_remote_code": settings["trust_remote_code"],
        "tensor_parallel_size": settings["tensor_parallel_size"], "disable_log_stats": False,
        "seed": 0, "enable_prefix_caching": False,
    }
    if settings.get("kv_cache_bytes"):  # on CPU a fixed size, not a share of the host's memory; on GPUs if asked
        kwargs["kv_cache_memory_bytes"] = settings["kv_cache_bytes"]
    elif settings.get("gpu_memory_utilization"):  # 04 --online: the rest of each GPU trains the draft
        kwargs["gpu_memory_utilization"] = settings["gpu_memory_utilization"]
    if settings.get("enforce_eager"):
        kwargs["enforce_eager"] = True
    for key in ("max_num_batched_tokens", "max_num_seqs"):
        if settings.get(key):
            kwargs[key] = settings[key]
    if settings["language_model_only"]:
        kwargs["language_model_only"] = True
    if settings.get("extract_layer_ids"):
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": settings["extract_layer_ids"]}}}
        cpu = settings["device"] == "cpu"
        kwargs["kv_transfer_config"] = {
            "kv_connector": "CpuHiddenStatesConnector" if cpu else "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": settings["storage"]},
            **({"kv_connector_module_path": "common.vllm.cpu_connector"} if cpu else {})}
    elif settings.get("draft"):
        kwargs["speculative_config"] = {"model": settings["draft"], "method": "eagle3",
                                        "num_speculative_tokens": settings["num_speculative_tokens"],
                                        "draft_sample_method": settings.get("draft_sample_method", "greedy")}
    return kwargs


def read_counters(llm) -> dict[str, Any]:
    """The spec-decode counters summed over label sets (totals since the engine started)."""
    totals: dict[str, Any] = {name: 0 for name in SPEC_COUNTERS}
    totals[PER_POSITION] = []
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            totals[metric.name] += int(metric.value)
        elif metric.name == PER_POSITION:
            values = list(metric.values)
            old = totals[PER_POSITION] + [0] * (len(values) - len(totals[PER_POSITION]))
            totals[PER_POSITION] = [a + int(b) for a, b in zip(old, values + [0] * (len(old) - len(values)))]
    return totals


def extract(llm, prompts: list[list[int]]) -> dict[str, Any]:
    from vllm import SamplingParams  # vLLM is imported once serve() has started it (see there)

    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                           SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
    return {"files": [out.kv_transfer_params["hidden_states_path"] for out in outputs]}


def generate(llm, prompts: list[list[int]], max_tokens: int, stop_ids: list[int], temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, ignore_eos: bool = True) -> dict[str, Any]:
    """Generations stopped at a stop id: greedy at temperature 0, else sampled with request i seeded
    with seed + i; `stopped` False where the token limit cut one; the spec-decode counters (totals so
    far). 05 compares with its own decoding, which stops at `stop_ids` only (`ignore_eos`); 00 lets
    vLLM also stop at the generation config's eos ids, as the target does when served."""
    from vllm import SamplingParams  # vLLM is imported once serve() has started it (see there)

    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                             seed=seed + i if temperature > 0 else None, stop_token_ids=stop_ids,
                             ignore_eos=ignore_eos, detokenize=False) for i in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return {"outputs": [list(out.outputs[0].token_ids) for out in outputs],
            "stopped": [out.outputs[0].finish_reason == "stop" for out in outputs], "counters": read_counters(llm)}


def answer(channel: TextIO, message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def serve(settings: dict[str, Any], channel: TextIO) -> None:
    try:  # imported here, not at the top, so that a broken vLLM install is answered over the pipe
        import vllm
        from vllm import LLM

        start = time.perf_counter()
        llm = LLM(**engine_kwargs(settings))
    except Exception as e:  # noqa: BLE001 - any start-up failure is reported, with the log for details
        answer(channel, {"ok": False, "error": first_line(e)})
        return
    answer(channel, {"ok": True, "vllm": vllm.__version__, "start_seconds": time.perf_counter() - start})
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        try:
            start = time.perf_counter()
            if request["op"] == "extract":
                result = extract(llm, request["prompts"])
            else:
                result = generate(llm, request["prompts"], request["max_tokens"], request["stop_ids"],
                                  request.get("temperature", 0.0), request.get("top_p", 1.0), request.get("seed", 0),
                                  request.get("ignore_eos", True))
            answer(channel, {"ok": True, "seconds": time.perf_counter() - start, **result})
        except Exception as e:  # noqa: BLE001 - reported to the pipeline, which names the request
            answer(channel, {"ok": False, "error": first_line(e)})


def main() -> None:
    settings = json.loads(sys.argv[1])
    # The protocol keeps the original stdout; everything else printing to fd 1 (vLLM's logging,
    # its spawned engine processes) goes to stderr.
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(settings, channel)


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main()
